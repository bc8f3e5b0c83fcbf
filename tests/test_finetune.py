"""Fine-tuning: start from released / published / trained weights, a new head, freezing, layer decay,
exact resume, eval.py at the built size, and bad input that stops before anything is written."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from lipsformer.engine.checkpoint import latest_checkpoint
from lipsformer.config import ConfigError, TrainConfig, load_config
from conftest import start_model
from lipsformer.engine.finetune import eval_frozen
from lipsformer.engine.train import build_optimizer, build_scheduler, train
from lipsformer.models import lipsformer_cswin, lipsformer_swin

from conftest import TINY, family, load_script, reset_accelerate
from helpers import make_folder, read_metrics

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SWIN = dict(TINY["swin"], init="xavier")
ARCH = {k: v for k, v in SWIN.items() if k != "img_size"}
CLASSES = 7
RUN = dict(model="lipsformer_swin_t", model_kwargs=ARCH, num_classes=CLASSES, img_size=32, crop_pct=1.0,
           drop_path=0.1, workers=0, epochs=1, global_batch=7, batch_size=7, lr=1e-2, aa=None, reprob=0.0,
           mixup=0.0, cutmix=0.0, ema_decay=None, mixed_precision="no", checkpoint_every_steps=100, keep_last=10,
           log_every_steps=1, eval_every_epochs=1)


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Seven classes, two training images each: one optimizer step per epoch at batch 7."""
    return make_folder(tmp_path_factory.mktemp("data") / "seven", train_per_class=(2,) * CLASSES,
                       val_per_class=(1,) * CLASSES)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A 1000-class tiny LipsFormer-Swin in the released code's layout (as the published .pth), and its weights
    in our layout."""
    torch.manual_seed(1)
    source = timm.create_model("lipsformer_swin_t", **SWIN)
    path = tmp_path_factory.mktemp("released") / "lipsformer-swin-tiny.pth"
    torch.save({"model": lipsformer_swin.released_state_dict(source), "epoch": 299}, path)
    return path, {k: v.clone() for k, v in source.state_dict().items()}


def config(tmp_path, data, **overrides) -> TrainConfig:
    return TrainConfig(**{**RUN, "data_dir": str(data), "output_dir": str(tmp_path / "run"), **overrides})


# -- starting weights -------------------------------------------------------------------------------------
def test_released_file_finetunes_into_a_7_class_model(tmp_path, data, released):
    path, source = released
    cfg = config(tmp_path, data, init_checkpoint=str(path))
    model, start = start_model(cfg)
    assert start.reinitialised == ["head.fc.weight", "head.fc.bias"]
    assert model.get_classifier().out_features == CLASSES
    ours = model.state_dict()
    assert ours.keys() == source.keys()
    for key, value in ours.items():
        if key.startswith("head.fc."):
            assert value.shape[0] == CLASSES
        else:
            assert torch.equal(value, source[key]), key

    summary = train(cfg)
    assert summary["step"] == 2
    init = next(r for r in read_metrics(tmp_path / "run") if r["kind"] == "init")
    assert init == dict(kind="init", step=0, source=str(path), reinitialised=["head.fc.weight", "head.fc.bias"],
                        adapted=[], frozen=[])
    last = load_file(str(tmp_path / "run" / "last.safetensors"))
    assert last["head.fc.weight"].shape == (CLASSES, model.num_features)
    assert not torch.equal(last["stages.2.blocks.1.attn.qkv.weight"], source["stages.2.blocks.1.attn.qkv.weight"])


def test_same_class_count_keeps_the_head_and_a_run_folder_is_a_source(tmp_path, data, released):
    """A train.py run folder (its last or EMA weights) starts another run; the same class count keeps the head."""
    first = config(tmp_path, data, init_checkpoint=str(released[0]), ema_decay=0.5,
                   output_dir=str(tmp_path / "first"))
    train(first)
    for use_ema, name in ((False, "last.safetensors"), (True, "last_ema.safetensors")):
        cfg = config(tmp_path, data, init_checkpoint=str(tmp_path / "first"), init_use_ema=use_ema)
        model, start = start_model(cfg)
        assert start.reinitialised == []
        weights = load_file(str(tmp_path / "first" / name))
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    # other classes, as many: reset_head re-creates the classifier and keeps the rest
    model, start = start_model(config(tmp_path, data, init_checkpoint=str(tmp_path / "first"), reset_head=True))
    weights = load_file(str(tmp_path / "first" / "last.safetensors"))
    assert start.reinitialised == ["head.fc.weight", "head.fc.bias"]
    assert not torch.equal(model.head.fc.weight, weights["head.fc.weight"])
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items() if not k.startswith("head.fc."))


def test_published_tag_loads_through_timms_pretrained_path(tmp_path, data, released, monkeypatch):
    """``pretrained: lipsformer_swin_t.official_in1k`` reads timm's download cache (planted here: no network)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    shutil.copy(released[0], cache / "lipsformer-swin-tiny.pth")
    model, start = start_model(config(tmp_path, data, pretrained="lipsformer_swin_t.official_in1k"))
    assert start.source == "lipsformer_swin_t.official_in1k"
    assert start.reinitialised == ["head.fc.weight", "head.fc.bias"]
    source = released[1]
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items() if not k.startswith("head.fc."))


