"""The weight-file door, generated rather than listed: from a tiny model's state dict, a seeded tensor of every kind
(first conv, conv, linear, norm, bias, residual weight, relative position table, classifier weight and bias) perturbed
in shape, in dtype and in finiteness (a NaN or an Inf), saved as .safetensors, .pth or a train.py run folder, loaded
through eval.py, the Lipschitz toolkit, convert, train.py's init_checkpoint and timm's Python path: each is refused in
one line naming the tensor, exit 2, no traceback, nothing written. Then what loading changes only where it is asked
to (a new classifier, an adapted first conv) and says in one line; classes.json with one name per output; and the
certificate API's checks of its input.
"""
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from conftest import TINY
from helpers import EVAL, RUN, SEED, TRAIN, call, make_folder, refused
from lipsformer import convert
from lipsformer.data.classes import write_class_names
from lipsformer.config import TrainConfig
from lipsformer.errors import Mistake
from lipsformer.lipschitz.__main__ import main as lipschitz
from lipsformer.build import build_model
from lipsformer.sources import export, recorded_input_size, resolve_checkpoint
from lipsformer.weights import CheckpointError, weights_fit

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

MODEL, CLASSES = RUN["model"], RUN["num_classes"]
ARGS = dict(RUN["model_kwargs"], img_size=RUN["img_size"], num_classes=CLASSES)  # what a lone file needs to be built
MODEL_ARGS = json.dumps(ARGS)
ADAPTED = "adapted: patch_embed.proj (3 -> 1 channels)"


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """A tiny image folder (4 classes), a train.py config for it, and the state dict of the model it trains."""
    root = tmp_path_factory.mktemp("door")
    make_folder(root / "data", train_per_class=(2,) * CLASSES, val_per_class=(1,) * CLASSES)
    TrainConfig(**dict(RUN, data_dir=str(root / "data"), output_dir=str(root / "out"))).save(root / "cfg.yaml")
    torch.manual_seed(SEED)
    model = timm.create_model(MODEL, **ARGS)
    return root, {k: v.detach().clone() for k, v in model.state_dict().items()}


def write(folder: Path, name: str, state_dict: dict, form: str, config: Path = None) -> Path:
    """``state_dict`` in ``folder`` as a ``.safetensors`` or ``.pth`` file, or as a train.py run folder (``run``:
    ``config`` as its config.yaml, classes.json, last.safetensors)."""
    if form == "run":
        run = folder / name
        run.mkdir()
        shutil.copy(config, run / "config.yaml")
        write_class_names(run / "classes.json", [f"class_{c}" for c in range(CLASSES)])
        save_file(state_dict, str(run / "last.safetensors"))
        return run
    path = folder / f"{name}{form}"
    save_file(state_dict, str(path)) if form == ".safetensors" else torch.save(state_dict, path)
    return path


# -- the catalogue ------------------------------------------------------------------------------------------------
KINDS = [  # (kind, rule on (key, tensor)): the first rule a key meets is its kind
    ("head_weight", lambda k, t: k == "head.fc.weight"),
    ("head_bias", lambda k, t: k == "head.fc.bias"),
    ("first_conv", lambda k, t: k == "patch_embed.proj.weight"),
    ("table", lambda k, t: k.endswith(".relative_position_bias_table")),
    ("alpha", lambda k, t: k.endswith(".alpha")),
    ("norm", lambda k, t: "norm" in k.rsplit(".", 2)[-2]),
    ("bias", lambda k, t: k.endswith(".bias")),
    ("conv", lambda k, t: t.dim() == 4),
    ("linear", lambda k, t: t.dim() == 2),
]
FORMS = [".safetensors", ".pth", "run"]
DEFECTS = ["shape", "dtype", "nan", "inf"]  # NaN and Inf alternate over the kinds: one non-finite file per kind


def kind_of(key: str, tensor: torch.Tensor) -> str:
    return next(kind for kind, rule in KINDS if rule(key, tensor))


