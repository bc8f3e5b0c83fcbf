"""Every file in configs/ trains and evaluates as shipped: its augmentation, mixup / cutmix, random erasing, label
smoothing, EMA, drop path, layer decay and precision left on; only the model's width and depth, the image size, the
batch and the epochs shrunk. On images as users have them (grayscale, palette, RGBA, CMYK, 16-bit, EXIF-rotated,
1x1, 3x5000), with the Pillow / timm / torchvision that pip resolves today.

A shrunk look-alike with the augmentation switched off hides what the recipes' own pipelines hit (RandAugment's
0-bit posterize crashes every ImageNet recipe on Pillow 13 unless caught): these tests build the pipelines exactly as
train.py and eval.py do.
"""
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment
from conftest import ROOT, TINY, config_model, family, load_script, reset_accelerate

from lipsformer.data import TransformError
from lipsformer.data.augment import apply_transform, portable, posterize
from lipsformer.config import ConfigError, load_config

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SOAK = load_script("benchmarks/investigations/augment_soak.py")
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def awkward_images(folder: Path, tint: int) -> None:
    """One image of each kind users' folders hold and a decoder or transform may trip on."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(tint)
    rgb = Image.fromarray((rng.random((40, 60, 3)) * 80 + tint).astype(np.uint8))
    rgb.convert("L").save(folder / "gray.png")
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    palette.save(folder / "palette.png", transparency=0)
    rgb.convert("RGBA").save(folder / "rgba.png")
    rgb.convert("CMYK").save(folder / "cmyk.jpg")
    Image.fromarray((rng.random((30, 50)) * 60000).astype(np.uint16)).save(folder / "sixteen_bit.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotated 90 degrees
    rgb.save(folder / "exif_rotated.jpg", exif=exif)
    Image.new("RGB", (1, 1), (tint, 0, 0)).save(folder / "one_pixel.png")
    Image.fromarray((rng.random((5000, 3, 3)) * 255).astype(np.uint8)).save(folder / "tall_3x5000.png")


def awkward_folder(root: Path, classes: int = 2) -> Path:
    for split in ("train", "val"):
        for c in range(classes):
            awkward_images(root / split / f"class_{c}", tint=40 + 100 * c)
    return root


def tiny_model(path: Path) -> list:
    """``--set`` overrides giving ``path``'s model the tiny width and depth (its other model arguments kept), at
    32 px for 4 px patches (8 x 8 tokens; a recipe of larger patches gets the same tokens)."""
    cfg = load_config(path)
    kwargs = TINY[family(cfg.model)]
    return [f"model_kwargs.{k}={json.dumps(list(v) if isinstance(v, tuple) else v)}"
            for k, v in kwargs.items() if k != "img_size"] + [f"img_size={8 * cfg.model_kwargs.get('patch_size', 4)}"]


# bf16 autocast where the machine computes in bf16 (a GPU, or a CPU with AVX512-BF16 / AMX); elsewhere oneDNN
# emulates it, and a CSwin step takes many times as long (its depth-wise conv2d above all), so the recipes train in
# fp32 there. The flagship resume test below keeps bf16 everywhere.
NATIVE_BF16 = torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def shrunk(path: Path, data: Path, out: Path, *extra: str) -> list:
    """train.py arguments for ``path`` with only the model, image size, batch, epochs and worker count shrunk
    (and bf16 off where the machine has no bf16 arithmetic)."""
    cfg = load_config(path)
    epochs = len(cfg.attlip_train_steps or [1])  # one epoch per phase of an AttLip step schedule: all of it runs
    sets = tiny_model(path) + ["batch_size=4", "global_batch=8", f"epochs={epochs}", f"workers={min(cfg.workers, 1)}",
                               f"num_classes={len(list((data / 'train').iterdir()))}"]
    if cfg.mixed_precision == "bf16" and not NATIVE_BF16:
        sets.append("mixed_precision=no")  # the word, as users type it (YAML would read a boolean)
    sets = [s for s in sets if s.split("=", 1)[0] not in {e.split("=", 1)[0] for e in extra}]  # a key is set once
    return ["--config", str(path), "--data-dir", str(data), "--output-dir", str(out), "--set", *sets, *extra]


_SOAKED = {}


def soak(path: Path) -> dict:
    """``path``'s training transform at 32 px on 600 random images against timm's (benchmarks/augment_soak.py), once
    per distinct transform: recipes that build the same transform (the same repr, as the benchmark groups them)
    share one soak."""
    key = repr(SOAK.training_transforms(load_config(path, ["img_size=32"]))[0])
    if key not in _SOAKED:
        _SOAKED[key] = SOAK.soak(path, images=600, img_size=32, max_side=64, seed=0)
    return _SOAKED[key]


# What the shrinking may change; everything else must stay as shipped (checked below, so the test cannot drift
# into a look-alike).
SHRUNK_KEYS = {"model_kwargs", "img_size", "batch_size", "global_batch", "epochs", "workers", "data_dir", "num_classes",
               "output_dir", "init_checkpoint"} | (set() if NATIVE_BF16 else {"mixed_precision"})


def _features_kept(path: Path, run: Path) -> None:
    shipped, ran = load_config(path).to_dict(), load_config(run / "config.yaml").to_dict()
    changed = {k for k in shipped if shipped[k] != ran[k]}
    assert changed <= SHRUNK_KEYS, f"the test changed recipe keys {changed - SHRUNK_KEYS}"
    assert {k: v for k, v in ran["model_kwargs"].items() if k not in TINY[family(ran["model"])]} == \
        {k: v for k, v in shipped["model_kwargs"].items() if k not in TINY[family(ran["model"])]}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_trains_and_evaluates_as_shipped(path, tmp_path, capfd):
    if load_config(path).aa:  # a few training steps draw too few augmentations to meet a rare op: 600 images do
        soaked = soak(path)
        assert soaked["ours_raised"] == 0, soaked["errors"]
        assert soaked["mismatched"] == 0
    data = awkward_folder(tmp_path / "data")
    train_main, eval_main = load_script("train.py").main, load_script("eval.py").main
    extra = []
    if load_config(path).init_checkpoint:  # the fine-tuning recipe starts from a run of the same (shrunk) model
        source = tmp_path / "source"
        assert train_main(shrunk(path, data, source, "init_checkpoint=null", "reset_head=false")) == 0
        reset_accelerate()
        extra = [f"init_checkpoint={source}"]
    run = tmp_path / "run"
    code = train_main(shrunk(path, data, run, *extra))
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err + out
    _features_kept(path, run)
    cfg = load_config(run / "config.yaml")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    epoch = epochs[-1]
    assert epoch["train_samples"] == 16 and epoch["bad_samples"] == 0 and epoch["val_count"] == 16
    if cfg.attlip_train_steps:  # the whole schedule ran, one phase per epoch
        assert [r["attlip_train_steps"] for r in epochs] == cfg.attlip_train_steps
    assert (run / "last.safetensors").exists()
    assert (run / "last_ema.safetensors").exists() == bool(cfg.ema_decay)

    reset_accelerate()
    result = tmp_path / "eval.json"
    code = eval_main(["--checkpoint", str(run), "--data-dir", str(data / "val"), "--batch-size", "4",
                      "--workers", "0", "--output", str(result)])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err + out
    assert json.loads(result.read_text())["count"] == 16


@pytest.mark.slow
def test_swin_t_recipe_trains_two_epochs_on_awkward_images_and_resumes_exactly(tmp_path):
    """The flagship recipe as users run it (a subprocess, workers as shipped up to 2): killed mid-run, resumed
    with --resume auto, it ends bit-identical to the run that was never stopped."""
    from helpers import assert_killed_run_resumes_exactly
    data = awkward_folder(tmp_path / "data")
    path = ROOT / "configs" / "lipsformer_swin_t.yaml"
    cfg = load_config(path, tiny_model(path) + [f"data_dir={data}", "batch_size=2", "global_batch=2", "epochs=2",
                                                "workers=2", "checkpoint_every_steps=1", "num_classes=2"])
    config = tmp_path / "swin_t.yaml"
    cfg.save(config)
    assert_killed_run_resumes_exactly(config, tmp_path, total_steps=16)


# -- augmentation ops ---------------------------------------------------------------------------------
def _ops_of_shipped_recipes():
    """Every RandAugment / AutoAugment op the shipped recipes can draw, with the recipe's hyper-parameters."""
    ops = {}
    for path in CONFIGS:
        cfg = load_config(path)
        if not cfg.aa:
            continue
        transform = SOAK.training_transforms(cfg)[0]  # as train.py builds it (no model needed but its config)
        ra = next(t for t in transform.transforms if isinstance(t, auto_augment.RandAugment))
        for op in ra.ops:
            ops.setdefault(op.name, op)
    return ops


