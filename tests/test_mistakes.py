"""The catalogue of mistakes, generated rather than listed: every TrainConfig key with wrong types and
out-of-range values (keys, types and ranges read from the dataclass and its tables), every kind of broken data tree,
checkpoints that are random bytes, truncated at random offsets or another model's, and every flag of train.py and
eval.py with wrong values. Each case runs the command's ``main(argv)`` in this process and asserts its exit code, one
line on stderr, no traceback, and that nothing was written; a bad image inside a run is skipped and counted and the
run finishes. The generator is seeded (``SEED``): the same cases every run.
"""
import argparse
import dataclasses
import math
import os
import random
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import ROOT, TINY, config_model
from helpers import EVAL, RUN, SEED, TRAIN, call, interrupted, refused, snapshot
from lipsformer.config import _HINTS, CHOICES, RANGES, TrainConfig

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

# -- 1. every TrainConfig key ------------------------------------------------------------------------------------
def _base_type(hint):
    """``(container, element type)`` of a field: container is None, list or tuple; Optional is stripped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return _base_type(args[0])
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return origin, typing.get_args(hint)[0]
    return None, (dict if origin is dict else hint)


WRONG_TYPE = {  # YAML text of a value of another type, for a field of each type
    int: ["abc", "1.5", "[1]", "{a: 1}", "true"],
    float: ["abc", "[1.0]", "{a: 1}", "true"],
    str: ["3", "[a]", "{a: 1}", "true"],
    bool: ["maybe", "2", "[true]"],
    dict: ["3", "[1]", "abc", "true"],
    list: ["abc", "[1.5]", "[abc]", "{a: 1}", "1.5"],
    tuple: ["0.5", "[0.5]", "[a, b]", "[0.5, 0.5, 0.5]", "{a: 1}"],
}

# String keys without a fixed set of choices: a value each refuses, and what the line says. The test below fails
# when a new string key has no row here.
BAD_STRINGS = {
    "model": ("lipsformer_swin_x", ["unknown model 'lipsformer_swin_x'", "did you mean lipsformer_swin_t"]),
    "opt": ("adamx", ["opt 'adamx' is not a timm optimizer", "did you mean adamax"]),
    "aa": ("nonsense", ["aa 'nonsense' is not a timm augmentation policy"]),
    "dataset": ("imagenet", ["dataset 'imagenet' is not a timm dataset name"]),
    "data_dir": ("{root}/nope", ["data_dir", "nope: no such folder"]),
    "train_split": ("nosplit", ["has no nosplit/ folder"]),
    "val_split": ("nosplit", ["has no nosplit/ folder"]),
    "output_dir": ("{root}/a_file/run", ["output_dir", "a_file is a file, not a folder"]),
    "pretrained": ("lipsformer_swin_t.nosuchtag", ["pretrained 'lipsformer_swin_t.nosuchtag': no published weights"]),
    "init_checkpoint": ("{root}/nope.pth", ["init_checkpoint: no checkpoint", "nope.pth"]),
    "freeze": ("nosuchmodule", ["freeze"]),
    "tracker_project": ('""', ["tracker_project must not be empty"]),
    "tracker_run_name": ('""', ["tracker_run_name must not be empty"]),
}
MODEL_KWARGS = [  # model arguments the constructor refuses
    ("model_kwargs.nosuch=1", ["unexpected keyword argument 'nosuch'"]),
    ("model_kwargs.depths=1,1", ["depths"]),
    ("model_kwargs.img_size=64", ["model_kwargs.img_size duplicates the top-level key img_size"]),
    ("model_kwargs.attn=nosuch", ["nosuch"]),
    ("model_kwargs.depths=[1,1", ["--set model_kwargs.depths=[1,1: not valid YAML at line 1, column 5"]),
]


def _outside(r, integer: bool) -> list:
    """Values just outside a Range, and the non-finite floats."""
    step = 1 if integer else 0.5
    values = [r.low - step if r.low_in else r.low]
    if math.isfinite(r.high):
        values.append(r.high + step if r.high_in else r.high)
    return [str(v) for v in values] + ([] if integer else [".nan", ".inf", "-.inf"])


def key_cases(key: str) -> list:
    """``(--set item, fragments of the line)`` for ``key``: values of every wrong type, values outside its range or
    choices, a string it refuses, and its name misspelled."""
    container, element = _base_type(_HINTS[key])
    pool = WRONG_TYPE[container or element]
    cases = [(f"{key}={v}", [key]) for v in pool]
    if key in RANGES:
        valid = {"betas": "0.5", "scale": "1.0"}.get(key)
        for v in _outside(RANGES[key], element is int):
            text = v if container is None else f"[{v}, {valid}]" if container is tuple else f"[{v}]"
            cases.append((f"{key}={text}", [key, RANGES[key].describe()]))
    if key in CHOICES:
        near = CHOICES[key][0][:-1]
        cases += [(f"{key}=bogus", [key, "must be one of"]), (f"{key}={near}", [f"did you mean {CHOICES[key][0]}"])]
    if key in BAD_STRINGS:
        value, fragments = BAD_STRINGS[key]
        cases.append((f"{key}={value}", fragments))
    if key == "model_kwargs":
        cases += MODEL_KWARGS
    typo = key + key[-1]  # lr -> lrr
    cases.append((f"{typo}=1", [f"unknown config key(s): {typo} (did you mean", key]))
    return cases


KEYS = [f.name for f in dataclasses.fields(TrainConfig)]


def test_every_key_is_generated():
    """A number without a range, or a string without choices or a refused value, would go untested."""
    numbers = {k for k in KEYS if _base_type(_HINTS[k])[1] in (int, float)}
    assert numbers == set(RANGES), numbers ^ set(RANGES)
    strings = {k for k in KEYS if _base_type(_HINTS[k])[1] is str}
    assert strings - set(CHOICES) == set(BAD_STRINGS), (strings - set(CHOICES)) ^ set(BAD_STRINGS)


@pytest.mark.parametrize("key", KEYS)
def test_config_key_mistakes_are_one_line_exit_2_and_write_nothing(base, capsys, key):
    for item, fragments in key_cases(key):
        item = item.replace("{root}", str(base))
        argv = ["--config", base / "cfg.yaml", "--output-dir", base / "out", "--set", item]
        if item.startswith("output_dir="):
            argv = argv[:2] + argv[4:]
        refused(capsys, TRAIN.main, argv, base, *fragments)


# -- 2. broken data trees ----------------------------------------------------------------------------------------
def _image(path: Path, source: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, path)


def _tree(base: Path, name: str) -> Path:
    """A copy of the tiny data folder to break."""
    dest = base / "trees" / name
    shutil.copytree(base / "data", dest)
    return dest


def _empty_class(d, img):
    (d / "train" / "fish").mkdir()
    _image(d / "val" / "fish" / "0.jpg", img)
    return "train/fish holds no images"


def _loose_in_train(d, img):
    _image(d / "train" / "stray.jpg", img)
    return "train holds images directly (stray.jpg)"


def _loose_in_val(d, img):
    _image(d / "val" / "stray.jpg", img)
    return "val holds images directly (stray.jpg)"


def _no_images(d, img):
    shutil.rmtree(d / "train")
    (d / "train" / "a").mkdir(parents=True)
    (d / "train" / "a" / "notes.txt").write_text("no image here")
    return ("train holds no images (.png, .jpg, .jpeg, .bmp, .webp, .tif, .tiff, .gif or another format Pillow reads) "
            "in class folders; found a/notes.txt")


def _folder_named_like_an_image(d, img):
    (d / "train" / "zz.jpg").mkdir()
    return "train/zz.jpg holds no images"


def _image_folder_inside_a_class(d, img):
    _image(d / "train" / "class_0" / "zz.jpg" / "0.jpg", img)
    return "train/class_0/zz.jpg is a folder inside a class folder"


TREES = [_empty_class, _loose_in_train, _loose_in_val, _no_images, _folder_named_like_an_image,
         _image_folder_inside_a_class]


@pytest.mark.parametrize("defect", TREES, ids=lambda f: f.__name__.strip("_"))
def test_a_broken_data_tree_is_one_line_naming_the_folder(base, capsys, defect):
    data = _tree(base, defect.__name__)
    said = defect(data, base / "data" / "train" / "class_0" / "0.jpg")
    refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--data-dir", data, "--output-dir", base / "out"],
            base, said)


def unreadable(path: Path) -> str:
    """A file that cannot be read: no read permission, or, where permissions do not stop this process (root), a
    symbolic link to itself (open() fails with ELOOP). Returns which."""
    path.write_bytes(b"x")
    path.chmod(0)
    try:
        path.read_bytes()
    except PermissionError:
        return "no read permission"
    path.unlink()
    path.symlink_to(path.name)
    return "a symlink loop"


def bad_images(folder: Path, source: Path) -> list:
    """Every kind of image that cannot be read, in ``folder``: unreadable, a dangling symlink, truncated, empty."""
    folder.mkdir(parents=True, exist_ok=True)
    unreadable(folder / "unreadable.jpg")
    (folder / "dangling.jpg").symlink_to(folder / "gone.jpg")
    (folder / "truncated.jpg").write_bytes(source.read_bytes()[:100])
    (folder / "empty.jpg").write_bytes(b"")
    return sorted(str(folder / n) for n in ("unreadable.jpg", "dangling.jpg", "truncated.jpg", "empty.jpg"))


def test_unreadable_images_inside_a_run_are_skipped_and_counted_and_the_run_finishes(base, capsys, caplog):
    """An image open() cannot read (here without permission, or a link that goes nowhere) is opened inside the
    dataset's try: skipped and counted like an undecodable one, and training goes on to its end."""
    data = _tree(base, "bad_images")
    source = base / "data" / "train" / "class_0" / "0.jpg"
    bad = bad_images(data / "train" / "class_1", source) + bad_images(data / "val" / "class_2", source)
    run = base / "bad_images_run"
    code, out, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--data-dir", data, "--output-dir", run,
                                               "--set", "max_bad_fraction=0.5"])
    assert code == 0 and "Traceback" not in err and "done: 1 epochs" in out, err
    epoch = [r for r in map(yaml.safe_load, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    assert epoch[0]["bad_samples"] == 4 and epoch[0]["val_bad_samples"] == 4, epoch
    assert all(f"skipped unreadable image {path}" in caplog.text for path in bad), caplog.text
    # eval.py skips and counts them too
    code, out, err = call(capsys, EVAL.main, ["--checkpoint", run, "--data-dir", data, "--workers", 0,
                                              "--max-bad-fraction", 1])
    assert code == 0 and "4 unreadable skipped" in out, err


@pytest.mark.parametrize("defect", [_loose_in_val, _no_images, _image_folder_inside_a_class],
                         ids=lambda f: f.__name__.strip("_"))
def test_eval_refuses_a_broken_folder_in_one_line(base, capsys, defect):
    data = _tree(base, "eval" + defect.__name__)
    said = defect(data, base / "data" / "train" / "class_0" / "0.jpg").replace("train", "val")
    if defect is _no_images:
        shutil.rmtree(data / "val")
        shutil.move(data / "train", data / "val")
    elif defect is _image_folder_inside_a_class:
        shutil.move(data / "train" / "class_0" / "zz.jpg", data / "val" / "class_0" / "zz.jpg")
    refused(capsys, EVAL.main, ["--checkpoint", base / "run", "--data-dir", data, "--workers", 0,
                                "--output", base / "out.json"], base, said)


# -- 3. checkpoints ----------------------------------------------------------------------------------------------
def checkpoint_cases(base: Path) -> list:
    """``(file, --model-args, fragments)``: random bytes, files truncated at random offsets, another model's."""
    rng = random.Random(SEED)
    folder = base / "checkpoints"
    folder.mkdir(exist_ok=True)
    cases = []
    for i, n in enumerate((0, 1, 8, 100, 1000, 20000)):
        for suffix in (".pth", ".safetensors"):
            path = folder / f"random_{i}{suffix}"
            path.write_bytes(rng.randbytes(n))
            cases.append((path, {}, ["cannot read", path.name]))
    weights = load_file(base / "run" / "last.safetensors")
    torch.save(weights, folder / "whole.pth")
    save_file(weights, folder / "whole.safetensors")
    for suffix in (".pth", ".safetensors"):
        data = (folder / f"whole{suffix}").read_bytes()
        for k in range(3):
            path = folder / f"truncated_{k}{suffix}"
            path.write_bytes(data[:rng.randrange(1, len(data))])
            cases.append((path, {}, ["cannot read", path.name, "truncated"]))
    cswin = folder / "cswin.safetensors"
    import timm
    save_file(timm.create_model("lipsformer_cswin_t", **TINY["cswin"], num_classes=4).state_dict(), cswin)
    cases.append((cswin, dict(RUN["model_kwargs"], img_size=32, num_classes=4), ["does not fit lipsformer_swin_t"]))
    wider = folder / "wider.safetensors"
    save_file(timm.create_model("lipsformer_swin_t", **dict(TINY["swin"], embed_dim=32), num_classes=4).state_dict(),
              wider)
    cases.append((wider, dict(RUN["model_kwargs"], img_size=32, num_classes=4), ["does not fit", "shape mismatches"]))
    return cases


def test_random_pickles_are_damaged_files_not_code(base, capsys):
    """Random bytes behind a pickle's opening: whatever the unpickler raises (IndexError, UnicodeDecodeError, ...),
    the line calls the file damaged, not a traceback, and does not claim it holds objects that could run code."""
    from lipsformer import convert
    rng = random.Random(SEED)
    folder = base / "pickles"
    folder.mkdir(exist_ok=True)
    for k in range(40):
        path = folder / f"pickle_{k}.pth"
        path.write_bytes(rng.choice([b"", b"\x80\x02", b"\x80\x04", b"PK\x03\x04"])
                         + rng.randbytes(rng.choice([1, 10, 100, 1000])))
        line = refused(capsys, convert.main, [path, "--model", "lipsformer_swin_t", "--out", base / "converted"], base,
                       f"cannot read {path}: truncated or not a checkpoint")
        assert "could run code" not in line


def test_unusable_checkpoints_are_one_line_exit_2_and_write_nothing(base, capsys):
    import json
    for path, model_args, fragments in checkpoint_cases(base):
        refused(capsys, EVAL.main, ["--model", "lipsformer_swin_t", "--checkpoint", path, "--data-dir", base / "data",
                                    "--model-args", json.dumps(model_args), "--workers", 0,
                                    "--output", base / "out.json"], base, *fragments)
    # a run folder whose weights were cut short, and a run of another model
    damaged = base / "damaged_run"
    shutil.copytree(base / "run", damaged)
    last = damaged / "last.safetensors"
    last.write_bytes(last.read_bytes()[:1000])
    refused(capsys, EVAL.main, ["--checkpoint", damaged, "--data-dir", base / "data", "--workers", 0],
            base, "cannot read", "last.safetensors")
    refused(capsys, EVAL.main, ["--model", "lipsformer_cswin_t", "--checkpoint", base / "run", "--data-dir",
                                base / "data", "--workers", 0], base, "was made by lipsformer_swin_t")
    # training: a damaged checkpoint to resume from, random bytes to start from
    from lipsformer.engine.checkpoint import write_manifest
    step = damaged / "checkpoints" / "step_000000004"
    (step / "custom_checkpoint_0.pkl").write_bytes(random.Random(SEED).randbytes(300))
    write_manifest(step)  # damaged bytes that the manifest vouches for: only the unpickler can tell
    refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", damaged, "--resume", step],
            base, "cannot read", "custom_checkpoint_0.pkl")
    refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", base / "out", "--set",
                                 f"init_checkpoint={base / 'checkpoints' / 'random_4.pth'}"],
            base, "init_checkpoint: cannot read", "random_4.pth")