def perturbed(tensor: torch.Tensor, defect: str, rng: random.Random) -> torch.Tensor:
    """``tensor`` with one more row, as int32, or with one value NaN / Inf (at a seeded place)."""
    if defect == "shape":
        return torch.cat([tensor, tensor[:1]])
    if defect == "dtype":
        return tensor.round().to(torch.int32)
    out = tensor.clone()
    out.view(-1)[rng.randrange(out.numel())] = float(defect)
    return out


def said(key: str, defect: str, tensor: torch.Tensor) -> list:
    """What the one line says: the tensor, and the defect."""
    if defect == "shape" and key == "head.fc.weight":
        return [key, f"is a classifier of {CLASSES + 1} classes", f"set num_classes to {CLASSES + 1}"]
    if defect == "shape":
        return [f"{key}: file {(tensor.shape[0] + 1, *tensor.shape[1:])} vs model {tuple(tensor.shape)}"]
    if defect == "dtype":
        return [f"{key} is int32", "is float32", "not converted"]
    return [f"{key} holds 1 non-finite value (NaN or Inf) of {tensor.numel()}"]


def catalogue(root: Path, state_dict: dict) -> list:
    """``(kind, defect, path, key, fragments)``: one seeded tensor of every kind with one more row, as int32 and with
    a NaN or an Inf (alternating), saved in a form that rotates so that every kind and every defect meets every
    form."""
    rng = random.Random(SEED)
    kinds = {}
    for key, tensor in state_dict.items():
        kinds.setdefault(kind_of(key, tensor), []).append(key)
    cases = []
    for i, (kind, _) in enumerate(KINDS):
        key = rng.choice(kinds[kind])
        for j, defect in enumerate(DEFECTS[:2] + [DEFECTS[2 + i % 2]]):
            form = FORMS[(i + j) % len(FORMS)]
            broken = dict(state_dict, **{key: perturbed(state_dict[key], defect, rng)})
            path = write(root / "cases", f"{kind}_{defect}", broken, form, root / "cfg.yaml")
            cases.append((kind, defect, path, key, said(key, defect, state_dict[key])))
    return cases


def entry_points(root: Path, path: Path) -> list:
    """``(name, main, argv, prefix of the line)`` of every command that loads ``path``."""
    lone = [] if path.is_dir() else ["--model", MODEL, "--model-args", MODEL_ARGS]
    return [
        ("eval.py", EVAL.main, ["--checkpoint", path, "--data-dir", root / "data", "--workers", 0, *lone], "error: "),
        ("lipschitz", lipschitz, ["--checkpoint", path, *lone], "error: "),
        ("convert", convert.main, [path, *lone, "--out", root / "converted"], "error: "),
        ("train.py", TRAIN.main, ["--config", root / "cfg.yaml", "--output-dir", root / "out", "--set",
                                  f"init_checkpoint={path}"], "error: init_checkpoint: "),
    ]


def test_every_broken_tensor_is_refused_in_one_line_naming_it_by_every_entry_point(door, capsys):
    root, state_dict = door
    assert {kind_of(k, v) for k, v in state_dict.items()} == {kind for kind, _ in KINDS}  # every rule meets a tensor
    (root / "cases").mkdir()
    for kind, defect, path, key, fragments in catalogue(root, state_dict):
        for name, main, argv, prefix in entry_points(root, path):
            if (kind, defect, name) == ("head_weight", "shape", "train.py"):
                continue  # another class count is what fine-tuning re-creates (tested below)
            line = refused(capsys, main, argv, root, *fragments)
            assert line.startswith(prefix + str(path)), (name, line)
        # Python: timm's pretrained path (the weights declaring the run's class count) and lipsformer.build.build_model
        with pytest.raises(CheckpointError) as info:
            if path.is_dir():
                build_model(None, path)
            else:
                timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(path),
                                                                                      num_classes=CLASSES), **ARGS)
        assert all(f in str(info.value) for f in fragments) and "\n" not in str(info.value), (path, info.value)