SHIPPED_OPS = _ops_of_shipped_recipes()


@pytest.mark.parametrize("name", sorted(SHIPPED_OPS))
def test_each_augmentation_op_works_across_its_whole_magnitude_range(name):
    """Magnitudes from 0 to the clip (which ``mstd`` reaches: N(9, 0.5) exceeds 10 for 2.3% of draws) and beyond
    it, on RGB images of the sizes the pipeline sees; where timm's own op works, ours gives the same image."""
    ours = SHIPPED_OPS[name]
    timms = auto_augment.AugmentOp(name, prob=1.0, magnitude=ours.magnitude, hparams=ours.hparams)
    rng = np.random.default_rng(0)
    for size in ((1, 1), (3, 5000), (224, 224)):
        img = Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8))
        for magnitude in [-3.0, *np.linspace(0.0, 10.0, 21), 10.5, 13.0]:
            for op in (ours, timms):
                op.prob, op.magnitude_std, op.magnitude = 1.0, 0.0, float(magnitude)
            random.seed(1)
            out = ours(img)
            assert out.size == img.size and out.mode == "RGB"
            random.seed(1)
            try:
                reference = timms(img)
            except ValueError:  # Pillow >= 13 refuses 0 bits: Pillow < 13 gave a black image, and so do we
                assert "Posterize" in name and not np.asarray(out).any(), (name, magnitude)
                continue
            assert np.array_equal(np.asarray(out), np.asarray(reference)), (name, magnitude)