# -- 4. every flag of train.py and eval.py -----------------------------------------------------------------------
# Flags whose values are paths or names: a value each refuses, and what the line says. Typed flags (int, float,
# choices, store_true, lists of numbers) are generated from the parser; the test fails for a flag in neither.
BAD_FLAG_VALUES = {
    "train.py": {
        "--config": [("{root}/nope.yaml", ["config file", "nope.yaml: no such file"]),
                     ("{root}/data", ["is a folder"]), ("{root}/data/train/class_0/0.jpg", ["not a text (UTF-8)"]),
                     ("{root}/bad.yaml", ["bad.yaml: not valid YAML at line 2, column 3"])],
        "--data-dir": [("{root}/nope", ["no such folder"]), ("{root}/a_file", ["a_file is a file, not a folder"])],
        "--output-dir": [("{root}/a_file", ["a_file is a file, not a folder"])],
        "--resume": [("{root}/nope", ["--resume", "no such folder"]),
                     ("{root}/a_file", ["a_file is a file, not a folder", "init_checkpoint="]),
                     ("{root}/data", ["--resume", "not a checkpoint folder"])],
        "--set": [("lrr=1", ["did you mean lr?"]), ("lr", ["must look like key=value"]),
                  ("lr=[1", ["--set lr=[1: not valid YAML"])],
    },
    "eval.py": {
        "--model": [("lipsformer_swin_x", ["unknown model", "did you mean"])],
        "--checkpoint": [("{root}/nope", ["no checkpoint"]), ("{root}/data", ["holds neither"])],
        "--data-dir": [("{root}/nope", ["no data folder"]), ("{root}/a_file", ["no data folder"])],
        "--real-labels": [("{root}/nope.json", ["cannot read the ReaL labels file"])],
        "--predictions": [("{root}/a_file/p.csv", ["--predictions", "a_file is a file, not a folder"]),
                          ("{root}/data", ["is a folder"]), ("{root}/p.json", ["--predictions", "name a .csv file"]),
                          ("{root}/run/metrics.jsonl", ["would overwrite training run", "own metrics.jsonl"])],
        "--output": [("{root}/a_file/r.json", ["--output", "a_file is a file, not a folder"]),
                     ("{root}/data", ["is a folder"]), ("{root}/r.yaml", ["--output", "name a .json or .csv file"]),
                     ("{root}/run/classes.json", ["would overwrite training run", "own classes.json"])],
        "--model-args": [("{bad", ["not JSON"]), ("[32]", ["must be a JSON object"]),
                         ('{"nosuch": 1}', ["unexpected keyword argument 'nosuch'"])],
    },
}
NUMBERS = {int: ["x", "1.5", "-1"], float: ["x", "nan", "-1"]}


