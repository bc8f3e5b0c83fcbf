"""The image-folder door: one scanner (lipsformer/data/scanner.py) lists and reads the images of training, its
validation and eval.py. Cases are generated, not listed: every format Pillow writes x every mode that format takes
(each file read, and scored by eval.py), every skipped folder name, every kind of file that is not an image (Pillow's
own write-only and identify-only formats among them), data against the batch for 1 and 2 processes (Accelerate's
own sharding as the reference), an empty class folder, a grey model. Refused cases assert exit code, one line, no
traceback, nothing written (tests/helpers.py's ``refused``); accepted ones assert the counts.
"""
import csv
import io
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import yaml
from PIL import EpsImagePlugin, Image, ImageFile

from conftest import TINY
from helpers import EVAL, RUN, TRAIN, call, make_folder, refused
from lipsformer.data.datasets import DataConfigError, check_batches, create_dataset
from lipsformer.data.imagenet_eval import EvalDataset
from lipsformer.data.scanner import JUNK_FOLDERS, image_extensions, read_image, scan_classes, to_rgb

pytestmark = [pytest.mark.usefixtures("fresh_accelerate"),
              pytest.mark.filterwarnings("ignore:IM image format is deprecated:DeprecationWarning")]

SIZE = 12
MODES = sorted(getattr(Image, "MODES", ["1", "CMYK", "F", "HSV", "I", "I;16", "I;16B", "I;16L", "I;16N", "L", "LA",
                                        "La", "LAB", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "YCbCr"]))
LOSSY = {"JPEG", "MPO", "WEBP", "AVIF"}  # formats whose default encoding changes pixels


# -- images of every mode, with the pixels the scanner's rules must give -----------------------------------------------
def _rgb(seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def in_mode(mode: str, seed: int = 0) -> Image.Image:
    """An image in ``mode`` made from a random RGB one: 16-bit and integer grey as 257 x the 8-bit grey level, float
    grey as level / 255, the alpha modes with transparent, half-transparent and opaque pixels."""
    rgb, grey = _rgb(seed), np.asarray(_rgb(seed).convert("L"))
    alpha = Image.fromarray(np.random.default_rng(seed + 1).choice(np.array([0, 100, 255], np.uint8), (SIZE, SIZE)))
    sixteen = {"I;16": "=u2", "I;16N": "=u2", "I;16L": "<u2", "I;16B": ">u2"}
    if mode in sixteen:
        return Image.frombytes(mode, rgb.size, (grey.astype(np.uint16) * 257).astype(sixteen[mode]).tobytes())
    if mode == "I":
        return Image.fromarray(grey.astype(np.int32) * 257)
    if mode == "F":
        return Image.fromarray(grey.astype(np.float32) / 255)
    if mode in ("RGBA", "RGBa", "LA", "La", "PA"):
        base = {"RGBA": rgb.convert("RGBA"), "RGBa": rgb.convert("RGBA"), "LA": rgb.convert("LA"),
                "La": rgb.convert("LA"), "PA": rgb.convert("P").convert("PA")}[mode]
        base.putalpha(alpha)
        return base.convert(mode) if mode in ("RGBa", "La") else base
    return rgb.convert(mode)


def expected_rgb(img: Image.Image) -> np.ndarray:
    """The RGB pixels of ``img`` under the documented rules, computed here without the scanner."""
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):  # made by in_mode from an 8-bit grey level
        levels = np.asarray(img).astype(np.float64) * (255 if img.mode == "F" else 1 / 257)
        return np.repeat(np.floor(levels + 0.5)[..., None], 3, -1)
    if img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info:
        rgba = np.asarray((img.convert("LA") if img.mode == "La" else img).convert("RGBA")).astype(np.float64)
        a = rgba[..., 3:] / 255
        return rgba[..., :3] * a + 255 * (1 - a)  # composited on white
    return np.asarray(img.convert("RGB")).astype(np.float64)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_read_as_rgb_by_its_rule(mode):
    """convert("RGB") clips 16-bit levels to white and reads [0, 1] floats as black, and drops the alpha."""
    img = in_mode(mode)
    got = to_rgb(img)
    assert got.mode == "RGB" and got.size == img.size
    assert np.abs(np.asarray(got) - expected_rgb(img)).max() <= 1, mode


def test_levels_without_a_known_scale_are_refused_and_counted_not_clipped(tmp_path):
    cases = {"I": np.array([[0, 70000]], np.int32), "F": np.array([[0, 2.0]], np.float32),
             "F_nan": np.array([[0, np.nan]], np.float32)}
    for name, levels in cases.items():
        with pytest.raises(ValueError, match="outside|no known scale"):
            to_rgb(Image.fromarray(levels))
        Image.fromarray(levels).save(tmp_path / f"{name}.tif")
    dataset = EvalDataset([(str(tmp_path / f"{n}.tif"), (0,)) for n in cases], transform=lambda x: x)
    assert [dataset[i][0] for i in range(len(cases))] == [None] * len(cases)  # counted as unreadable, never clipped


