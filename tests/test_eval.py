"""eval.py: each data set's label rule, exact accuracy under controlled predictions, one vs two processes."""
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from torchvision.transforms import ToTensor

from lipsformer.data import EvalDataset, eval_samples
from lipsformer.engine.evaluate import evaluate_dataset, score
from lipsformer.sources import export

from conftest import TINY, load_script, reset_accelerate
from helpers import EVAL, NUM_CLASSES, call, write_image

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


class ColourModel(torch.nn.Module):
    """Ranks ``round(red * 255 / 20)`` first, then the other classes in index order."""

    def forward(self, x):
        predicted = (x[:, 0].mean((1, 2)) * 255 / 20).round().long()
        logits = -torch.arange(NUM_CLASSES, dtype=torch.float).repeat(len(x), 1) / 100
        logits[torch.arange(len(x)), predicted] = 10.0
        return logits


def evaluate(samples):
    from accelerate import Accelerator
    return evaluate_dataset(ColourModel(), EvalDataset(samples, ToTensor()), Accelerator(cpu=True), batch_size=3,
                            workers=0)


# -- labels of each layout -------------------------------------------------------------------------
def test_imagenet_val_labels_are_sorted_synsets_as_in_training(tmp_path):
    for synset, n in (("n02000000", 2), ("n01000000", 1), ("n10000000", 1)):
        for i in range(n):
            write_image(tmp_path / "val" / synset / f"{synset}_{i}.png", 0)
    samples = eval_samples("imagenet", tmp_path)  # the training root: val/ is found
    assert [(Path(p).parent.name, labels) for p, labels in samples] == [
        ("n01000000", (0,)), ("n02000000", (1,)), ("n02000000", (1,)), ("n10000000", (2,))]
    train = timm.data.create_dataset("", root=str(tmp_path), split="val")  # what train.py's loader sees
    assert [t for _, t in train.reader.samples] == [labels[0] for _, labels in samples]


def test_imagenet_v2_folder_name_is_the_class_index(tmp_path):
    for c in range(NUM_CLASSES):
        if c != 7:  # a missing class must not shift the others
            write_image(tmp_path / str(c) / "a.jpeg", c)
    samples = eval_samples("imagenet_v2", tmp_path)
    assert sorted((int(Path(p).parent.name), labels) for p, labels in samples) == [
        (c, (c,)) for c in range(NUM_CLASSES) if c != 7]
    result = evaluate(samples)
    assert (result["top1"], result["count"]) == (100.0, 11)
    (tmp_path / "extra").mkdir()
    with pytest.raises(ValueError, match="named 0 ... 999; found .*extra"):
        eval_samples("imagenet_v2", tmp_path)


def write_real(tmp_path: Path, real: list) -> Path:
    path = tmp_path / "real.json"
    path.write_text(json.dumps(real))
    return path


def test_real_labels_are_matched_by_file_name_not_loader_order(tmp_path):
    # Synset folders put image 3 before image 1 in loader order.
    names = {1: "n02", 2: "n03", 3: "n01", 4: "n02", 5: "n01", 6: "n03"}
    for i, synset in names.items():
        write_image(tmp_path / "val" / synset / f"ILSVRC2012_val_{i:08d}.JPEG", 0)
    real = [[1], [], [3, 4], [5], [], [0, 6], [9]]  # 7 lists: one more than there are images
    samples = eval_samples("imagenet_real", tmp_path, write_real(tmp_path, real))
    assert [Path(p).name for p, _ in samples][:2] == ["ILSVRC2012_val_00000003.JPEG", "ILSVRC2012_val_00000005.JPEG"]
    assert {int(Path(p).stem[-8:]): labels for p, labels in samples} == {
        i: tuple(real[i - 1]) for i in names}


def test_real_exact_accuracy_leaves_out_empty_lists(tmp_path):
    # image number -> (class the model predicts first, ReaL list)
    cases = {1: (3, [3]), 2: (5, []), 3: (4, [1, 4]), 4: (2, [0, 9]), 5: (7, []), 6: (6, [11])}
    for i, (predicted, _) in cases.items():
        write_image(tmp_path / f"ILSVRC2012_val_{i:08d}.JPEG", predicted)
    real = write_real(tmp_path, [labels for _, labels in cases.values()])
    result = evaluate(eval_samples("imagenet_real", tmp_path, real))
    # Scored: 1 (right), 3 (right, 4 is in [1, 4]), 4 (top-5 is [2, 0, 1, 3, 4]: 0 is in [0, 9]), 6 (wrong).
    assert (result["count"], result["images"], result["excluded"]) == (4, 6, 2)
    assert result["top1"] == 50.0 and result["top5"] == 75.0