def flag_cases(script: str, parser: argparse.ArgumentParser) -> list:
    """``(flag, value or None, fragments)`` for every option of ``parser``: wrong types and ranges for typed ones,
    another choice, a value given to a switch, and the path / name rows of :data:`BAD_FLAG_VALUES`."""
    cases = []
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default="")
        if not flag or isinstance(action, argparse._HelpAction):
            continue
        if flag in BAD_FLAG_VALUES[script]:
            cases += [(flag, v, f) for v, f in BAD_FLAG_VALUES[script][flag]]
        elif action.choices:
            cases.append((flag, "bogus", ["invalid choice: 'bogus'"]))
        elif isinstance(action, argparse._StoreTrueAction):
            cases.append((f"{flag}=yes", None, ["ignored explicit argument 'yes'"]))
        elif action.type in NUMBERS:
            cases += [(flag, v, [flag.lstrip("-").replace("-", "_") if script == "train.py" and v != "x"
                                 else flag]) for v in NUMBERS[action.type]]
        elif action.nargs == "+":  # radii
            cases += [(flag, v, [flag, "non-negative numbers"]) for v in ("-1", "x", "nan")]
        else:
            raise AssertionError(f"{script} {flag}: no wrong values are generated; add a row to BAD_FLAG_VALUES")
    return cases