def test_half_and_double_precision_files_load_cast_and_a_double_beyond_float32_is_refused(door, tmp_path):
    """The stated rule: float16, bfloat16 and float64 files are cast to the model's float32 by the load."""
    _, state_dict = door
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        path = tmp_path / f"{dtype}.safetensors"
        save_file({k: v.to(dtype) for k, v in state_dict.items()}, str(path))
        loaded = build_model(MODEL, path, **ARGS).model.state_dict()
        assert all(torch.equal(loaded[k], v.to(dtype).float()) for k, v in state_dict.items()), dtype
    huge = dict({k: v.double() for k, v in state_dict.items()})
    huge["norm.weight"] = huge["norm.weight"].clone()
    huge["norm.weight"][3] = 1e300
    save_file(huge, str(tmp_path / "huge.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm\.weight holds 1 non-finite value \(NaN or Inf as float32\)"):
        build_model(MODEL, tmp_path / "huge.safetensors", **ARGS)


# -- what is adapted, only where asked, and said ------------------------------------------------------------------
def test_a_first_conv_is_adapted_only_for_an_asked_in_chans_and_every_command_says_so(door, capsys, tmp_path):
    root, state_dict = door
    rgb = write(tmp_path, "rgb", state_dict, ".safetensors")
    # the toolkit: the line comes before any bound, and its JSON says it
    code, out, err = call(capsys, lipschitz, ["--checkpoint", rgb, "--model", MODEL, "--model-args", MODEL_ARGS,
                                              "--input-size", 1, 32, 32, "--json", tmp_path / "bounds.json"])
    assert code == 0 and out.splitlines()[0] == ADAPTED, err
    assert json.loads((tmp_path / "bounds.json").read_text())["adapted"] == [ADAPTED[len("adapted: "):]]
    # eval.py, with the one grey channel's normalisation
    grey = dict(ARGS, in_chans=1, pretrained_cfg_overlay=dict(mean=[0.5], std=[0.25]))
    code, out, err = call(capsys, EVAL.main, ["--checkpoint", rgb, "--model", MODEL, "--model-args",
                                              json.dumps(grey), "--data-dir", root / "data", "--workers", 0])
    assert code == 0 and out.splitlines()[0] == ADAPTED and "top-1" in out.splitlines()[1], err
    # convert writes the adapted weights and says so
    code, out, err = call(capsys, convert.main, [rgb, "--model", MODEL, "--model-args", json.dumps(grey), "--out",
                                                 tmp_path / "grey_export"])
    assert code == 0 and out.splitlines()[0] == ADAPTED, err
    # train.py's start line (and its init row)
    from lipsformer.config import load_config
    from conftest import start_model
    cfg = load_config(root / "cfg.yaml", [f"init_checkpoint={rgb}", "model_kwargs.in_chans=1"])
    _, start = start_model(cfg)
    assert start.adapted == [ADAPTED[len("adapted: "):]] and f"; {ADAPTED}; " in start.line()
    # the Python path records it
    net = timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(rgb)), in_chans=1, **ARGS)
    assert weights_fit(net).lines() == [ADAPTED] and net.pretrained_cfg["input_size"][0] == 1
    # a file of one grey channel: build_model takes its channels, timm's path asks for in_chans
    one = write(tmp_path, "grey", dict(state_dict, **{"patch_embed.proj.weight":
                                                      state_dict["patch_embed.proj.weight"][:, :1].contiguous()}),
                ".safetensors")
    assert weights_fit(build_model(MODEL, one, **ARGS).model).lines() == []
    with pytest.raises(CheckpointError, match=r"patch_embed\.proj\.weight takes 1 input channels, lipsformer_swin_t "
                                              r"is built for 3: set in_chans to 1$"):
        timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(one)), **ARGS)


