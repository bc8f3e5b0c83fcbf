"""eval.py and convert on train.py's own outputs: class names travel with the weights and label every val
folder by name, in training's validation as in eval.py; periodic checkpoints evaluate; --use-ema says what is
missing; checkpoints/README.md's convert commands run as written."""
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from lipsformer.config import load_config

from conftest import load_script, reset_accelerate

TINY_RUN = dict(
    model="lipsformer_swin_t", num_classes=4, img_size=32, crop_pct=1.0, drop_path=0.0,
    model_kwargs=dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=2),
    workers=0, epochs=1, global_batch=4, batch_size=4, lr=1e-3, aa=None, reprob=0.0, mixup=0.0, cutmix=0.0,
    ema_decay=None, mixed_precision="no", checkpoint_every_steps=2, keep_last=3, log_every_steps=1)
CLASSES = ["cat", "ant", "dog", "bee"]  # folder names; sorted, they number ant 0, bee 1, cat 2, dog 3


def images(root: Path, classes, per_class: int) -> Path:
    for c in classes:
        rng = np.random.default_rng(CLASSES.index(c) if c in CLASSES else 99)
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((16, 16, 3)) * 60 + 40 * (CLASSES.index(c) if c in CLASSES else 5)).astype(np.uint8)
            Image.fromarray(pixels).save(root / c / f"{c}_{i}.png")
    return root


def config(tmp_path: Path, val_classes, **overrides) -> Path:
    data = tmp_path / "data"
    images(data / "train", CLASSES, 4)
    images(data / "val", val_classes, 2)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(dict(TINY_RUN, data_dir=str(data), output_dir=str(tmp_path / "run"), **overrides)))
    return path