def test_real_bad_inputs_name_the_problem(tmp_path):
    write_image(tmp_path / "ILSVRC2012_val_00000009.JPEG", 0)
    with pytest.raises(ValueError, match="needs --real-labels"):
        eval_samples("imagenet_real", tmp_path)
    with pytest.raises(ValueError, match=r"image 9, but .*real\.json has labels for 2 images"):
        eval_samples("imagenet_real", tmp_path, write_real(tmp_path, [[1], [2]]))
    with pytest.raises(ValueError, match="must be a JSON list of label lists"):
        eval_samples("imagenet_real", tmp_path, write_real(tmp_path, {"1": [2]}))
    write_image(tmp_path / "cat.jpg", 0)
    with pytest.raises(ValueError, match=r"cat\.jpg is not one"):
        eval_samples("imagenet_real", tmp_path, write_real(tmp_path, [[1]] * 9))


def test_score_counts_a_prediction_right_when_it_is_in_the_list():
    classes = torch.tensor([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [9, 8, 7, 6, 5]])
    assert score(classes, [[1], [], [5, 10]]) == dict(top1=50.0, top5=100.0, count=2)
    nothing = score(classes, [[], [], []])  # no accuracy, and why: never a 0% that ranks as a score
    assert (nothing["top1"], nothing["top5"], nothing["count"]) == (None, None, 0) and nothing["top1_reason"]


# real.json as it may come (images 1 .. 3 of a 12-class model), and what the one line says
REAL_DEFECTS = [
    ('{"1": [2]}', "must be a JSON list of label lists"),
    ("[[1], [2], ", "cannot read the ReaL labels file"),
    ("[[1], 2, [3]]", "entry 1 (image 2) is 2 (number); each entry is the list of that image's labels"),
    ("[[1], [null], [3]]", "image 2's labels [null] hold null (null); a label is a class index"),
    ("[[1], [true], [3]]", "image 2's labels [true] hold true (boolean)"),
    ("[[1], [2.0], [3]]", "image 2's labels [2.0] hold 2.0 (number)"),
    ('[[1], ["2"], [3]]', 'hold "2" (string)'),
    ("[[1], [-1], [3]]", "image 2's label is class -1, which no output of the classifier is (the model's 12 "
                         "classes are 0 .. 11)"),
    ("[[1], [3, 12], [3]]", "image 2's label is class 12, which no output"),
    ("[[1], [2]]", "is image 3, but"),
    ("[[], [], []]", "gives none of the 3 images under"),
]