def test_a_kept_best_epochs_file_is_read_as_part_of_its_run(door, tmp_path):
    root, state_dict = door
    run = write(tmp_path, "run", state_dict, "run", config=root / "cfg.yaml")
    (run / "best").mkdir()
    kept = run / "best" / "epoch_001_top1_50.00.safetensors"
    shutil.copy(run / "last.safetensors", kept)
    assert resolve_checkpoint(kept)[1] == resolve_checkpoint(run)[1]  # its model, arguments and preprocessing
    assert weights_fit(build_model(None, kept).model).lines() == []  # no model name needed
    with pytest.raises(FileNotFoundError, match=r"holds neither config\.yaml \(a training run\) nor config\.json "
                                                r"\(an export\), nor sub-folders that do \(a folder of runs, which "
                                                r"eval\.py takes\)$"):
        resolve_checkpoint(run / "best")


def test_a_state_dict_saved_from_a_ddp_wrapped_model_is_read_without_its_module_prefix(door, tmp_path):
    root, state_dict = door
    path = tmp_path / "ddp.pth"
    torch.save({"model": {f"module.{k}": v for k, v in state_dict.items()}}, path)
    model = build_model(MODEL, path, **ARGS).model
    assert weights_fit(model).lines() == [] and all(torch.equal(v, state_dict[k]) for k, v in
                                                    model.state_dict().items())


def test_a_grey_models_weight_files_and_export_record_its_one_channel(tmp_path):
    from types import SimpleNamespace
    from lipsformer.engine.checkpoint import save_weights
    grey = timm.create_model(MODEL, in_chans=1, **ARGS)
    cfg = TrainConfig(**dict(RUN, model_kwargs=dict(RUN["model_kwargs"], in_chans=1)))
    save_weights(SimpleNamespace(is_main_process=True), grey.state_dict(), tmp_path / "last.safetensors", cfg)
    assert recorded_input_size(tmp_path / "last.safetensors") == (1, cfg.img_size, cfg.img_size)
    config = json.loads((export(grey, tmp_path / "export") / "config.json").read_text())
    assert config["pretrained_cfg"]["input_size"] == [1, RUN["img_size"], RUN["img_size"]]


def test_a_classifier_is_re_created_only_for_an_asked_class_count(door, capsys, tmp_path, monkeypatch):
    """A num_classes override against the file's classifier is a mistake naming the classifier in every command (not
    a RuntimeError's 'bug:' line), and a classifier of another class count is re-created only where asked and said
    (timm's pretrained path would re-create it without a word, and eval.py --pretrained score it)."""
    root, state_dict = door
    from lipsformer.models.lipsformer_swin import released_state_dict
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # timm's download cache, planted: no network
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    published = timm.create_model(MODEL, **dict(ARGS, num_classes=1000))
    torch.save({"model": released_state_dict(published)}, tmp_path / "torch/hub/checkpoints/lipsformer-swin-tiny.pth")
    refused(capsys, EVAL.main, ["--model", f"{MODEL}.official_in1k", "--pretrained", "--model-args", MODEL_ARGS,
                                "--data-dir", root / "data", "--workers", 0], root,
            "head.fc.weight is a classifier of 1000 classes, lipsformer_swin_t is built for 4: set num_classes to "
            "1000")  # the same fit check, and line, as a file's (below)
    path = write(tmp_path, "four", state_dict, ".safetensors")
    run = write(tmp_path, "four_run", state_dict, "run", root / "cfg.yaml")
    for argv in (["--checkpoint", path, "--model", MODEL, "--model-args", json.dumps(dict(ARGS, num_classes=10))],
                 ["--checkpoint", run, "--model-args", '{"num_classes": 10}']):
        for main, extra in ((EVAL.main, ["--data-dir", root / "data", "--workers", 0]), (lipschitz, [])):
            refused(capsys, main, argv + extra, root, "head.fc.weight is a classifier of 4 classes, lipsformer_swin_t "
                    "is built for 10: set num_classes to 4", "reset_head")
    without = {k: v for k, v in ARGS.items() if k != "num_classes"}
    with pytest.raises(CheckpointError, match="classifier of 4 classes, lipsformer_swin_t is built for 1000: set "
                                              "num_classes to 4"):
        timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **without)
    net = timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **dict(ARGS,
                                                                                                       num_classes=7))
    assert weights_fit(net).lines() == ["re-initialised: head.fc (4 -> 7 classes)"]
    assert weights_fit(net).reinitialised == ["head.fc.weight", "head.fc.bias"]
    assert all(torch.equal(v, state_dict[k]) for k, v in net.state_dict().items() if not k.startswith("head."))


