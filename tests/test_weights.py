"""Weights users can trust: safe loading, sha256, clear errors, convert -> export -> create_model round trips."""
import argparse
import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import timm
import torch
import yaml
from safetensors.torch import save_file

from lipsformer.convert import main as convert_main
from lipsformer.models import lipsformer_cswin, lipsformer_swin
from lipsformer.build import build_model
from lipsformer.weights import CheckpointError, read_checkpoint, sha256_of

from conftest import TINY, family

ROOT = Path(__file__).resolve().parents[1]
RELEASED = {"lipsformer_swin_t": lipsformer_swin, "lipsformer_cswin_t": lipsformer_cswin}
X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def tiny(name="lipsformer_swin_t", **kwargs):
    return timm.create_model(name, **dict(TINY[family(name)], **kwargs)).eval()


def logits(model):
    with torch.no_grad():
        return model.eval()(X)


class _WritesAFile:
    """Unpickling this would run ``exec`` and write ``target``."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return exec, (f"open({self.target!r}, 'w').write('pwned')",)


def test_checkpoint_carrying_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "pwned.txt"
    path = tmp_path / "evil.pth"
    torch.save({"model": tiny().state_dict(), "payload": _WritesAFile(marker)}, path)
    for load in (lambda: read_checkpoint(path),
                 lambda: build_model("lipsformer_swin_t", path, **TINY["swin"]),
                 lambda: tiny(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))):
        with pytest.raises(CheckpointError,
                           match=r"refused to load .*evil\.pth.*builtins\.exec.*nothing in it was run"):
            load()
    assert not marker.exists()


def test_released_checkpoint_with_its_yacs_config_and_args_loads(tmp_path, monkeypatch):
    """The released training code pickles a yacs CfgNode beside the weights; it is read as inert data."""
    yacs, config_module = types.ModuleType("yacs"), types.ModuleType("yacs.config")

    class CfgNode(dict):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.__dict__["__immutable__"] = False

    CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"
    config_module.CfgNode, yacs.config = CfgNode, config_module
    monkeypatch.setitem(sys.modules, "yacs", yacs)
    monkeypatch.setitem(sys.modules, "yacs.config", config_module)
    model = tiny()
    config = CfgNode(MODEL=CfgNode(NAME="lipsformer_swin_tiny"))
    path = tmp_path / "lipsformer-swin-tiny.pth"
    torch.save({"model": lipsformer_swin.released_state_dict(model), "config": config, "epoch": 299,
                "args": argparse.Namespace(lr=1e-3), "max_accuracy": 82.7}, path)
    monkeypatch.delitem(sys.modules, "yacs")  # the user has no yacs installed
    monkeypatch.delitem(sys.modules, "yacs.config")
    loaded = tiny(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert torch.equal(logits(loaded), logits(model))


def test_truncated_files_name_the_file(tmp_path):
    model = tiny()
    pth, st = tmp_path / "w.pth", tmp_path / "w.safetensors"
    torch.save(model.state_dict(), pth)
    save_file(model.state_dict(), str(st))
    for path in (pth, st):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        with pytest.raises(CheckpointError, match=rf"cannot read .*{path.name}: truncated or not a checkpoint"):
            read_checkpoint(path)


def test_checkpoint_of_another_model_names_file_and_keys(tmp_path):
    path = tmp_path / "cswin.safetensors"
    save_file(tiny("lipsformer_cswin_t").state_dict(), str(path))
    with pytest.raises(CheckpointError, match=r"cswin\.safetensors does not fit lipsformer_swin_t: missing keys"):
        build_model("lipsformer_swin_t", path, **TINY["swin"])
    wide = tmp_path / "wide.safetensors"
    save_file(tiny(embed_dim=24).state_dict(), str(wide))
    with pytest.raises(CheckpointError,
                       match=r"wide\.safetensors does not fit .*shape mismatches \(\d+\): "
                             r"patch_embed\.proj\.weight: file \(24, 3, 4, 4\) vs model \(16, 3, 4, 4\)"):
        tiny(pretrained=True, pretrained_cfg_overlay=dict(file=str(wide)))


def test_sha256_is_checked_after_download(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    model = tiny()
    path = tmp_path / "published" / "weights.safetensors"
    path.parent.mkdir()
    save_file(model.state_dict(), str(path))
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    url = path.as_uri()  # file:// goes through the same download and cache as https://
    cached = tmp_path / "torch_home" / "hub" / "checkpoints" / "weights.safetensors"
    with pytest.raises(CheckpointError, match=rf"has sha256 {good}, expected {'0' * 64}.*cached copy was removed"):
        tiny(pretrained=True, pretrained_cfg_overlay=dict(url=url, sha256="0" * 64))
    assert not cached.exists()
    loaded = tiny(pretrained=True, pretrained_cfg_overlay=dict(url=url, sha256=good))
    assert cached.exists()
    assert torch.equal(logits(loaded), logits(model))


def test_published_tag_carries_the_release_url():
    cfg = timm.models.get_pretrained_cfg("lipsformer_swin_t.official_in1k")
    assert cfg.url.endswith("/lipsformer-swin-tiny.pth") and cfg.custom_load
    assert (cfg.crop_pct, cfg.interpolation, cfg.num_classes) == (0.9, "bicubic", 1000)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_convert_released_then_create_model_gives_identical_logits(tmp_path, name):
    model = tiny(name, num_classes=1000)
    source = tmp_path / "released.pth"
    torch.save({"model": RELEASED[name].released_state_dict(model), "epoch": 3}, source)
    out = tmp_path / "checkpoints" / f"{name}.official"
    args = ["--model", name, "--model-args", json.dumps(TINY[family(name)])]
    assert convert_main([str(source), *args, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    expected = logits(model)
    via_file = tiny(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(out / "model.safetensors")))
    assert torch.equal(logits(via_file), expected)
    via_folder = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert torch.equal(logits(via_folder), expected)
    assert via_folder.pretrained_cfg["input_size"] == (3, 32, 32)
    assert convert_main([str(source), *args, "--out", str(out)]) == 2  # never overwrites


def _fake_run(tmp_path) -> tuple:
    """A train.py output folder: config.yaml, last.safetensors, last_ema.safetensors."""
    run = tmp_path / "run"
    run.mkdir()
    kwargs = dict(embed_dim=16, depths=[1, 1, 2, 1], num_heads=[2, 2, 4, 8], split_size=[1, 2, 2, 2])
    (run / "config.yaml").write_text(yaml.safe_dump(dict(
        model="lipsformer_cswin_t", model_kwargs=kwargs, num_classes=5, img_size=32, crop_pct=1.0,
        interpolation="bilinear", ema_decay=0.999)))  # the keys that say what the weights are
    model, ema = (timm.create_model("lipsformer_cswin_t", num_classes=5, img_size=32, **kwargs) for _ in range(2))
    save_file(model.state_dict(), str(run / "last.safetensors"))
    save_file(ema.state_dict(), str(run / "last_ema.safetensors"))
    return run, model, ema


def test_training_run_converts_with_its_config_and_ema(tmp_path):
    run, model, ema = _fake_run(tmp_path)
    out = tmp_path / "exported"
    assert convert_main([str(run), "--use-ema", "--out", str(out)]) == 0
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert torch.equal(logits(loaded), logits(ema))
    assert (loaded.pretrained_cfg["crop_pct"], loaded.pretrained_cfg["interpolation"]) == (1.0, "bilinear")
    assert torch.equal(logits(build_model(None, run).model), logits(model))
    with pytest.raises(CheckpointError, match="made by lipsformer_cswin_t, not lipsformer_swin_t"):
        build_model("lipsformer_swin_t", run)


def test_use_ema_picks_the_ema_of_a_timm_style_checkpoint(tmp_path):
    model, ema = tiny(), tiny()
    path = tmp_path / "timm.pth"
    torch.save({"state_dict": model.state_dict(), "state_dict_ema": ema.state_dict(), "epoch": 1}, path)
    assert torch.equal(logits(build_model("lipsformer_swin_t", path, use_ema=True, **TINY["swin"]).model),
                       logits(ema))
    torch.save({"state_dict": model.state_dict()}, path)
    with pytest.raises(CheckpointError, match=r"timm\.pth: no EMA weights"):
        build_model("lipsformer_swin_t", path, use_ema=True, **TINY["swin"])


# -- convert names its folder by a tag, records what it read, and its hint loads the weights ----------
def test_convert_tag_is_a_name_not_a_path(tmp_path, monkeypatch, capsys):
    # --tag ../../../evil wrote outside checkpoints/
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "w.safetensors"
    save_file(tiny().state_dict(), str(source))
    for tag in ("../../../evil", "a/b", "", ".."):
        before = sorted(tmp_path.parent.rglob("*"))
        code = convert_main([str(source), "--model", "lipsformer_swin_t", "--model-args", json.dumps(TINY["swin"]),
                             "--tag", tag])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "--tag must be a name" in err, err
        assert sorted(tmp_path.parent.rglob("*")) == before


def test_convert_hint_loads_the_converted_weights_and_config_says_what_they_are(tmp_path, monkeypatch, capsys):
    # the printed local-dir: hint loads the weights (pretrained=True), and config.json names the tag given, the
    # pool size and the source's sha256, for a run folder too
    monkeypatch.chdir(tmp_path)
    run, model, _ = _fake_run(tmp_path)
    assert convert_main([str(run), "--tag", "digits"]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("load it with"))
    assert hint.startswith("load it with timm.create_model(")
    loaded = eval(hint[len("load it with "):], {"timm": timm})
    assert torch.equal(logits(loaded), logits(model))
    cfg = json.loads((tmp_path / "checkpoints" / "lipsformer_cswin_t.digits" / "config.json").read_text())
    assert cfg["pretrained_cfg"]["tag"] == "digits"
    assert cfg["pretrained_cfg"]["pool_size"] == [1, 1]  # 32 px / 4 (patch) / 2 ** 3 (three downsamplings)
    assert cfg["source"] == str(run) and cfg["source_sha256"] == sha256_of(run / "last.safetensors")


def test_converted_folders_are_git_ignored():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    assert ignored("checkpoints/lipsformer_swin_t.official_in1k/model.safetensors")
    assert ignored("checkpoints/lipsformer_swin_t.official_in1k/config.json")
    assert not ignored("checkpoints/README.md")


def test_convert_model_args_must_be_an_object(tmp_path, capsys):
    before = sorted(tmp_path.rglob("*"))
    assert convert_main([str(tmp_path / "w.safetensors"), "--model-args", "[32]", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model-args must be a JSON object of model arguments" in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_attlip_weights_of_the_other_form_are_refused_in_one_line_and_old_runs_load_as_they_were(tmp_path):
    """The certifiable models' AttLip is the orthogonal form by default: its weights are named rotation and scale,
    the general form's weight. A file of one form is refused by a model of the other in one line naming the change
    and the fix; lipsformer.build.build_model (eval.py, fine-tuning) builds the form the file holds when not told."""
    from lipsformer.engine.checkpoint import check_loadable
    small = dict(img_size=32, embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), window_size=4,
                 num_classes=5)
    torch.manual_seed(0)
    old = timm.create_model("lipsformer_swin_t_cert", attlip_form="general", **small).eval()
    path = tmp_path / "old.safetensors"
    save_file(old.state_dict(), str(path))
    with pytest.raises(CheckpointError) as info:
        timm.create_model("lipsformer_swin_t_cert", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          **small)
    message = str(info.value)
    assert "attlip_form 'general'" in message and "attlip_form='general'" in message and "\n" not in message
    loaded, _ = build_model("lipsformer_swin_t_cert", path, **small)
    assert {m.form for m in loaded.modules() if hasattr(m, "form")} == {"general"}
    assert torch.equal(logits(loaded), logits(old))
    folder = tmp_path / "step"
    folder.mkdir()
    save_file(old.state_dict(), str(folder / "model.safetensors"))  # a periodic checkpoint of a run to resume
    with pytest.raises(CheckpointError, match=r"does not fit this run's model: its AttLip blocks are attlip_form "
                                              r"'general'.*'orthogonal'"):
        check_loadable(folder, timm.create_model("lipsformer_swin_t_cert", **small))


def test_a_folder_given_as_a_weight_file_names_the_file_to_give(tmp_path):
    """pretrained_cfg_overlay=dict(file=RUN) (a folder, not a file) says which file inside to name."""
    with pytest.raises(FileNotFoundError, match="is a folder, not a weight file.*best.safetensors"):
        read_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a folder, not a weight file"):
        timm.create_model("lipsformer_swin_t", pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path)),
                          **TINY["swin"])
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        read_checkpoint(tmp_path / "nope.pth")