# -- fine-tuning knobs ------------------------------------------------------------------------------------
def test_layer_decay_scales_lr_from_patch_embed_smallest_to_head_largest(tmp_path, data):
    """timm's rule: lr_scale = decay ** (layer_max - layer). Our group_matcher gives the tiny Swin (depths 1, 1, 2, 1)
    7 layers: patch_embed 0, stages.0 1, stages.1 2, stages.2's blocks 3 and 4, stages.3 with the final norm 5,
    the head 6."""
    cfg = config(tmp_path, data, layer_decay=0.5, lr=1e-2)
    model, _ = start_model(cfg)
    optimizer = build_optimizer(cfg, model)
    from timm.scheduler import CosineLRScheduler
    CosineLRScheduler(optimizer, t_initial=10, t_in_epochs=False).step_update(0)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    lrs = {name: lr_of[id(p)] for name, p in model.named_parameters()}
    expected = {"patch_embed.proj.weight": 0.5 ** 6, "stages.0.blocks.0.attn.qkv.weight": 0.5 ** 5,
                "stages.1.downsample.reduction.weight": 0.5 ** 4, "stages.2.blocks.0.mlp.fc1.weight": 0.5 ** 3,
                "stages.2.blocks.1.mlp.fc1.weight": 0.5 ** 2, "norm.weight": 0.5, "head.fc.weight": 1.0}
    for name, scale in expected.items():
        assert lrs[name] == pytest.approx(1e-2 * scale, rel=1e-12), name
    assert min(lrs.values()) == lrs["patch_embed.proj.weight"]
    assert max(lrs.values()) == lrs["head.fc.weight"] == pytest.approx(1e-2)
    # without layer_decay every group has the base lr
    plain = build_optimizer(config(tmp_path, data), model)
    assert {g["lr"] for g in plain.param_groups} == {1e-2}


def test_logged_lr_with_layer_decay_is_the_mean_over_param_groups_as_timm_logs_it(tmp_path, data):
    """timm's train.py logs the mean of the param groups' lrs; with layer_decay each group's is the schedule's times
    its layer's scale, so the first group's (the patch embedding's, the smallest) is not the run's."""
    cfg = config(tmp_path, data, layer_decay=0.5, epochs=2, eval_every_epochs=100)
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] in ("train", "epoch")]
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 4]  # two updates per epoch
    optimizer = build_optimizer(cfg, start_model(cfg)[0])
    scheduler = build_scheduler(cfg, optimizer, 2)
    for row in rows:
        scheduler.step_update(row["step"])
        lrs = [g["lr"] for g in optimizer.param_groups]
        assert row["lr"] == pytest.approx(sum(lrs) / len(lrs), rel=1e-12) and row["lr"] > lrs[0] * 1.5
    summary = (tmp_path / "run" / "summary.csv").read_text().splitlines()
    assert [float(line.split(",")[5]) for line in summary[1:]] == [r["lr"] for r in rows if r["kind"] == "epoch"]