def eval_cli(capsys, *argv):
    reset_accelerate()
    code = load_script("eval.py").main([*map(str, argv), "--workers", "0"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One finished tiny run (16 train images, 4 steps, checkpoints at steps 2 and 4), trained in this process."""
    from lipsformer.engine.train import train
    tmp = tmp_path_factory.mktemp("run")
    train(load_config(config(tmp, CLASSES)))
    reset_accelerate()
    return tmp / "run"


def test_training_validation_labels_val_classes_by_name(tmp_path, capsys):
    # a val/ lacking one of train/'s classes is numbered by train/'s names, not by its own sorted order (which
    # would score every class after the gap against the wrong label)
    from accelerate import Accelerator
    from conftest import config_model
    from lipsformer.engine.train import build_loaders
    cfg = load_config(config(tmp_path, ["cat", "dog", "bee"]))  # no ant: by place, bee would be 0
    try:
        _, val, _ = build_loaders(cfg, config_model(cfg), Accelerator(cpu=True))
    finally:
        reset_accelerate()
    labels = {Path(p).parent.name: t for p, t in val.dataset.reader.samples}
    assert labels == {"bee": 1, "cat": 2, "dog": 3}
    assert "val/: 3 of train/'s 4 classes (absent: ant); labels mapped by class name" in capsys.readouterr().out


def test_training_refuses_a_val_class_train_does_not_have_in_one_line(tmp_path, capsys):
    path = config(tmp_path, ["cat", "dog", "emu"])
    code = load_script("train.py").main(["--config", str(path)])
    reset_accelerate()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "val/ has class folders that are not among train/'s 4 classes: emu" in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_run_records_its_classes_and_eval_labels_any_val_folder_by_them(run, tmp_path, capsys):
    assert json.loads((run / "classes.json").read_text()) == ["ant", "bee", "cat", "dog"]
    full = images(tmp_path / "full", CLASSES, 2)
    lacking = images(tmp_path / "lacking", ["cat", "dog", "bee"], 2)
    rows = {}
    for name, folder in (("full", full), ("lacking", lacking)):
        code, out, err = eval_cli(capsys, "--checkpoint", run, "--data-dir", folder, "--predictions",
                                  tmp_path / f"{name}.csv")
        assert code == 0, err
        lines = (tmp_path / f"{name}.csv").read_text().splitlines()[1:]
        rows[name] = {Path(r.split(",")[0]).name: r.split(",")[1] for r in lines}
    assert rows["lacking"] == {k: v for k, v in rows["full"].items() if not k.startswith("ant")}
    assert rows["lacking"]["bee_0.png"] == "1"
    # an export carries the names (timm's label_names) and labels the same way
    export = tmp_path / "export"
    from lipsformer.convert import main as convert
    assert convert([str(run), "--out", str(export)]) == 0
    assert json.loads((export / "config.json").read_text())["pretrained_cfg"]["label_names"] == [
        "ant", "bee", "cat", "dog"]
    code, _, err = eval_cli(capsys, "--checkpoint", export, "--data-dir", lacking, "--predictions",
                            tmp_path / "export.csv")
    assert code == 0, err
    assert (tmp_path / "export.csv").read_text() == (tmp_path / "lacking.csv").read_text()


def test_a_periodic_checkpoint_evaluates_and_equals_the_final_weights(run, tmp_path, capsys):
    # checkpoints/step_N (train.py's own checkpoint) could not be evaluated at all
    data = images(tmp_path / "val", CLASSES, 2)
    results = {}
    for name, checkpoint in (("last", run), ("step", run / "checkpoints" / "step_000000004")):
        code, out, err = eval_cli(capsys, "--checkpoint", checkpoint, "--data-dir", data, "--output",
                                  tmp_path / f"{name}.json")
        assert code == 0, err
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert (results["step"]["top1"], results["step"]["top5"]) == (results["last"]["top1"], results["last"]["top5"])


@pytest.mark.parametrize("where, message", [
    ("", "was trained without an EMA (ema_decay is not set in its config.yaml); drop --use-ema"),
    ("last.safetensors", "holds one set of weights, not an EMA beside them"),
    ("checkpoints/step_000000002", "is a periodic training checkpoint: --use-ema takes the EMA of a finished run"),
])
def test_use_ema_where_there_is_none_says_why_in_one_line(run, tmp_path, capsys, where, message):
    # a run trained without EMA is told apart from an unfinished one, and a weight file holding one set of weights
    # refuses --use-ema rather than scoring those weights as if they were the EMA
    data = images(tmp_path / "val", CLASSES, 1)
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    code, _, err = eval_cli(capsys, "--checkpoint", run / where, "--data-dir", data, "--use-ema")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_every_convert_command_of_checkpoints_readme_runs_as_written(run, tmp_path, monkeypatch, capsys):
    # each command as written, on runs as the demo makes them (the demo run has no EMA)
    import ast
    import shlex

    import timm
    import torch
    from lipsformer.convert import main as convert
    from lipsformer.models import lipsformer_swin
    from safetensors.torch import load_file
    text = (Path(__file__).resolve().parents[1] / "checkpoints" / "README.md").read_text()
    section = text[text.index("## Converting and exporting"):]
    bash = section.split("```bash\n")[1].split("```")[0]
    python = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    released = timm.create_model("lipsformer_swin_t", init="xavier")  # stands in for the released file, full size
    torch.save({"model": lipsformer_swin.released_state_dict(released)}, tmp_path / "lipsformer-swin-tiny.pth")
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "demo_digits").symlink_to(run)
    commands = [line for line in bash.splitlines() if line.startswith("python -m lipsformer.convert ")]
    assert len(commands) == 2
    for line in commands:
        assert convert(shlex.split(line)[3:]) == 0, capsys.readouterr().err
    assert torch.equal(load_file("checkpoints/lipsformer_swin_t.digits/model.safetensors")["head.fc.weight"],
                       load_file(str(run / "last.safetensors"))["head.fc.weight"])
    expected = released.state_dict()
    loads = [s for s in ast.parse(python).body if isinstance(s, ast.Expr)]
    assert len(loads) == 2
    for statement in loads:  # each loads the converted released file
        model = eval(compile(ast.Expression(statement.value), "README", "eval"), {"timm": timm})
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), ast.unparse(statement)


def test_the_trained_input_size_is_what_the_weights_record_and_nothing_where_nothing_does(run, tmp_path, capsys,
                                                                                          caplog):
    # a bare 32 px weight file evaluated at 32 px claims no size (not the registered config's 224 px) and nothing
    # resized; the size a file or its run records is the one said
    import shutil
    from safetensors.torch import load_file, save_file
    data = images(tmp_path / "val", CLASSES, 1)
    model_args = dict(TINY_RUN["model_kwargs"], num_classes=4)
    bare = tmp_path / "bare" / "w.safetensors"  # a state dict saved by hand: no metadata, no config beside it
    bare.parent.mkdir()
    save_file(load_file(str(run / "last.safetensors")), str(bare))
    alone = tmp_path / "alone" / "best.safetensors"  # train.py's file away from its run folder: its metadata
    alone.parent.mkdir()
    shutil.copy(run / "best.safetensors", alone)
    said = {}
    for name, weights, size in (("bare", bare, 32), ("alone", alone, 32), ("alone_64", alone, 64)):
        caplog.clear()
        code, _, err = eval_cli(capsys, "--model", "lipsformer_swin_t", "--checkpoint", weights, "--data-dir", data,
                                "--model-args", json.dumps(model_args), "--img-size", size,
                                "--output", tmp_path / f"{name}.json")
        assert code == 0, err
        said[name] = ("made at" in caplog.text, json.loads((tmp_path / f"{name}.json").read_text()))
    assert said["bare"][0] is False and said["bare"][1]["trained_input_size"] is None  # nothing claimed
    assert said["alone"][0] is False and said["alone"][1]["trained_input_size"] == [3, 32, 32]
    assert said["alone_64"][0] is True and said["alone_64"][1]["trained_input_size"] == [3, 32, 32]
    assert "weights were made at 32 px" in caplog.text


def test_predictions_name_their_classes_where_the_names_are_known(run, tmp_path, capsys):
    # the predictions CSV named classes by index only, although the run folder records their names
    import csv
    from safetensors.torch import load_file, save_file
    names = json.loads((run / "classes.json").read_text())  # ["ant", "bee", "cat", "dog"]: train/'s sorted folders
    folder = images(tmp_path / "val", ["dog", "bee"], 1)
    bare = tmp_path / "bare" / "w.safetensors"  # the same weights with nothing beside them: no names recorded
    bare.parent.mkdir()
    save_file(load_file(str(run / "last.safetensors")), str(bare))
    bare_args = ["--model", "lipsformer_swin_t", "--checkpoint", bare, "--model-args",
                 json.dumps(dict(TINY_RUN["model_kwargs"], num_classes=4, img_size=32))]
    v2 = tmp_path / "v2"
    for c in range(4):
        images(v2, [str(c)], 1)
    tables = {}
    for case, args in (("run", ["--checkpoint", run, "--data-dir", folder]),
                       ("folders", [*bare_args, "--data-dir", images(tmp_path / "all", CLASSES, 1)]),
                       ("v2", [*bare_args, "--data-dir", v2, "--dataset", "imagenet_v2"])):
        code, _, err = eval_cli(capsys, *args, "--predictions", tmp_path / f"{case}.csv")
        assert code == 0, err
        with open(tmp_path / f"{case}.csv", newline="") as f:
            tables[case] = list(csv.DictReader(f))
    for case in ("run", "folders"):  # the run's classes.json; a bare file's folders (they are its classes, in order)
        rows = tables[case]
        assert list(rows[0]) == ["path", "targets", "target_names"] + [
            c for i in range(1, 5) for c in (f"top{i}", f"top{i}_name", f"prob{i}")]
        for row in rows:
            assert row["target_names"] == Path(row["path"]).parent.name == names[int(row["targets"])]
            assert all(row[f"top{i}_name"] == names[int(row[f"top{i}"])] for i in range(1, 5))
    # ImageNet-v2 folders of a 4-class model without names: no names to give, the index columns alone
    assert list(tables["v2"][0]) == ["path", "targets"] + [c for i in range(1, 5) for c in (f"top{i}", f"prob{i}")]