def test_posterize_keeps_pillows_old_result_at_zero_bits():
    """Pillow < 13 posterized with the mask ~(2 ** (8 - bits) - 1): at 0 or fewer bits every value becomes 0."""
    img = Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16)).convert("RGB")
    for bits in (-4, 0):
        assert not np.asarray(posterize(img, bits)).any()
    for bits in range(1, 9):
        mask = ~(2 ** (8 - bits) - 1) & 0xFF
        assert np.array_equal(np.asarray(posterize(img, bits)), np.asarray(img) & mask)


def test_recipe_transform_with_seeds_that_draw_zero_bits_survives_and_matches_timm():
    """The Table 6 training transform on seeds known to draw a 0-bit posterize (timm's own transform raises on
    Pillow >= 13 there): ours never raises, and equals timm's tensor wherever timm's works."""
    result = soak(ROOT / "configs" / "lipsformer_swin_t.yaml")
    assert result["ours_raised"] == 0
    assert result["compared"] + result["timm_raised"] == 600 and result["mismatched"] == 0
    if auto_augment.posterize is not posterize and _pillow_refuses_zero_bits():
        assert result["timm_raised"] >= 1, "the seeds must reach the 0-bit posterize, or this test proves nothing"


def _pillow_refuses_zero_bits() -> bool:
    from PIL import ImageOps
    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
    except ValueError:
        return True
    return False


