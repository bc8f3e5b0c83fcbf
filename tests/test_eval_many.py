"""eval.py with many evaluations in one call (timm validate.py's bulk mode): several checkpoints, a folder of runs and
several published models scored into one table sorted by top-1, written as JSON or CSV; the data read once for the
models that preprocess alike; every entry checked before the first evaluation; one evaluation's output as it is.

Each model here predicts one class whatever the image (a zero classifier weight, a bias for that class), and the
val folder holds 4, 3, 2 and 1 images of its classes: a model of class ant scores 40% top-1, bee 30%, cat 20%, dog
10%, exactly."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from conftest import ROOT, TINY, load_script
from helpers import call, refused
from lipsformer.data import imagenet_eval
from lipsformer.data.classes import write_class_names
from lipsformer.sources import export

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

EVAL = load_script("eval.py")
CLASSES = ["ant", "bee", "cat", "dog"]
COUNTS = dict(ant=4, bee=3, cat=2, dog=1)
TOP1 = {c: 100.0 * n / sum(COUNTS.values()) for c, n in COUNTS.items()}  # ant 40, bee 30, cat 20, dog 10
SIZE = 32
SWIN = dict(TINY["swin"], img_size=SIZE)


def predicting(cls: str) -> torch.nn.Module:
    """A tiny model that ranks ``cls`` first for every image."""
    model = timm.create_model("lipsformer_swin_t", num_classes=len(CLASSES), **SWIN)
    with torch.no_grad():
        model.head.fc.weight.zero_()
        model.head.fc.bias.copy_(torch.eye(len(CLASSES))[CLASSES.index(cls)] * 10)
    return model


def exported(path: Path, cls: str, **cfg) -> Path:
    """An export (model.safetensors + config.json) of :func:`predicting`, naming its classes; ``cfg`` changes its
    pretrained config (crop_pct: another preprocessing)."""
    model = predicting(cls)
    model.pretrained_cfg = dict(model.pretrained_cfg, num_classes=len(CLASSES), label_names=tuple(CLASSES), **cfg)
    return export(model, path)


def a_run(path: Path, cls, ema: bool = False) -> Path:
    """A train.py run folder: its config.yaml and classes.json, and ``last.safetensors`` of :func:`predicting`
    (``cls`` None: a run still training, its weights not written yet, with a periodic checkpoint)."""
    path.mkdir(parents=True)
    kwargs = {k: v for k, v in SWIN.items() if k != "img_size"}
    (path / "config.yaml").write_text(yaml.safe_dump(dict(
        model="lipsformer_swin_t", num_classes=len(CLASSES), img_size=SIZE, crop_pct=0.9, interpolation="bicubic",
        model_kwargs=kwargs, ema_decay=0.9 if ema else None)))
    write_class_names(path / "classes.json", CLASSES)
    if cls is None:
        (path / "checkpoints" / "step_000000002").mkdir(parents=True)
    else:
        save_file(predicting(cls).state_dict(), str(path / "last.safetensors"))
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """The val folder and exports predicting each class (one at crop 1.0: another preprocessing)."""
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(0)
    for cls, n in COUNTS.items():
        (root / "val" / cls).mkdir(parents=True)
        for i in range(n):
            Image.fromarray((rng.random((20, 20, 3)) * 255).astype(np.uint8)).save(root / "val" / cls / f"{i}.png")
    for cls in CLASSES:
        exported(root / f"to_{cls}", cls)
    exported(root / "to_cat_again", "cat")
    exported(root / "to_bee_crop1", "bee", crop_pct=1.0)
    exported(root / "to_cat_crop1", "cat", crop_pct=1.0)
    return root


class Reads:
    """Counts the images the evaluation decodes (the scanner's read_image, as EvalDataset calls it)."""

    def __init__(self, monkeypatch):
        self.paths = []
        real = imagenet_eval.read_image
        monkeypatch.setattr(imagenet_eval, "read_image", lambda path: self.paths.append(path) or real(path))


def run(capsys, *argv):
    return call(capsys, EVAL.main, [*argv, "--workers", 0, "--batch-size", 4])


# -- several checkpoints: one table, sorted, read once --------------------------------------------------------------
ROW = ["model", "source", "params", "input_size", "crop_pct", "interpolation", "top1", "top5", "count", "images",
       "img_per_s", "use_ema", "trained_input_size", "adapted", "excluded", "unreadable", "seconds"]  # the columns


def test_several_checkpoints_one_table_sorted_by_top1_read_once(zoo, capsys, monkeypatch, tmp_path):
    reads = Reads(monkeypatch)
    given = ["to_dog", "to_cat", "to_ant", "to_cat_again"]
    code, out, err = run(capsys, "--checkpoint", *(zoo / g for g in given), "--data-dir", zoo / "val",
                         "--output", tmp_path / "table.json")
    assert code == 0, err
    saved = json.loads((tmp_path / "table.json").read_text())
    rows = saved["results"]
    # by top-1, descending; the two cat models tie and keep the order given
    assert [Path(r["source"]).name for r in rows] == ["to_ant", "to_cat", "to_cat_again", "to_dog"]
    assert [r["top1"] for r in rows] == [TOP1["ant"], TOP1["cat"], TOP1["cat"], TOP1["dog"]]
    params = sum(p.numel() for p in predicting("ant").parameters())
    assert all(list(r) == ROW for r in rows)
    assert {(r["model"], r["params"], r["input_size"], r["crop_pct"], r["interpolation"], r["top5"], r["count"],
             r["images"]) for r in rows} == {("lipsformer_swin_t", params, "3x32x32", 0.9, "bicubic", 100.0, 10, 10)}
    assert all(r["img_per_s"] > 0 for r in rows) and saved["skipped"] == []
    assert (saved["data"], saved["processes"], len(saved["passes"])) == ("image folder, 4 classes", 1, 1)
    # the four models shared one decoded pass: each image read once
    assert sorted(map(str, reads.paths)) == sorted(str(p) for p in (zoo / "val").rglob("*.png"))
    lines = out.splitlines()
    assert lines[0] == f"4 evaluations on {zoo / 'val'} (image folder, 4 classes), sorted by top-1; 1 process(es)"
    assert lines[1].split() == ["top-1", "top-5", "model", "params", "input", "crop", "interpolation", "images",
                                "img/s", "source"]
    assert [line.split()[0] for line in lines[2:6]] == ["40.000", "20.000", "20.000", "10.000"]
    assert lines[2].endswith(str(zoo / "to_ant")) and lines[-1] == f"wrote: {tmp_path / 'table.json'}"


def test_each_preprocessing_reads_the_data_once_and_csv_writes_the_table(zoo, capsys, monkeypatch, tmp_path):
    reads = Reads(monkeypatch)
    given = ["to_ant", "to_cat_crop1", "to_bee_crop1", "to_cat"]  # crop 0.9, 1.0, 1.0, 0.9
    code, _, err = run(capsys, "--checkpoint", *(zoo / g for g in given), "--data-dir", zoo / "val",
                       "--output", tmp_path / "t.csv")
    assert code == 0, err
    assert len(reads.paths) == 2 * 10  # crop 0.9 and crop 1.0: two passes, each image once in each
    with open(tmp_path / "t.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ROW  # the JSON table's columns
    # the two cat models tie: the one given first comes first, whichever pass scored it
    assert [(Path(r["source"]).name, r["crop_pct"], float(r["top1"]), r["input_size"], r["use_ema"], r["adapted"])
            for r in table] == [("to_ant", "0.9", TOP1["ant"], "3x32x32", "False", ""),
                                ("to_bee_crop1", "1.0", TOP1["bee"], "3x32x32", "False", ""),
                                ("to_cat_crop1", "1.0", TOP1["cat"], "3x32x32", "False", ""),
                                ("to_cat", "0.9", TOP1["cat"], "3x32x32", "False", "")]


# -- a folder of runs -----------------------------------------------------------------------------------------------
def test_a_folder_of_runs_evaluates_each_run_and_skips_one_still_training(zoo, capsys, tmp_path, caplog):
    runs = tmp_path / "sweep"
    a_run(runs / "lr_2", "cat")
    a_run(runs / "lr_10", "ant")  # natural order: lr_2 before lr_10
    a_run(runs / "lr_30", None)  # still training
    exported(runs / "exported", "dog")  # an export among them is evaluated too
    (runs / "notes").mkdir()  # neither a run nor an export: left
    (runs / "README.md").write_text("a sweep")
    code, out, err = run(capsys, "--checkpoint", runs, "--data-dir", zoo / "val", "--output", tmp_path / "r.json")
    assert code == 0, err
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [(Path(r["source"]).name, r["top1"]) for r in saved["results"]] == [
        ("lr_10", TOP1["ant"]), ("lr_2", TOP1["cat"]), ("exported", TOP1["dog"])]
    reason = ("no last.safetensors yet (still training, or stopped before its end); its newest checkpoint evaluates "
              f"as --checkpoint {runs / 'lr_30' / 'checkpoints' / 'step_000000002'}")
    assert saved["skipped"] == [dict(source=str(runs / "lr_30"), reason=reason)]
    assert f"skipped {runs / 'lr_30'}: {reason}" in caplog.text
    assert out.startswith(f"3 evaluations on {zoo / 'val'} (image folder, 4 classes), sorted by top-1, 1 run(s) "
                          f"without weights yet skipped;")
    # a run given by itself is one evaluation, and one without weights is refused
    code, _, err = run(capsys, "--checkpoint", runs / "lr_30", "--data-dir", zoo / "val")
    assert code == 2 and "is a training run without last.safetensors" in err
    # nothing finished: nothing to evaluate
    only = tmp_path / "fresh"
    a_run(only / "a", None)
    refused(capsys, EVAL.main, ["--checkpoint", only, "--data-dir", zoo / "val", "--workers", 0], tmp_path,
            f"no run in {only} has its weights yet: {only / 'a'}: no last.safetensors yet")


def test_a_source_named_more_than_once_is_evaluated_once_and_said(tmp_path):
    """A run given twice (once by another spelling) and again inside the folder of runs given: one row, and a line
    saying so, rather than a silent merge."""
    from lipsformer.engine.evaluate_many import plan
    runs = tmp_path / "sweep"
    a_run(runs / "a", "cat")
    a_run(runs / "b", "ant")
    (runs / "x").mkdir()
    got = plan([str(runs / "a"), str(runs), str(runs / "x" / ".." / "a")], None)
    assert [Path(e.checkpoint).name for e in got.entries] == ["a", "b"]
    assert got.merged == [f"{runs / 'a'} is named 3 times (as {runs / 'a'}, {runs / 'x' / '..' / 'a'}): evaluated "
                          f"once, one row"]


# -- several published models --------------------------------------------------------------------------------------
def evalmany_swin(pretrained: bool = False, **kwargs):
    """A tiny LipsFormer-Swin whose published weights are local files (registered by the fixture below)."""
    from lipsformer.models.lipsformer_swin import _create_lipsformer_swin
    return _create_lipsformer_swin("evalmany_swin", pretrained, **dict(SWIN, **kwargs))


@pytest.fixture(scope="module")
def published(zoo):
    """``evalmany_swin.to_dog`` and ``evalmany_swin.to_bee``: published weights in timm's registry, as local files
    (nothing reaches the network)."""
    from timm.models import generate_default_cfgs, register_model
    from lipsformer.models._base import pretrained_cfg
    global default_cfgs  # register_model reads the entrypoint's module's default_cfgs
    default_cfgs = generate_default_cfgs({
        f"evalmany_swin.to_{cls}": pretrained_cfg(file=str(zoo / f"to_{cls}" / "model.safetensors"),
                                                  num_classes=len(CLASSES), input_size=(3, SIZE, SIZE),
                                                  label_names=tuple(CLASSES)) for cls in ("dog", "bee")})
    register_model(evalmany_swin)
    return ["evalmany_swin.to_dog", "evalmany_swin.to_bee"]


def test_several_published_models_by_name_or_pattern(zoo, published, capsys, tmp_path):
    from lipsformer.engine.evaluate_many import Entry, plan
    code, out, err = run(capsys, "--model", *published, "--pretrained", "--data-dir", zoo / "val",
                         "--output", tmp_path / "p.json")
    assert code == 0, err
    rows = json.loads((tmp_path / "p.json").read_text())["results"]
    assert [(r["model"], r["source"], r["top1"]) for r in rows] == [
        ("evalmany_swin", "pretrained:to_bee", TOP1["bee"]), ("evalmany_swin", "pretrained:to_dog", TOP1["dog"])]
    # a pattern names each model with published weights it matches, as timm.list_models(pattern, pretrained=True)
    assert plan(None, ["evalmany_*"]).entries == [Entry(name) for name in sorted(published)]


# -- mistakes: every entry checked before the first evaluation ------------------------------------------------------
@pytest.mark.parametrize("case", ["damaged", "unknown model", "another model", "classes", "ema", "options"])
def test_a_bad_entry_is_refused_before_any_evaluation_naming_it(zoo, capsys, monkeypatch, tmp_path, case):
    reads = Reads(monkeypatch)
    good = [zoo / "to_ant", zoo / "to_bee"]
    base = ["--data-dir", zoo / "val", "--workers", 0, "--output", tmp_path / "t.json"]
    if case == "damaged":
        bad = tmp_path / "cut" / "model.safetensors"
        exported(bad.parent, "cat")
        bad.write_bytes(bad.read_bytes()[:500])
        argv, said = ["--checkpoint", *good, bad.parent], [f"cannot read {bad}"]
    elif case == "unknown model":
        argv, said = ["--model", "lipsformer_swin_t", "lipsformer_swin_x", "--pretrained"], [
            "unknown model 'lipsformer_swin_x'"]
    elif case == "another model":
        save_file(timm.create_model("lipsformer_cswin_t", num_classes=4, **TINY["cswin"]).state_dict(),
                  str(tmp_path / "cswin.safetensors"))
        argv, said = ["--model", "lipsformer_swin_t", "--checkpoint", tmp_path / "cswin.safetensors", *good], [
            str(tmp_path / "cswin.safetensors"), "does not fit lipsformer_swin_t"]
    elif case == "classes":
        model = predicting("ant")
        model.pretrained_cfg = dict(model.pretrained_cfg, num_classes=4, label_names=("ant", "bee", "cat", "emu"))
        export(model, tmp_path / "emu")
        argv, said = ["--checkpoint", *good, tmp_path / "emu"], [
            f"{tmp_path / 'emu'}: ", "has class folders that are not among the model's 4 classes: dog"]
    elif case == "ema":  # a run of the folder trained without an EMA
        a_run(tmp_path / "runs" / "a", "ant")
        argv, said = ["--checkpoint", tmp_path / "runs", "--use-ema"], ["was trained without an EMA"]
    else:
        code, _, err = call(capsys, EVAL.main, ["--checkpoint", *good, *base, "--predictions", tmp_path / "p.csv"])
        assert code == 2 and "--predictions writes the images of one evaluation, and several are given" in err
        code, _, err = call(capsys, EVAL.main, ["--checkpoint", *good, "--model", "a", "b", *base])
        assert code == 2 and "--model takes one name with --checkpoint" in err
        argv, said = ["--checkpoint", *good], []
        base[-1] = tmp_path / "t.txt"
        said = ["--output", "t.txt: name a .json or .csv file"]
    refused(capsys, EVAL.main, [*argv, *base], tmp_path, *said)
    assert reads.paths == []  # no evaluation started


# -- robustness: columns of the table ------------------------------------------------------------------------------
def test_certified_and_attacked_accuracy_are_columns_of_each_row(zoo, capsys, tmp_path):
    model = timm.create_model("lipsformer_swin_t_cert", **dict(SWIN, window_size=4), num_classes=len(CLASSES))
    model.pretrained_cfg = dict(model.pretrained_cfg, num_classes=len(CLASSES), label_names=tuple(CLASSES))
    export(model, tmp_path / "cert")
    code, out, err = run(capsys, "--checkpoint", tmp_path / "cert", zoo / "to_ant", "--data-dir", zoo / "val",
                         "--certify-eps", 0.01, "--attack-eps", 0.01, "--attack-steps", 1, "--attack-restarts", 1,
                         "--output", tmp_path / "r.json")
    assert code == 0, err
    scsa, cert = sorted(json.loads((tmp_path / "r.json").read_text())["results"], key=lambda r: r["model"])
    assert list(cert)[len(ROW):] == ["lipschitz", "certified_0.01", "attacked_0.01", "certified_reason"]
    assert 0 < cert["lipschitz"] < 1.01 and cert["certified_reason"] == ""  # 1-Lipschitz, up to the solver's charge
    assert cert["certified_0.01"] <= cert["attacked_0.01"] <= cert["top1"]
    # the released defaults have no finite bound: nothing certifies, and the row says why (strict JSON: null)
    assert (scsa["lipschitz"], scsa["lipschitz_reason"], scsa["certified_0.01"]) == (None, "infinite", 0.0)
    assert "SCSA with unnormalised v" in scsa["certified_reason"]
    assert out.splitlines()[1].split()[-4:] == ["img/s", "cert@0.01", "pgd@0.01", "source"]


# -- one evaluation: its output as it is, and a one-row table -------------------------------------------------------
def test_one_evaluation_keeps_its_json_and_writes_a_one_row_table_as_csv(zoo, capsys, tmp_path):
    argv = ["--checkpoint", zoo / "to_bee", "--data-dir", zoo / "val", "--predictions", tmp_path / "p.csv"]
    code, out, err = run(capsys, *argv, "--output", tmp_path / "r.json")
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert sorted(result) == sorted([
        "top1", "top5", "count", "images", "excluded", "unreadable", "unreadable_files", "seconds", "img_per_s",
        "model", "dataset", "checkpoint", "source", "params", "use_ema", "amp", "processes", "input_size",
        "trained_input_size", "adapted", "data", "crop_pct", "interpolation", "compile", "channels_last", "data_dir"])
    assert (result["top1"], result["checkpoint"], result["source"], result["input_size"]) == (
        TOP1["bee"], str(zoo / "to_bee"), str(zoo / "to_bee"), [3, 32, 32])
    assert out.startswith(f"lipsformer_swin_t on {zoo / 'val'} (image folder, 4 classes): top-1 30.000%")
    code, _, err = run(capsys, *argv, "--output", tmp_path / "r.csv")
    assert code == 0, err
    with open(tmp_path / "r.csv", newline="") as f:
        (line,) = csv.DictReader(f)
    assert (line["source"], float(line["top1"]), line["input_size"], int(line["params"])) == (
        str(zoo / "to_bee"), TOP1["bee"], "3x32x32", result["params"])


# -- several processes ----------------------------------------------------------------------------------------------
def test_two_processes_write_the_table_of_one(zoo, capsys, tmp_path):
    argv = ["--checkpoint", zoo / "to_cat", zoo / "to_bee_crop1", "--data-dir", zoo / "val", "--batch-size", 3,
            "--workers", 0]
    code, _, err = call(capsys, EVAL.main, [*argv, "--output", tmp_path / "one.json"])
    assert code == 0, err
    proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "eval.py"), *map(str, argv), "--output", str(tmp_path / "two.json")],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("evaluations on") == 1  # printed by the main process only
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)

    def table(saved):
        return [{k: v for k, v in r.items() if k not in ("img_per_s", "seconds")} for r in saved["results"]]
    assert table(one) == table(two) and [(r["top1"], r["count"]) for r in table(one)] == [
        (TOP1["bee"], 10), (TOP1["cat"], 10)]