@pytest.mark.parametrize("freeze, freeze_stages, fixed, trained", [
    ("backbone", 0, ("patch_embed.", "stages.", "norm."), ("head.fc.",)),
    (None, 2, ("patch_embed.", "stages.0.", "stages.1."), ("stages.2.", "stages.3.", "head.fc.")),
])
def test_frozen_modules_keep_bit_identical_weights_while_the_rest_trains(tmp_path, data, released, freeze,
                                                                         freeze_stages, fixed, trained):
    cfg = config(tmp_path, data, init_checkpoint=str(released[0]), freeze=freeze, freeze_stages=freeze_stages,
                 epochs=2, drop_path=0.5)
    model, start = start_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    eval_frozen(model, start.frozen)
    assert not model.patch_embed.training and model.head.training
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith(fixed))

    train(cfg)
    after = load_file(str(tmp_path / "run" / "last.safetensors"))
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith(fixed))
    for prefix in trained:
        assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith(prefix)), prefix
    init = next(r for r in read_metrics(tmp_path / "run") if r["kind"] == "init")
    assert init["frozen"] == start.frozen


def test_killed_finetuning_run_resumes_to_bit_identical_weights(tmp_path, data, released):
    """A fine-tuning run (new head, layer decay, frozen stem, EMA) stopped after step 2 of 4 and resumed with
    --resume auto ends with the weights of the run that never stopped: the starting weights are not loaded again
    and the optimizer's layer-decay groups line up with the saved state. The stop is a SIGKILL's on-disk state:
    every checkpoint and weight file written after step 2 removed."""
    cfg = config(tmp_path, data, init_checkpoint=str(released[0]), epochs=2, layer_decay=0.7, freeze_stages=1,
                 ema_decay=0.5, checkpoint_every_steps=1, eval_every_epochs=100, output_dir=str(tmp_path / "whole"))
    train(cfg)
    stopped = tmp_path / "stopped"
    shutil.copytree(tmp_path / "whole", stopped)
    for path in [*stopped.glob("*.safetensors"), *(stopped / "checkpoints").glob("step_*")]:
        if path.suffix == ".safetensors" or int(path.name.split("_")[1]) > 1:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert latest_checkpoint(stopped).name == "step_000000001"
    train(TrainConfig(**dict(vars(cfg), output_dir=str(stopped))), resume="auto")
    for name in ("last.safetensors", "last_ema.safetensors"):
        a, b = load_file(str(tmp_path / "whole" / name)), load_file(str(stopped / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("weights, model", [("released", "lipsformer_swin_t"), ("cswin_file", "lipsformer_cswin_t")])
@pytest.mark.parametrize("in_chans", [1, 4])
def test_three_channel_weights_load_into_another_in_chans_as_timm_adapts_them(request, weights, model, in_chans):
    """timm's ``adapt_input_conv`` on the stem (``first_conv``), every other tensor as in the file: through
    ``init_checkpoint`` (a released-layout file) and timm's own pretrained path (``pretrained_cfg_overlay``)."""
    from timm.models import adapt_input_conv
    from lipsformer.build import build_model
    path = request.getfixturevalue(weights)
    path = path[0] if isinstance(path, tuple) else path
    arch = dict(TINY[family(model)], init="xavier")
    rgb = build_model(model, path, **arch).model.state_dict()
    for net in (build_model(model, path, in_chans=in_chans, **arch).model,
                timm.create_model(model, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                                  in_chans=in_chans, **arch)):
        ours = net.state_dict()
        assert torch.equal(ours["patch_embed.proj.weight"], adapt_input_conv(in_chans, rgb["patch_embed.proj.weight"]))
        assert all(torch.equal(v, rgb[k]) for k, v in ours.items() if k != "patch_embed.proj.weight")
        assert net(torch.randn(1, in_chans, 32, 32)).shape == (1, 1000)


# -- bad input: one line naming the thing to fix, nothing written -------------------------------------------
@pytest.fixture(scope="module")
def cswin_file(tmp_path_factory):
    torch.manual_seed(0)
    model = timm.create_model("lipsformer_cswin_t", **dict(TINY["cswin"], init="xavier"))
    path = tmp_path_factory.mktemp("cswin") / "cswin.pth"
    torch.save(lipsformer_cswin.released_state_dict(model), path)
    return path


@pytest.mark.parametrize("overrides, message", [
    (lambda p, r: dict(init_checkpoint=str(p)), "init_checkpoint: "),  # another architecture: keys named
    (lambda p, r: dict(init_checkpoint=str(p.parent / "missing.pth")), "init_checkpoint: no checkpoint "),
    (lambda p, r: dict(model="lipsformer_cswin_t", model_kwargs={}, pretrained="lipsformer_cswin_t"),
     "pretrained 'lipsformer_cswin_t': no published weights under that name (published for lipsformer_cswin_t: "
     "none)"),
    (lambda p, r: dict(pretrained="lipsformer_cswin_t.in1k"),
     "pretrained 'lipsformer_cswin_t.in1k' names weights of lipsformer_cswin_t, but model is lipsformer_swin_t"),
    (lambda p, r: dict(freeze="neck", init_checkpoint=str(r)),
     "freeze: 'neck' names no module with parameters in lipsformer_swin_t"),
    (lambda p, r: dict(freeze_stages=5, init_checkpoint=str(r)),
     "freeze_stages 5: lipsformer_swin_t has 4 stages; use 0 to 4"),
    # a model argument the constructor refuses, from scratch and with weights to load
    (lambda p, r: dict(model_kwargs=dict(ARCH, stage_act="relu")), "lipsformer_swin_t: stage_act must be one of "
     "('none', 'gelu', 'groupsort'), got 'relu'"),
    (lambda p, r: dict(model_kwargs=dict(ARCH, v_nrom=True), init_checkpoint=str(p)), "lipsformer_swin_t: "
     "LipsFormerSwin.__init__() got an unexpected keyword argument 'v_nrom'"),
])
def test_bad_starting_point_stops_before_anything_is_written(tmp_path, data, cswin_file, released, overrides,
                                                             message):
    cfg = config(tmp_path, data, **overrides(cswin_file, released[0]))
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as info:
        train(cfg)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_another_architecture_names_the_keys_that_do_not_fit(tmp_path, data, cswin_file):
    with pytest.raises(ConfigError) as info:
        start_model(config(tmp_path, data, init_checkpoint=str(cswin_file)))
    assert "does not fit lipsformer_swin_t: missing keys" in str(info.value)
    assert "missing keys (" in str(info.value) and "patch_embed.proj.weight" in str(info.value)
    assert "unexpected keys (" in str(info.value) and "stage1_conv_embed.0.weight" in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("layer_decay=0", "layer_decay must be in (0, 1]"),
    ("layer_decay=1.5", "layer_decay must be in (0, 1]"),
    ("freeze_stages=-1", "freeze_stages must be 0 or more"),
    ("init_use_ema=true", "init_use_ema applies to init_checkpoint"),
    ("reset_head=true", "reset_head applies to pretrained or init_checkpoint"),
])
def test_fine_tuning_keys_are_checked_when_the_config_loads(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, [override])
    with pytest.raises(ConfigError, match="set one of pretrained"):
        load_config(None, ["pretrained=lipsformer_swin_t.official_in1k", "init_checkpoint=x.pth"])
    for frozen in ("freeze=backbone", "freeze_stages=1"):  # bound keeping would rescale the frozen weights
        with pytest.raises(ConfigError, match="frozen ones included"):
            load_config(None, [frozen, "lipschitz_target=2"])