def test_the_images_are_every_format_pillow_decodes():
    """Every extension Pillow registers is an image unless its format is one Pillow cannot decode here."""
    Image.init()
    extensions = image_extensions()
    assert {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"} <= extensions
    for ext, fmt in Image.registered_extensions().items():
        factory = Image.OPEN.get("JPEG" if fmt == "MPO" else fmt, (None,))[0]
        stub = isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile)
        decodes = factory is not None and not stub and fmt != "MPEG" and (
            fmt != "EPS" or EpsImagePlugin.has_ghostscript())
        assert (ext in extensions) == decodes, (ext, fmt)
    assert not {".pdf", ".palm", ".mpg", ".h5"} & extensions  # written only, identified only, a stub


# -- every format x mode Pillow writes: each file read, and scored -----------------------------------------------------
def writable():
    """``(format, extension, mode)`` for every mode each format Pillow writes here accepts and reads back, each
    format's extensions taken in turn; and the bytes. (Pillow before 13 writes ICO files of this 12-pixel image and
    YCbCr TIFFs that it cannot open again: no reader built on it reads them.)"""
    Image.init()
    by_format = {}
    for ext, fmt in Image.registered_extensions().items():
        if ext in image_extensions():
            by_format.setdefault(fmt, []).append(ext)
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fmt in sorted(set(by_format) & set(Image.SAVE)):
            k = 0
            for mode in MODES:
                out = io.BytesIO()
                try:
                    in_mode(mode, seed=len(cases)).save(out, fmt)
                    with Image.open(io.BytesIO(out.getvalue())) as back:
                        back.load()
                except (OSError, ValueError, KeyError, TypeError):  # UnidentifiedImageError is an OSError
                    continue
                cases.append((fmt, by_format[fmt][k % len(by_format[fmt])], mode, out.getvalue()))
                k += 1
    return cases


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """A val folder of 4 classes holding every writable format x mode: ``webp`` only WebP files, the others the rest
    in turn, plus an animated GIF and a two-page TIFF (their first frame is read)."""
    root = tmp_path_factory.mktemp("catalogue")
    files = {}
    others = ["a_mixed", "b_mixed", "c_mixed"]
    for i, (fmt, ext, mode, data) in enumerate(writable()):
        name = f"{i:03d}_{fmt}_{mode.replace(';', '')}{ext}"
        path = root / "val" / ("webp" if fmt == "WEBP" else others[i % 3]) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[path] = (fmt, mode, i)  # in_mode(mode, seed=i) made it
    frames = [_rgb(100), _rgb(101)]
    frames[0].save(root / "val" / "a_mixed" / "animated.gif", save_all=True, append_images=frames[1:])
    frames[0].save(root / "val" / "b_mixed" / "pages.tiff", save_all=True, append_images=frames[1:])
    return root, files


def test_every_format_and_mode_pillow_writes_is_listed_and_read_with_its_pixels(catalogue):
    root, files = catalogue
    formats = {fmt for fmt, _, _ in files.values()}
    assert {"PNG", "JPEG", "BMP", "WEBP", "TIFF", "GIF", "PPM"} <= formats, formats
    scan = scan_classes(root / "val")
    frames = [root / "val" / "a_mixed" / "animated.gif", root / "val" / "b_mixed" / "pages.tiff"]
    assert sorted(p for p, _ in scan.samples) == sorted(str(p) for p in [*files, *frames])
    assert scan.not_images == [] and scan.skipped == []
    exact = 0
    for path, (fmt, mode, i) in files.items():
        got = read_image(path)
        assert got.mode == "RGB" and min(got.size) >= 1, path
        with Image.open(path) as stored:
            kept = stored.mode == mode and stored.size == (SIZE, SIZE) and fmt not in LOSSY
        if kept:  # the file holds the mode as written: its pixels follow the rule exactly
            assert np.abs(np.asarray(got) - expected_rgb(in_mode(mode, seed=i))).max() <= 1, path
            exact += 1
    assert exact >= 40, exact
    first = np.asarray(_rgb(100)).astype(int)  # the first frame is read (a GIF's palette approximates it)
    assert np.array_equal(np.asarray(read_image(frames[1])), first)
    assert np.abs(np.asarray(read_image(frames[0])).astype(int) - first).mean() < 20
    # the training reader reads every one of them too
    ds = create_dataset("", str(root), "val", transform=None)
    assert len(ds) == len(scan.samples) and all(ds[i][0] is not None for i in range(len(ds)))