def test_real_labels_are_refused_in_one_line_unless_each_is_a_class_of_the_head(tmp_path, capsys):
    """eval.py --dataset imagenet_real with a labels file of the wrong types, a label outside the classifier's
    classes (-1 included), fewer lists than images, or no label for any image (nothing would be scored, and a 0%
    top-1 would rank as a result): one line naming the file and the entry, exit 2, nothing written."""
    from helpers import refused
    export(timm.create_model("lipsformer_swin_t", num_classes=NUM_CLASSES, **TINY["swin"]), tmp_path / "weights")
    for i in range(1, 4):
        write_image(tmp_path / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", i)
    real = tmp_path / "real.json"
    argv = ["--checkpoint", tmp_path / "weights", "--data-dir", tmp_path / "val", "--dataset", "imagenet_real",
            "--real-labels", real, "--workers", 0, "--output", tmp_path / "r.json"]
    for text, message in REAL_DEFECTS:
        real.write_text(text)
        refused(capsys, load_script("eval.py").main, argv, tmp_path, str(real), message)
    real.write_text("[[1], [], [3, 11]]")  # the same call with labels that fit: scored
    assert load_script("eval.py").main([str(a) for a in argv]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["count"] == 2


def test_an_evaluation_that_scores_no_image_has_no_accuracy_and_ranks_last(tmp_path, capsys):
    """ReaL labels whose labelled images are all unreadable (--max-bad-fraction 1 lets the pass finish; the readable
    ones have no labels): top-1 and top-5 are null with the reason in the JSON, ``n/a`` on the console, empty in a
    table's CSV, and such a row comes after every scored one, never ranked as a 0%."""
    from helpers import call
    export(timm.create_model("lipsformer_swin_t", num_classes=NUM_CLASSES, **TINY["swin"]), tmp_path / "weights")
    for i in range(1, 4):
        write_image(tmp_path / "val" / f"ILSVRC2012_val_{i:08d}.JPEG", i)
    (tmp_path / "val" / "ILSVRC2012_val_00000002.JPEG").write_bytes(b"not an image")
    (tmp_path / "real.json").write_text("[[], [2], []]")
    argv = ["--checkpoint", tmp_path / "weights", "--data-dir", tmp_path / "val", "--dataset", "imagenet_real",
            "--real-labels", tmp_path / "real.json", "--workers", 0, "--max-bad-fraction", 1, "--output"]
    main = load_script("eval.py").main
    code, out, err = call(capsys, main, argv + [tmp_path / "r.json"])
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["top1"], result["top5"], result["count"]) == (None, None, 0)
    assert result["top1_reason"] == "no image was scored: none had both a label and a readable file"
    assert "top-1 n/a  top-5 n/a  (0 of 3 images scored" in out
    code, out, err = call(capsys, main, argv + [tmp_path / "t.csv", "--checkpoint", tmp_path / "weights",
                                                tmp_path / "weights" / "model.safetensors"])
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert code == 0 and [r["top1"] for r in rows] == ["", ""] and rows[0]["top1_reason"], err


def test_a_table_ranks_rows_without_accuracy_after_every_scored_one():
    from lipsformer.engine.evaluate_many import ranked
    rows = [dict(top1=None, source="a"), dict(top1=0.0, source="b"), dict(top1=50.0, source="c"),
            dict(top1=None, source="d"), dict(top1=50.0, source="e")]
    assert [r["source"] for r in ranked(rows)] == ["c", "e", "b", "a", "d"]  # ties keep the order given


# -- eval.py, one and two processes -------------------------------------------------------------------
def test_eval_cli_two_processes_equal_one_on_an_odd_image_count(tmp_path, capsys):
    model = timm.create_model("lipsformer_swin_t", num_classes=NUM_CLASSES, **TINY["swin"])
    export(model, tmp_path / "weights")
    rng = np.random.default_rng(0)
    for i in range(13):  # odd: the second process gets a padded duplicate
        pixels = (rng.random((40, 40, 3)) * 255).astype(np.uint8)
        folder = tmp_path / "v2" / str(i % NUM_CLASSES)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i}.png")

    def argv(tag):
        out = tmp_path / tag
        return ["--model", "lipsformer_swin_t", "--checkpoint", str(tmp_path / "weights"), "--data-dir",
                str(tmp_path / "v2"), "--dataset", "imagenet_v2", "--batch-size", "4", "--workers", "0", "--output",
                str(out.with_suffix(".json")), "--predictions", str(out.with_suffix(".csv"))]

    def read(tag):
        out = tmp_path / tag
        return json.loads(out.with_suffix(".json").read_text()), list(csv.DictReader(out.with_suffix(".csv").open()))

    code, stdout, err = call(capsys, EVAL.main, argv("one"))  # one process: this one
    assert code == 0, err
    proc = subprocess.run([str(Path(PY).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "eval.py"), *argv("two")], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (one, rows_one), (two, rows_two) = read("one"), read("two")
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["count"] == two["count"] == one["images"] == 13
    assert (one["top1"], one["top5"]) == (two["top1"], two["top5"])
    assert f"on {tmp_path / 'v2'} (ImageNet-v2 layout, 12 class folders): top-1" in stdout
    assert "13 of 13 images" in stdout
    assert [(r["path"], r["targets"], r["top1"], r["top5"]) for r in rows_one] == \
           [(r["path"], r["targets"], r["top1"], r["top5"]) for r in rows_two]
    assert all(abs(float(a["prob1"]) - float(b["prob1"])) < 1e-5 for a, b in zip(rows_one, rows_two))
    assert {r["targets"] for r in rows_one if Path(r["path"]).parent.name == "10"} == {"10"}
    assert len(rows_one[0]) == 12  # path, targets, 5 x (class, probability)


@pytest.mark.parametrize("script, argv", [
    ("eval.py", ["--checkpoint", "x", "--data-dir", "x", "--certify-eps", "wide"]),
    ("train.py", ["--config", "missing.yaml"]),
])
def test_commands_destroy_their_process_group_before_they_return(tmp_path, script, argv):
    # Left to the interpreter's exit, gloo's threads now and then abort a process whose results are already
    # written (SIGABRT, "terminate called without an active exception"): CI saw eval.py's second rank do it.
    import torch.distributed as dist
    main = load_script(script).main
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert main(argv) == 2  # a handled error: the exit code passes through
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_evaluate_model_in_bf16_and_its_argument_checks(tmp_path):
    from lipsformer.engine.evaluate import evaluate_model
    model = timm.create_model("lipsformer_cswin_t", num_classes=NUM_CLASSES, **TINY["cswin"])
    export(model, tmp_path / "weights")
    data = tmp_path / "v2"
    for c in range(3):
        write_image(data / str(c) / "a.png", c)
    result, samples = evaluate_model(None, data, "imagenet_v2", checkpoint=tmp_path / "weights", amp="bf16",
                                     batch_size=2, workers=0)
    assert (result["count"], result["amp"], result["model"]) == (3, "bf16", "lipsformer_cswin_t")
    with pytest.raises(ValueError, match="exactly one of --checkpoint PATH and --pretrained"):
        evaluate_model("lipsformer_cswin_t", data, "imagenet_v2")
    with pytest.raises(ValueError, match="--use-ema applies to --checkpoint"):
        evaluate_model("lipsformer_cswin_t", data, "imagenet_v2", pretrained=True, use_ema=True)


def test_eval_cli_rejects_bad_input_with_a_message(tmp_path, capfd):
    code = load_script("eval.py").main(["--checkpoint", str(tmp_path / "missing.safetensors"), "--model",
                                        "lipsformer_swin_t", "--data-dir", str(tmp_path)])
    err = capfd.readouterr().err
    assert code == 2 and "error:" in err and err.count("\n") <= 2


# -- unreadable images: one policy with training ------------------------------------------------------
def test_unreadable_images_are_skipped_counted_and_limited_as_in_training(tmp_path):
    from lipsformer.engine.evaluate import TooManyBadSamples
    for c in range(NUM_CLASSES):
        write_image(tmp_path / str(c) / "a.png", c)
    (tmp_path / "3" / "a.png").write_bytes(b"")  # empty
    good = (tmp_path / "5" / "a.png").read_bytes()
    (tmp_path / "5" / "a.png").write_bytes(good[: len(good) // 2])  # truncated
    samples = eval_samples("imagenet_v2", tmp_path)
    from accelerate import Accelerator
    result = evaluate_dataset(ColourModel(), EvalDataset(samples, ToTensor()), Accelerator(cpu=True), batch_size=3,
                              workers=0, max_bad_fraction=0.2)
    # the two unreadable images are neither scored as a neighbour nor counted right: 10 of 12 scored, all right
    assert (result["top1"], result["count"], result["images"], result["unreadable"]) == (100.0, 10, 12, 2)
    assert sorted(Path(p).parent.name for p in result["unreadable_files"]) == ["3", "5"]
    with pytest.raises(TooManyBadSamples, match=r"evaluation: 2 of 12 images failed to load \(more than 10%\), "
                                                r"e\.g\. .*3/a\.png"):
        evaluate_dataset(ColourModel(), EvalDataset(samples, ToTensor()), Accelerator(cpu=True), batch_size=3,
                         workers=0, max_bad_fraction=0.1)


def test_eval_cli_reports_unreadable_images_and_refuses_fp16_on_cpu(tmp_path, capfd):
    model = timm.create_model("lipsformer_swin_t", num_classes=NUM_CLASSES, **TINY["swin"])
    export(model, tmp_path / "weights")
    for c in range(4):
        write_image(tmp_path / "v2" / str(c) / "a.png", c)
    (tmp_path / "v2" / "2" / "a.png").write_bytes(b"not an image")
    main = load_script("eval.py").main

    def run(*extra):  # eval.py's main in this process (as `python eval.py` calls it): exit code, stdout, stderr
        code = main(["--checkpoint", str(tmp_path / "weights"), "--data-dir", str(tmp_path / "v2"), "--dataset",
                     "imagenet_v2", "--workers", "0", *extra])
        reset_accelerate()
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess("eval.py", code, out, err)

    ok = run("--max-bad-fraction", "0.25", "--output", str(tmp_path / "r.json"), "--predictions",
             str(tmp_path / "p.csv"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    rows = {Path(r["path"]).parent.name: r for r in csv.DictReader((tmp_path / "p.csv").open())}
    assert len(rows) == 4 and rows["2"]["top1"] == rows["2"]["prob1"] == "" and rows["1"]["top1"] != ""
    assert "(3 of 4 images scored, 1 unreadable skipped;" in ok.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["unreadable"] == 1 and saved["unreadable_files"] == [str(tmp_path / "v2" / "2" / "a.png")]
    stopped = run()  # the default threshold is training's (1%)
    assert stopped.returncode == 3 and "stopped: evaluation: 1 of 4 images failed to load" in stopped.stderr
    assert "2/a.png" in stopped.stderr and "Traceback" not in stopped.stderr
    if not torch.cuda.is_available():
        fp16 = run("--amp", "fp16")
        assert fp16.returncode == 2 and fp16.stderr.strip() == (
            "error: --amp fp16 needs a GPU: on CPU Accelerate would quietly run in fp32; use --amp bf16")


# -- no number silently wrong, one line per mistake -------------------------------------------
def folder_of(root: Path, classes, per_class: int = 2) -> Path:
    """An image folder with ``per_class`` random images under each named class folder (same images per name)."""
    for name in classes:
        rng = np.random.default_rng(abs(hash(name)) % 2 ** 32)
        for i in range(per_class):
            (root / name).mkdir(parents=True, exist_ok=True)
            Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / name / f"{name}_{i}.png")
    return root


def named_weights(path: Path, names=None) -> Path:
    """An exported tiny model; with ``names`` its config.json records them as the class names (label order)."""
    model = timm.create_model("lipsformer_swin_t", num_classes=4, **TINY["swin"])
    if names:
        model.pretrained_cfg = dict(model.pretrained_cfg, num_classes=4, label_names=tuple(names))
    return export(model, path)


def test_eval_labels_a_val_folder_by_class_name_not_by_sorted_place(tmp_path, caplog):
    # a folder lacking a class, or holding a subset in another order, is labelled by each folder's name, not by its
    # sorted place (which would score a digits model at 87% on nine classes as 1.26%)
    from lipsformer.engine.evaluate import evaluate_model
    names = ["zebra", "ant", "cat", "bee"]  # label order of the model: not sorted
    weights = named_weights(tmp_path / "w", names)
    full = folder_of(tmp_path / "full", names)
    _, samples = evaluate_model(None, full, checkpoint=weights, batch_size=8, workers=0)
    by_path = {Path(p).name: labels for p, labels in samples}
    assert {Path(p).parent.name: labels[0] for p, labels in samples} == {n: names.index(n) for n in names}
    lacking = folder_of(tmp_path / "lacking", ["zebra", "ant", "bee"])  # no cat: bee would become 2 by place
    with caplog.at_level("WARNING"):
        result, samples = evaluate_model(None, lacking, checkpoint=weights, batch_size=8, workers=0)
    assert {Path(p).name: labels for p, labels in samples} == {
        k: v for k, v in by_path.items() if not k.startswith("cat")}
    assert "3 of the model's 4 classes (absent: cat); labels mapped by class name" in caplog.text
    assert result["data"] == "image folder, 3 classes"


@pytest.mark.parametrize("classes, names, message", [
    (["ant", "cat", "dog"], ["zebra", "ant", "cat", "bee"],
     "has class folders that are not among the model's 4 classes: dog"),
    (["a", "b", "c"], None, "has 3 class folders but the model has 4 classes and does not record their names"),
])
def test_eval_refuses_class_folders_it_cannot_match_in_one_line(tmp_path, capsys, classes, names, message):
    data = folder_of(tmp_path / "val", classes)
    weights = named_weights(tmp_path / "w", names)
    before = sorted(p for p in tmp_path.rglob("*"))
    code = load_script("eval.py").main(["--checkpoint", str(weights), "--data-dir", str(data), "--workers", "0",
                                        "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("args, message", [
    (["--attack-eps", "0.1", "--attack-restarts", "0"], "--attack-restarts must be at least 1"),
    (["--attack-eps", "0.1", "--attack-restarts", "-1"], "--attack-restarts must be at least 1"),
    (["--attack-eps", "0.1", "--attack-steps", "0"], "--attack-steps must be at least 1"),
    (["--crop-pct", "0"], "--crop-pct must be in (0, 2]"),
    (["--crop-pct", "7"], "--crop-pct must be in (0, 2]"),
    (["--img-size", "-32"], "--img-size must be a positive number of pixels"),
    (["--img-size", "0"], "--img-size must be a positive number of pixels"),
    (["--img-size", "48"], "stage 3 cannot halve an odd resolution (3, 3); use an img_size divisible by 32"),
    (["--img-size", "34"], "must be divisible by patch_size"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),  # torch's loader would raise a traceback
    (["--workers", "-1"], "--workers must be 0"),
    (["--model-args", "[32]"], "--model-args must be a JSON object of model arguments"),
    (["--predictions", f"{__file__}/p.csv"],  # found before the pass
     f"argument --predictions: {__file__}/p.csv: {__file__} is a file, not a folder"),
])
def test_eval_settings_that_cannot_work_are_refused_in_one_line(tmp_path, capsys, args, message):
    # an attack of 0 steps or restarts would report clean accuracy as "PGD-attacked", a --crop-pct outside (0, 2]
    # would be taken or replaced, and a size the model cannot take would end in a traceback: each is one line.
    data = folder_of(tmp_path / "val", ["a", "b", "c", "d"], per_class=1)
    weights = named_weights(tmp_path / "w")
    before = sorted(p for p in tmp_path.rglob("*"))
    code = load_script("eval.py").main(["--checkpoint", str(weights), "--data-dir", str(data), "--workers", "0",
                                        "--output", str(tmp_path / "r.json"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_eval_at_another_size_than_trained_says_so(tmp_path, capsys, caplog):
    # a model built at a larger --img-size than its weights were made at scores far below its own accuracy: the
    # result says at which size the weights were made, and a warning names it
    data = folder_of(tmp_path / "val", ["a", "b", "c", "d"], per_class=1)
    weights = named_weights(tmp_path / "w")
    code = load_script("eval.py").main(["--checkpoint", str(weights), "--data-dir", str(data), "--workers", "0",
                                        "--img-size", "64", "--output", str(tmp_path / "r.json")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "evaluating at 64 px a model whose weights were made at 32 px" in caplog.text
    saved = json.loads((tmp_path / "r.json").read_text())
    assert (saved["input_size"], saved["trained_input_size"]) == ([3, 64, 64], [3, 32, 32])
    assert f"on {data} (image folder, 4 classes): top-1" in out.out  # not "(imagenet)"


def test_eval_pretrained_offline_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    # without network, eval.py --pretrained ended in a URLError traceback
    import urllib.error

    def offline(*args, **kwargs):  # what urllib raises without network (never downloads, online or not)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torch.hub, "urlopen", offline)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    data = folder_of(tmp_path / "val", ["a"], per_class=1)
    code = load_script("eval.py").main(["--model", "lipsformer_swin_t", "--pretrained", "--data-dir", str(data),
                                        "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "could not download its published weights" in err, err
    assert "Temporary failure in name resolution" in err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_evaluation_and_validation_show_progress_on_a_terminal_only(tmp_path, monkeypatch):
    # eval.py and train.py's validation show a tqdm bar on a terminal, and are quiet when stderr is not one
    # (logs, CI)
    from accelerate import Accelerator
    from lipsformer.engine.evaluate import evaluate as validate
    for c in range(4):
        write_image(tmp_path / str(c) / "a.png", c)
    samples = eval_samples("imagenet_v2", tmp_path)
    loader = torch.utils.data.DataLoader([(ToTensor()(Image.open(p).convert("RGB")), labels[0]) for p, labels in
                                          samples], batch_size=2)
    for stderr in (_Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stderr)
        evaluate_dataset(ColourModel(), EvalDataset(samples, ToTensor()), Accelerator(cpu=True), batch_size=2,
                         workers=0)
        validate(ColourModel(), loader, Accelerator(cpu=True))
        shown = stderr.getvalue()
        if stderr.isatty():
            assert "evaluation:" in shown and "validation:" in shown and "/2 [" in shown, shown
        else:
            assert shown == ""