@pytest.mark.parametrize("form", [".safetensors", ".pth"])
def test_a_truncated_file_is_named_damaged_before_the_model_name_is_asked_for(door, capsys, tmp_path, form):
    """A weight file cut short, given without a model name (a bare file does not say which model it holds): every
    command names the damage first, as passing the name would only lead to it."""
    _, state_dict = door
    path = write(tmp_path, "cut", state_dict, form)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for main, argv in ((EVAL.main, ["--checkpoint", path, "--data-dir", tmp_path, "--workers", 0]),
                       (lipschitz, ["--checkpoint", path]), (convert.main, [path, "--out", tmp_path / "x"])):
        line = refused(capsys, main, argv, tmp_path, f"cannot read {path}: truncated")
        assert "model name" not in line, line


# a run's classes.json as a hand might leave it, and what the one line says (data/classes.py's reader)
CLASSES_DEFECTS = [
    ('["a", "b", "c"]', "classes.json names 3 classes, the classifier has 4 outputs"),
    ('{"a": 0}', "classes.json must be a JSON list of class names (strings, in label order), not a JSON object"),
    ('["a", "b", "c", ', "cannot read the class names file"),
    ('["a", null, "c", "d"]', "classes.json: entry 1 is null (null); each entry is a class name"),
    ('["a", 2, "c", "d"]', "classes.json: entry 1 is 2 (number)"),
    ('["a", "", "c", "d"]', 'classes.json: entry 1 is "" (string)'),
    ('["a", "b", "a", "d"]', "classes.json: 'a' is both entry 0 and entry 2; each class has one name"),
]


@pytest.mark.parametrize("text, message", CLASSES_DEFECTS)
def test_classes_json_is_one_distinct_name_per_output(door, capsys, tmp_path, text, message):
    """Every command that reads a run's classes.json refuses a defective one in one line naming the file and the
    entry: eval.py, the toolkit, convert."""
    root, state_dict = door
    run = write(tmp_path, "run", state_dict, "run", root / "cfg.yaml")
    (run / "classes.json").write_text(text)
    for main, extra in ((EVAL.main, ["--data-dir", root / "data", "--workers", 0]), (lipschitz, []),
                        (convert.main, ["--out", tmp_path / "x"])):
        argv = [run] + extra if main is convert.main else ["--checkpoint", run] + extra
        refused(capsys, main, argv, tmp_path, str(run), message)