def test_eval_scores_every_file_and_a_class_of_only_webp(catalogue, capsys, tmp_path):
    root, files = catalogue
    from lipsformer.sources import export
    weights = root / "weights"
    if not weights.exists():
        export(timm.create_model("lipsformer_swin_t", num_classes=4, **TINY["swin"]), weights)
    code, out, err = call(capsys, EVAL.main, ["--checkpoint", weights, "--data-dir", root, "--workers", 0,
                                              "--output", tmp_path / "r.json", "--predictions", tmp_path / "p.csv"])
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    n = len(files) + 2
    assert (result["images"], result["count"], result["unreadable"]) == (n, n, 0), result
    webp = sorted(str(p) for p, (fmt, _, _) in files.items() if fmt == "WEBP")
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(webp) >= 10 and sorted(r["path"] for r in rows if r["targets"] == "3") == webp  # webp: the 4th class
    assert all(r["top1"] != "" for r in rows)


# -- what is not an image, and what is not a class ---------------------------------------------------------------------
JUNK = sorted(JUNK_FOLDERS) + [".ipynb_checkpoints", ".git", ".Trash-1000"]


def not_image_names() -> list:
    """Files that are not images: what systems and people leave in folders, a macOS resource fork named like a JPEG,
    and one file of each extension Pillow registers but cannot decode here (write-only, identify-only, stubs)."""
    Image.init()
    undecodable = sorted({ext for ext in Image.registered_extensions() if ext not in image_extensions()})
    return ["README.txt", ".DS_Store", "Thumbs.db", "labels.csv", "desktop.ini", "._0.jpg", "notes",
            *(f"file{ext}" for ext in undecodable)]


def junk_tree(root: Path) -> Path:
    """The tiny 4-class folder with class_3 only .bmp images, val (2 images) smaller than a batch, every junk folder
    (with an image inside) at the top of each split and inside a class, and every non-image file in a class."""
    make_folder(root, train_per_class=(2, 2, 2, 2), val_per_class=(1, 0, 0, 1))
    (root / "val" / "class_1").rmdir()
    (root / "val" / "class_2").rmdir()
    for split in ("train", "val"):
        for jpg in (root / split / "class_3").glob("*.jpg"):
            Image.open(jpg).save(jpg.with_suffix(".bmp"))
            jpg.unlink()
        image = next((root / split / "class_0").glob("*.jpg"))
        for name in JUNK:
            for where in (root / split / name, root / split / "class_0" / name):
                where.mkdir()
                shutil.copy(image, where / "x.jpg")
        for name in not_image_names():
            (root / split / "class_0" / name).write_bytes(b"not an image")
    return root


def test_junk_folders_and_non_image_files_are_left_out_and_said_once(tmp_path, capsys, caplog):
    data = junk_tree(tmp_path / "data")
    scan = scan_classes(data / "train")
    assert scan.classes == ["class_0", "class_1", "class_2", "class_3"] and len(scan.samples) == 8
    assert len(scan.not_images) == len(not_image_names()) and len(scan.skipped) == 2 * len(JUNK)
    assert len(scan.notes) == 2 and "are not images" in scan.notes[0] and "skipped" in scan.notes[1]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(dict(RUN, data_dir=str(data), output_dir=str(tmp_path / "run"))))
    code, out, err = call(capsys, TRAIN.main, ["--config", cfg])
    assert code == 0 and "Traceback" not in err, err
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == scan.classes  # class_3: only .bmp files
    epoch = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "epoch"][0]
    assert (epoch["train_samples"], epoch["val_count"], epoch["val_bad_samples"]) == (8, 2, 0)  # val < a batch
    for split in ("train", "val"):
        assert out.count(f"{data / split}: {len(not_image_names())} file(s) are not images") == 1, out
        assert out.count(f"{data / split}: skipped {2 * len(JUNK)} hidden or system folder(s)") == 1, out
    caplog.clear()
    code, out, err = call(capsys, EVAL.main, ["--checkpoint", tmp_path / "run", "--data-dir", data, "--workers", 0])
    assert code == 0 and "(2 of 2 images scored" in out, (out, err)
    said = [r.getMessage() for r in caplog.records]
    assert sum("are not images" in m for m in said) == 1 and sum("skipped" in m for m in said) == 1, said


# -- refused before anything is written --------------------------------------------------------------------------------
def test_training_data_smaller_than_one_optimizer_update_is_one_line(tmp_path, capsys):
    """Fewer images than one optimizer update takes is one line naming the folder, before anything is written:
    fewer than a batch would stop in timm's scheduler assertion, fewer than a global batch would run one update of
    part of it with its loss still divided by the accumulation steps."""
    for train, batch, global_batch, accumulation in (((1, 1, 1, 1), 8, 8, 1), ((2, 2, 1, 1), 4, 8, 2)):
        data = make_folder(tmp_path / f"data_{sum(train)}", train_per_class=train, val_per_class=(1, 1, 1, 1))
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump(dict(RUN, data_dir=str(data), output_dir=str(tmp_path / "run"))))
        refused(capsys, TRAIN.main, ["--config", cfg, "--set", f"batch_size={batch}", f"global_batch={global_batch}"],
                tmp_path, f"the training data ({data / 'train'}) has {sum(train)} images, fewer than one optimizer "
                f"update takes: {global_batch} (global_batch) = batch_size {batch} x 1 process(es) x {accumulation} "
                f"accumulation step(s)")