def _with(argv: list, flag: str, value) -> list:
    """``argv`` with ``flag`` set to ``value`` (replacing its value there), or the switch ``flag`` added."""
    if value is None:
        return argv + [flag]
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag, value]


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_every_flag_with_a_wrong_value_is_one_line_exit_2_and_writes_nothing(base, capsys, script):
    module = TRAIN if script == "train.py" else EVAL
    if script == "train.py":
        valid = ["--config", base / "cfg.yaml", "--output-dir", base / "out"]
    else:
        valid = ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers", "0",
                 "--output", base / "out.json", "--predictions", base / "p.csv"]
    for flag, value, fragments in flag_cases(script, module.build_parser()):
        value = value if value is None else value.replace("{root}", str(base))
        argv = _with([str(a) for a in valid], flag, value)
        if flag == "--real-labels":
            argv += ["--dataset", "imagenet_real"]
        if flag == "--pretrained=yes":
            argv = argv[2:]  # instead of --checkpoint
        refused(capsys, module.main, argv, base, *fragments)
    if script == "eval.py":  # an unknown model is named as unknown, not as one without published weights
        refused(capsys, module.main, ["--model", "lipsformer_swin_x", "--pretrained", "--data-dir", base / "data"],
                base, "unknown model 'lipsformer_swin_x' (did you mean lipsformer_swin_t")