def test_train_cli_prints_one_line_and_exits_2_for_a_tag_without_weights(tmp_path, data):
    proc = subprocess.run([PY, str(ROOT / "train.py"), "--data-dir", str(data), "--output-dir", str(tmp_path / "r"),
                           "--set", "model=lipsformer_cswin_t", "pretrained=lipsformer_cswin_t"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: pretrained 'lipsformer_cswin_t': no published weights under that name (published for "
        "lipsformer_cswin_t: none); use init_checkpoint for weights of your own"]
    assert not (tmp_path / "r").exists()


# -- the tools accept fine-tuned runs; eval.py preprocesses at the built size ----------------------------------
def _eval_cli():
    return load_script("eval.py").main


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, data, released):
    root = tmp_path_factory.mktemp("finetuned")
    train(config(root, data, init_checkpoint=str(released[0]), freeze="backbone", ema_decay=0.5))
    reset_accelerate()
    return root / "run"


def test_eval_convert_and_lipschitz_cli_accept_a_fine_tuned_run(tmp_path, data, finetuned, capsys):
    from lipsformer import convert
    from lipsformer.lipschitz.__main__ import main as lipschitz_main
    eval_main = _eval_cli()
    out = tmp_path / "eval.json"
    assert eval_main(["--checkpoint", str(finetuned), "--use-ema", "--data-dir", str(data / "val"),
                      "--workers", "0", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["count"] == CLASSES and result["input_size"] == [3, 32, 32] and result["crop_pct"] == 1.0
    assert convert.main([str(finetuned), "--out", str(tmp_path / "export")]) == 0
    exported = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True)
    weights = load_file(str(finetuned / "last.safetensors"))
    assert all(torch.equal(v, weights[k]) for k, v in exported.state_dict().items())
    assert lipschitz_main(["--checkpoint", str(finetuned)]) == 0
    assert "network bound" in capsys.readouterr().out


def test_eval_preprocesses_at_the_built_size_and_takes_validate_overrides(tmp_path, data, finetuned):
    """A bare weight file with --model-args img_size 32 is scored on 32 px images (not 224 px crops
    stopping with a size error). --img-size builds and preprocesses at another size: 32 px CSwin weights at 64 px
    (LePE is a convolution, split size 1 divides every stage); --crop-pct / --interpolation override the config."""
    bare = tmp_path / "swin" / "model.safetensors"
    bare.parent.mkdir()
    shutil.copy(finetuned / "last.safetensors", bare)
    cswin = tmp_path / "cswin" / "model.safetensors"
    cswin.parent.mkdir()
    cswin_args = dict(TINY["cswin"], init="xavier", num_classes=CLASSES, split_size=(1, 1, 1, 1))
    save_file(timm.create_model("lipsformer_cswin_t", **cswin_args).state_dict(), str(cswin))
    cswin_args.pop("img_size")
    eval_main = _eval_cli()
    runs = (
        (["--checkpoint", str(bare), "--model", "lipsformer_swin_t",
          "--model-args", json.dumps(dict(SWIN, num_classes=CLASSES))], (32, 0.9, "bicubic")),
        (["--checkpoint", str(cswin), "--model", "lipsformer_cswin_t", "--model-args", json.dumps(cswin_args),
          "--img-size", "64", "--crop-pct", "0.5", "--interpolation", "bilinear"], (64, 0.5, "bilinear")),
    )
    for args, (size, crop, interpolation) in runs:
        out = tmp_path / f"eval{size}.json"
        assert eval_main(args + ["--data-dir", str(data / "val"), "--workers", "0", "--output", str(out)]) == 0
        result = json.loads(out.read_text())
        assert (result["input_size"], result["crop_pct"], result["interpolation"]) == (
            [3, size, size], crop, interpolation)
        assert result["count"] == CLASSES


def test_eval_refuses_disagreeing_sizes_in_one_line(tmp_path, data, finetuned, capsys):
    args = ["--checkpoint", str(finetuned / "last.safetensors"), "--data-dir", str(data / "val"), "--workers", "0",
            "--img-size", "64", "--model-args", '{"img_size": 32}']
    assert _eval_cli()(args) == 2
    assert capsys.readouterr().err.strip() == ("error: --img-size 64 disagrees with --model-args img_size 32; "
                                               "pass one of them")


def test_swin_weights_fine_tune_at_another_size_with_resized_bias_tables(tmp_path, data, released):
    """32 px LipsFormer-Swin weights start a 64 px run: the last stage's window grows from 1 to 2, so its bias
    table is resized (the family's checkpoint_filter_fn); every other tensor is the file's."""
    path, source = released
    model, start = start_model(config(tmp_path, data, init_checkpoint=str(path), img_size=64))
    assert model.patch_embed.img_size == (64, 64)
    table = "stages.3.blocks.0.attn.relative_position_bias_table"
    assert source[table].shape[0] == 1 and model.state_dict()[table].shape[0] == 9
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items()
               if k != table and not k.startswith("head.fc."))