# -- a transform that raises stops the run --------------------------------------------------------------
class _FailOnCall:
    """A transform that raises on its ``n``-th call in a process (a loader worker or the main process)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, img):
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("boom")
        return img

    def __repr__(self):
        return f"FailOnCall({self.n})"


def test_transform_error_names_image_transform_and_exception():
    img = Image.new("RGB", (4, 4))
    with pytest.raises(TransformError) as err:
        apply_transform(portable(_FailOnCall(1)), img, "data/train/a/x.png")
    assert err.value.line == "transform failed on data/train/a/x.png: FailOnCall(1) raised ValueError: boom"
    # the DataLoader re-raises a worker's exception as type(e)(its traceback text): the line survives that
    wrapped = TransformError(f"Caught TransformError in DataLoader worker process 0.\nOriginal Traceback "
                             f"(most recent call last):\n  File ...\nlipsformer.data.augment.TransformError: "
                             f"{err.value.line}\n")
    assert wrapped.line == err.value.line


def test_transform_error_names_the_augment_op_and_the_magnitude_it_drew(monkeypatch):
    op = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)

    def pillow13(img, bits, **_):
        raise ValueError("bits must be between or equal to 1 and 8")
    monkeypatch.setattr(op, "aug_fn", pillow13)
    with pytest.raises(TransformError, match=r"on x\.png: AugmentOp\(name=PosterizeIncreasing, p=1.0, m=10, "
                                             r"mstd=0\) at magnitude 10 raised ValueError: bits must be"):
        apply_transform(op, Image.new("RGB", (4, 4)), "x.png")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_transform_that_raises_stops_training_in_one_line_and_keeps_the_checkpoints(tmp_path, workers,
                                                                                       monkeypatch, capfd):
    """A bug in the pipeline is not a bad image: the run stops (exit 3) with one line naming the image, the
    transform and the exception (not a worker's traceback), and the newest checkpoint is the last intact one."""
    import lipsformer.engine.train as engine
    from lipsformer.engine.checkpoint import intact_checkpoint, latest_checkpoint
    from torchvision.transforms import Compose
    real = engine.create_loader_transform

    def failing_on_the_ninth_training_image(model, is_training, *args, **kwargs):
        transform = real(model, is_training, *args, **kwargs)
        return Compose([_FailOnCall(9), transform]) if is_training else transform
    monkeypatch.setattr(engine, "create_loader_transform", failing_on_the_ninth_training_image)
    data = awkward_folder(tmp_path / "data")
    run = tmp_path / "run"
    code = load_script("train.py").main(shrunk(ROOT / "configs" / "lipsformer_swin_t.yaml", data, run,
                                               f"workers={workers}", "global_batch=4", "checkpoint_every_steps=1"))
    err = capfd.readouterr().err
    assert code == 3
    assert "Traceback" not in err
    stopped = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1
    assert re.fullmatch(r"stopped: transform failed on \S+/data/train/class_\d/\w+\.(png|jpg): FailOnCall\(9\) "
                        r"raised ValueError: boom; the newest checkpoint is the last one written before it",
                        stopped[0]), stopped[0]
    # the steps before the failing batch were checkpointed (the loader reads a batch ahead); nothing after them
    assert latest_checkpoint(run) is not None
    model = config_model(load_config(run / "config.yaml"))
    assert intact_checkpoint(run, model) == (latest_checkpoint(run), [])
    assert not (run / "last.safetensors").exists()


def test_set_mixed_precision_no_means_the_word_not_a_yaml_boolean():
    """YAML 1.1 reads ``no`` as False; ``--set mixed_precision=no`` is what users type for full precision."""
    assert load_config(None, ["mixed_precision=no"]).mixed_precision == "no"
    with pytest.raises(ConfigError, match="aa must be of type str"):  # a boolean where no word of the key's is meant
        load_config(None, ["aa=off"])
