"""Checkpoints that survive damage: manifests, --resume auto falling back, one-line errors, disk full."""
import errno
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lipsformer.engine.checkpoint import SaveFailed, intact_checkpoint, latest_checkpoint, verify_checkpoint, \
    write_manifest
from lipsformer.config import load_config
from lipsformer.run_folder import MANIFEST, RunFolder
from lipsformer.weights import CheckpointError

from conftest import config_model, reset_accelerate
from helpers import TINY_RUN, TRAIN, call, write_config


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


class Payload:
    """Pickles to a call that would leave a file behind if it ever ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One epoch, a checkpoint every 2 of its 6 steps: step_2, step_4, step_6 kept."""
    from lipsformer.engine.train import train
    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = load_config(write_config(tmp, ema_decay=0.9), ["epochs=1", "keep_last=3"])
    train(cfg)
    reset_accelerate()
    return cfg


def copy_run(cfg, dest: Path):
    shutil.copytree(cfg.output_dir, dest)
    return load_config(None, [f"{k}={_yaml(v)}" for k, v in dict(cfg.to_dict(), output_dir=str(dest)).items()])


def _yaml(v):
    import yaml
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def model_of(cfg):
    return config_model(cfg)


def test_every_checkpoint_carries_a_manifest_of_its_files(finished_run):
    steps = RunFolder(finished_run.output_dir).finished_checkpoints()
    assert [p.name for p in steps] == ["step_000000002", "step_000000004", "step_000000006"]
    for folder in steps:
        files = {p.name for p in folder.iterdir()} - {MANIFEST}
        import json
        assert set(json.loads((folder / MANIFEST).read_text())["files"]) == files
        verify_checkpoint(folder, model_of(finished_run))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_manifest_names_the_damaged_file(finished_run, tmp_path, damage):
    folder = tmp_path / "step"
    shutil.copytree(latest_checkpoint(finished_run.output_dir), folder)
    target = folder / "optimizer.bin"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match="optimizer.bin"):
        verify_checkpoint(folder, model_of(finished_run))


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint_and_ends_identical(finished_run, tmp_path, caplog):
    from lipsformer.engine.train import train
    cfg = copy_run(finished_run, tmp_path / "run")
    folder = RunFolder(cfg.output_dir)
    expected = load_file(str(folder.weights()))
    newest = folder.finished_checkpoints()[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING):
        summary = train(cfg, resume="auto")
    assert "skipped damaged checkpoint step_000000006" in caplog.text and "model.safetensors" in caplog.text
    assert "falling back to step_000000004" in caplog.text
    assert summary["step"] == 6
    resumed = load_file(str(folder.weights()))  # steps 5 and 6 again: the same weights as the first run
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    assert (folder.checkpoints / ".damaged-step_000000006" / "model.safetensors").stat().st_size == 1000  # kept
    verify_checkpoint(folder.checkpoint(6), model_of(cfg))  # written again, intact


def test_unusable_checkpoints_are_one_line_errors_naming_the_file(finished_run, tmp_path, capsys):
    model = model_of(finished_run)
    # pickled code in a state Accelerate would unpickle in full, with a manifest made to match
    folder = tmp_path / "code"
    shutil.copytree(latest_checkpoint(finished_run.output_dir), folder)
    marker = tmp_path / "code_ran"
    torch.save({"x": Payload(marker)}, folder / "custom_checkpoint_0.pkl")
    write_manifest(folder)
    with pytest.raises(CheckpointError, match=r"refused .*custom_checkpoint_0\.pkl"):
        verify_checkpoint(folder, model)
    assert not marker.exists()
    (folder / MANIFEST).unlink()  # an old checkpoint without a manifest: still read safely, damage still named
    (folder / "custom_checkpoint_0.pkl").write_bytes(b"\x80\x04junk")
    with pytest.raises(CheckpointError, match=r"cannot read .*custom_checkpoint_0\.pkl: truncated or damaged"):
        verify_checkpoint(folder, model)
    # weights of another shape
    other = load_config(None, ["model=lipsformer_swin_t", "num_classes=5", "img_size=32",
                               f"model_kwargs={_yaml(TINY_RUN['model_kwargs'])}"])
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors does not fit .*head\.fc\.weight \(4, 128\) vs \(5, 128\)"):
        verify_checkpoint(latest_checkpoint(finished_run.output_dir), model_of(other))
    # the CLI: one line, no traceback, exit 2
    run = copy_run(finished_run, tmp_path / "run")
    for step in RunFolder(run.output_dir).finished_checkpoints():
        (step / "random_states_0.pkl").write_bytes(b"\x80\x04junk")
    run.save(tmp_path / "cfg.yaml")
    code, _, err = call(capsys, TRAIN.main, ["--config", tmp_path / "cfg.yaml", "--resume", "auto"])
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    assert "error: --resume auto: no intact checkpoint" in err and "random_states_0.pkl" in err
    intact, problems = intact_checkpoint(run.output_dir, model)
    assert intact is None and len(problems) == 3


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_stops(tmp_path, monkeypatch):
    from accelerate import Accelerator
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=1", "ema_decay=null"])
    real_save = Accelerator.save_state
    calls = []

    def save_state(self, output_dir=None, **kwargs):  # the second save fills the disk halfway through
        calls.append(output_dir)
        real_save(self, output_dir, **kwargs)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.bin"))

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    with pytest.raises(SaveFailed, match=r"could not write checkpoint \S*step_000000004: No space left on device.*"
                                         r"step_000000002 is intact"):
        train(cfg)
    folder = RunFolder(cfg.output_dir)
    assert [p.name for p in folder.checkpoints.iterdir()] == ["step_000000002"]  # no partial folder left
    verify_checkpoint(folder.checkpoints / "step_000000002", model_of(cfg))