def test_an_exports_label_names_are_one_per_output(door, capsys, tmp_path):
    root, state_dict = door
    folder = export(build_model(MODEL, write(tmp_path, "w", state_dict, ".safetensors"), **ARGS).model,
                    tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    config["label_names"] = ["a", "b"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(capsys, EVAL.main, ["--checkpoint", folder, "--data-dir", root / "data", "--workers", 0], tmp_path,
            "config.json's label_names names 2 classes, the classifier has 4 outputs")


# -- the certificate API's input ----------------------------------------------------------------------------------
def test_the_certificate_api_names_what_is_wrong_with_its_input():
    """0-255 pixels, a NaN pixel, a 3-D image or wrong channels are each named as such: not the AttLip solver's step
    cap (a SolverToleranceError blaming its tolerance), a NaN radius or a shape error from deep inside the model."""
    from accelerate import Accelerator
    from lipsformer.lipschitz.certify import (CertifyInputError, certify_dataset, normalization, pgd_l2,
                                              pixel_lipschitz, predict_certified)
    model = timm.create_model("lipsformer_swin_t_cert", **dict(TINY["swin"], window_size=4), num_classes=4).eval()
    mean, std = normalization(model)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(SEED))
    good = (pixels - mean) / std
    nan = good.clone()
    nan[1, 0, 3, 3] = float("nan")
    cases = [
        ((pixels * 255).to(torch.uint8), "images are uint8, pixels look like 0-255: convert to float and divide by "
                                         "255"),
        ((pixels * 255 - mean) / std, "pixels look like 0-255 (values up to 25"),
        (pixels * 255, "pixels look like 0-255"),
        (nan, "images hold 1 NaN or Inf value(s), the first in image 1"),
        (good[0], "must be 4-D (batch, channels, height, width), got shape (3, 32, 32): add the batch dimension"),
        (good[:0], "images are empty (shape (0, 3, 32, 32))"),
        (good[:, :1], "images have 1 channels, the model takes 3"),
        ((good - mean) / std, "outside the pixel range [0, 1]"),
        (good.long(), "must be floating point"),
    ]
    for images, message in cases:
        with pytest.raises(CertifyInputError, match=re.escape(message)) as info:
            predict_certified(model, images)
        assert isinstance(info.value, Mistake) and isinstance(info.value, ValueError)
    with pytest.raises(CertifyInputError, match=re.escape("pixels: pixels look like 0-255")):
        pgd_l2(model, pixels * 255, torch.tensor([0, 1]), 0.1, mean, std, steps=1, restarts=1)
    try:
        with pytest.raises(CertifyInputError, match=re.escape("NaN or Inf")):
            certify_dataset(model, [(nan, torch.tensor([0, 1]))], Accelerator(cpu=True), [[0], [1]], [0.1])
    finally:
        from conftest import reset_accelerate
        reset_accelerate()
    # what passes: pixels in [0, 1] within a grey level (bfloat16 images), normalised
    _, _, radius = predict_certified(model, good.to(torch.bfloat16))
    assert torch.isfinite(radius).all() and (radius >= 0).all()
    with torch.no_grad():
        dict(model.named_parameters())["head.fc.weight"][0, 0] = float("nan")
    with pytest.raises(CertifyInputError, match=r"the model's head\.fc\.weight holds 1 non-finite value"):
        pixel_lipschitz(model)


def test_the_certificate_api_refuses_a_model_without_two_classes_and_certifies_a_double_one():
    """A model of one logit (every image would get an infinite radius) and one of pooled features (num_classes=0:
    radii of its features' margins) are refused; a float64 model is certified in float64, its images not cast to
    float32."""
    from lipsformer.lipschitz.certify import CertifyInputError, normalization, predict_certified
    arch = dict(TINY["swin"], window_size=4)
    for classes, said in ((1, "one logit, with no runner-up"), (0, "pooled features, not logits")):
        model = timm.create_model("lipsformer_swin_t_cert", **arch, num_classes=classes).eval()
        with pytest.raises(CertifyInputError, match=re.escape(f"num_classes={classes}: it outputs {said}")):
            predict_certified(model, torch.zeros(1, 3, 32, 32))
    torch.manual_seed(SEED)
    single = timm.create_model("lipsformer_swin_t_cert", **arch, num_classes=4).eval()
    double = timm.create_model("lipsformer_swin_t_cert", **arch, num_classes=4).eval()
    double.load_state_dict(single.state_dict())
    double.double()
    mean, std = normalization(single)
    images = (torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(SEED)) - mean) / std
    logits, pred, radius = predict_certified(double, images.double())
    assert logits.dtype == torch.float64 and torch.equal(pred, predict_certified(single, images)[1])
    assert torch.allclose(radius.double(), predict_certified(single, images)[2].double(), rtol=1e-3)