@pytest.mark.parametrize("processes", [1, 2])
def test_an_update_per_epoch_is_checked_with_accelerates_own_sharding(processes):
    """Refused exactly when some process would get fewer batches than one update takes, as Accelerate shards them."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler
    for batch in (1, 3, 4):
        for accumulation in (1, 2, 3):
            for images in range(0, 30):
                batches = min(len(BatchSamplerShard(BatchSampler(range(images), batch, drop_last=True), processes, i))
                              for i in range(processes))
                try:
                    check_batches(range(images), batch, processes, accumulation, "train/")
                    ok = True
                except DataConfigError as e:
                    ok = False
                    assert f"{images} images" in str(e) and f"x {processes} process(es)" in str(e)
                assert ok == (batches >= accumulation), (images, batch, processes, accumulation)


def test_a_class_folder_without_an_image_is_refused_in_eval_and_in_validation(tmp_path, capsys):
    make_folder(tmp_path / "data", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    from lipsformer.sources import export
    export(timm.create_model("lipsformer_swin_t", num_classes=4, **TINY["swin"]), tmp_path / "weights")
    for name, holds in (("fish", ""), ("photos", "a.heic")):  # empty; only files no format decodes
        data = tmp_path / f"data_{name}"
        shutil.copytree(tmp_path / "data", data)
        (data / "val" / name).mkdir()
        if holds:
            (data / "val" / name / holds).write_bytes(b"\0" * 100)
        said = f"{data / 'val' / name} holds no images"
        refused(capsys, EVAL.main, ["--checkpoint", tmp_path / "weights", "--data-dir", data, "--workers", 0],
                tmp_path, said, holds)
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump(dict(RUN, data_dir=str(data), output_dir=str(tmp_path / "run"))))
        refused(capsys, TRAIN.main, ["--config", cfg], tmp_path, said, "leave the others' folders out")
        cfg.unlink()


# -- grey models -------------------------------------------------------------------------------------------------------
def test_a_grey_model_trains_and_evaluates_on_rgb_and_grey_images(tmp_path, capsys):
    data = make_folder(tmp_path / "data", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    for path in sorted(data.rglob("*.jpg"))[::2]:
        Image.open(path).convert("L").save(path.with_suffix(".png"))
        path.unlink()
    grey = dict(RUN, data_dir=str(data), output_dir=str(tmp_path / "run"),
                model_kwargs=dict(RUN["model_kwargs"], in_chans=1))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(grey))
    refused(capsys, TRAIN.main, ["--config", cfg], tmp_path, "the model takes 1 input channel(s) but its "
            "normalisation has 3 mean and 3 std values", "set model_kwargs.pretrained_cfg_overlay: {mean: [0.459], "
            "std: [0.226]}")
    refused(capsys, TRAIN.main, ["--config", cfg, "--set", "model_kwargs.in_chans=4"], tmp_path,
            "the model takes 4 input channels", "set model_kwargs.in_chans to 3 or 1")
    code, out, err = call(capsys, TRAIN.main, ["--config", cfg, "--set",
                                               "model_kwargs.pretrained_cfg_overlay={mean: [0.5], std: [0.5]}"])
    assert code == 0, err
    code, out, err = call(capsys, EVAL.main, ["--checkpoint", tmp_path / "run", "--data-dir", data, "--workers", 0,
                                              "--output", tmp_path / "r.json"])
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["input_size"] == [1, 32, 32], err
    assert "(4 of 4 images scored" in out
    # eval.py: a grey model's export whose config keeps ImageNet's 3 means (ours records one: written by hand here)
    from lipsformer.sources import export
    export(timm.create_model("lipsformer_swin_t", in_chans=1, num_classes=4, **TINY["swin"]), tmp_path / "grey")
    hub = json.loads((tmp_path / "grey" / "config.json").read_text())
    assert hub["pretrained_cfg"]["input_size"][0] == 1 and len(hub["pretrained_cfg"]["mean"]) == 1
    hub["pretrained_cfg"].update(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    (tmp_path / "grey" / "config.json").write_text(json.dumps(hub))
    refused(capsys, EVAL.main, ["--checkpoint", tmp_path / "grey", "--data-dir", data, "--workers", 0], tmp_path,
            "the model takes 1 input channel(s)", "pretrained_cfg_overlay: {mean: [0.459]")