# -- 5. the other commands ----------------------------------------------------------------------------------------
def test_the_other_commands_refuse_mistakes_in_one_line(base, capsys):
    from lipsformer import convert, flops
    from lipsformer.data import digits
    from lipsformer.lipschitz.__main__ import main as lipschitz
    random_file = base / "checkpoints" / "random_5.pth"
    if not random_file.exists():
        random_file.parent.mkdir(exist_ok=True)
        random_file.write_bytes(random.Random(SEED).randbytes(20000))
    cases = [
        (lipschitz, ["--model", "lipsformer_swin_x"], ["unknown model", "did you mean"]),
        (lipschitz, ["--model", "lipsformer_swin_t", "--model-args", '{"depthz": 3}'], ["'depthz'"]),
        (lipschitz, ["--model", "lipsformer_swin_t", "--checkpoint", random_file], ["cannot read", "random_5.pth"]),
        (lipschitz, ["--checkpoint", base / "run", "--measure", "stages.9"], ["has no module 'stages.9'"]),
        (lipschitz, ["--model", "lipsformer_swin_t", "--json", base / "a_file" / "x.json"], ["a_file is a file"]),
        (lipschitz, [], ["pass --model or --checkpoint"]),
        (convert.main, [random_file, "--model", "lipsformer_swin_t", "--out", base / "conv"], ["cannot read"]),
        (convert.main, [base / "run", "--tag", "../x"], ["--tag"]),
        (convert.main, [base / "run", "--out", base / "data"], ["already exists"]),
        (flops.main, ["--models", "lipsformer_swin_x", "--no-flops"], ["unknown model"]),
        (flops.main, ["--models", "lipsformer_swin_t", "--json", base / "a_file" / "f.json"], ["a_file is a file"]),
        (digits.main, [base / "a_file" / "digits"], ["a_file is a file"]),
        (digits.main, [base / "digits", "--size", "0"], ["--size", "must be at least 1"]),
    ]
    for main, argv, fragments in cases:
        refused(capsys, main, argv, base, *fragments)


def test_a_solver_that_cannot_reach_its_tolerance_is_one_line(base, capsys):
    """eval.py --certify-eps with an attlip_tol below what float32 can carry: the solver's refusal, not its
    traceback."""
    import timm
    from lipsformer.sources import export
    cert = base / "cert"
    if not cert.exists():
        export(timm.create_model("lipsformer_swin_t_cert", **dict(TINY["swin"], window_size=4), num_classes=4), cert)
    refused(capsys, EVAL.main, ["--checkpoint", cert, "--data-dir", base / "data", "--workers", 0, "--certify-eps",
                                0.1, "--model-args", '{"attlip_tol": 1e-12, "attlip_steps": [2, 3]}', "--output",
                                base / "out.json"],
            base, "AttLip's proximal solve", "raise attlip_tol")


# -- the boundary itself ------------------------------------------------------------------------------------------
def test_a_list_on_the_command_line_is_a_list():
    """--set model_kwargs.depths=1,1,1,1 reached the model as the string's characters."""
    from lipsformer.config import load_config
    cfg = load_config(None, ["model_kwargs.depths=1,1,2,1", "betas=0.9,0.99", "freeze=patch_embed,stages.0",
                             "pretrained=lipsformer_swin_t.official_in1k", "model=lipsformer_swin_t"])
    assert cfg.model_kwargs == {"depths": [1, 1, 2, 1]} and cfg.betas == (0.9, 0.99)
    assert cfg.freeze == "patch_embed,stages.0"  # a string key keeps its commas


def test_ctrl_c_mid_run_is_one_line_exit_130_and_keeps_what_was_written(base, capsys, monkeypatch):
    from lipsformer.engine.checkpoint import intact_checkpoint, latest_checkpoint
    from lipsformer.config import load_config
    out = base / "interrupted"
    code, _, err = interrupted(capsys, monkeypatch, ["--config", base / "cfg.yaml", "--output-dir", out], 3)
    lines = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert code == 130 and "Traceback" not in err and lines == [
        f"interrupted: training stopped at step 2 (Ctrl-C); newest checkpoint: {out}/checkpoints/step_000000002; "
        f"continue with --resume auto"], err
    model = config_model(load_config(out / "config.yaml"))
    assert intact_checkpoint(out, model) == (latest_checkpoint(out), [])


def test_resume_auto_on_a_finished_run_says_so_and_writes_nothing(base, capsys):
    """A finished run given --resume auto says it is done already and writes nothing: it is not resumed at its end
    (evaluated again, its weights rewritten)."""
    before = snapshot(base / "run")
    code, out, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", base / "run",
                                               "--resume", "auto"])
    assert code == 0 and err == "" and out.startswith(f"done already: {base / 'run'} finished its 1 epochs at step 4")
    assert "resumed from" not in out and snapshot(base / "run") == before


def test_a_bug_shows_its_traceback_and_says_it_is_a_bug(base, capsys, monkeypatch):
    """Only a bug in lipsformer gets a traceback (lipsformer's frames), with a line saying so;
    LIPSFORMER_TRACEBACK=1 shows the full traceback of any error, a mistake's too."""
    import lipsformer.engine.train as loop

    def broken(*args, **kwargs):
        return None + 1
    monkeypatch.setattr(loop, "build_criterion", broken)
    code, _, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", base / "bug"])
    assert code == 1 and "Traceback (most recent call last; lipsformer's frames" in err, err
    assert "lipsformer/engine/train.py" in err and "TypeError: unsupported operand" in err
    assert err.strip().splitlines()[-1].startswith("bug: lipsformer raised an unexpected TypeError, which is a bug")
    assert "LIPSFORMER_TRACEBACK=1 shows the full traceback" in err
    monkeypatch.undo()
    monkeypatch.setenv("LIPSFORMER_TRACEBACK", "1")
    code, _, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--set", "lrr=1"])
    assert code == 2 and err.startswith("Traceback (most recent call last):") and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("error: unknown config key(s): lrr (did you mean lr?)")


# -- help texts and a quiet start ---------------------------------------------------------------------------------
def test_help_shows_defaults_lists_the_config_keys_and_names_the_command(capsys):
    from lipsformer.lipschitz.__main__ import main as lipschitz
    for main, argv in ((EVAL.main, ["--help"]), (TRAIN.main, ["--help"]), (lipschitz, ["--help"])):
        with pytest.raises(SystemExit):
            main(argv)
    text = capsys.readouterr().out
    assert "per process (default: 100)" in text and "PGD steps per restart (default: 20)" in text  # eval.py
    assert "--list-keys" in text and "exit codes:" in text and " 75  preempted" in text  # train.py
    assert "usage: python -m lipsformer.lipschitz" in text
    assert TRAIN.main(["--list-keys"]) == 0
    listed = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"\n{f.name} " in "\n" + listed, f.name
    assert re.search(r"^lr +float +0\.002 +the peak learning rate; in \(0, inf\)$", listed, re.M), listed


def test_no_warning_on_a_plain_start_of_any_command(tmp_path):
    """fvcore.nn's import scripted a function with torch.jit.script, which torch deprecates with a FutureWarning
    that every start of python -m lipsformer.flops printed."""
    code = ("import contextlib, io, runpy, sys\n"
            "for target in ('train.py', 'eval.py', 'lipsformer.lipschitz', 'lipsformer.convert', 'lipsformer.flops',\n"
            "               'lipsformer.data.digits'):\n"
            "    sys.argv = [target, '--help']\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        runpy.run_path(target, run_name='__main__') if target.endswith('.py') else \\\n"
            "            runpy.run_module(target, run_name='__main__', alter_sys=True)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
