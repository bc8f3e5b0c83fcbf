"""train.py when the user slips (issue 25): one clear line and nothing written, or the right numbers after a resume."""
import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import load_script, reset_accelerate
from test_train import make_folder, read_metrics, write_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

TRAIN = load_script("train.py")


def train_cli(capsys, *args):
    """train.py's main in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = TRAIN.main([str(a) for a in args])
    finally:
        reset_accelerate()
    out = capsys.readouterr()
    return code, out.out, out.err


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its sha256 (empty when the folder does not exist)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def assert_one_line(code: int, err: str, expected_code: int, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path, epochs=2, checkpoint_every_steps=2, keep_last=6, ema_decay=None)


@pytest.mark.parametrize("args, fragments", [
    # item 11: a missing data folder (was an AssertionError after config.yaml was written)
    (lambda t: ["--data-dir", t / "nope"], ["config error: data_dir", "nope: no such folder"]),
    (lambda t: ["--data-dir", t / "data_no_val"], ["config error: data_dir", "has no val/ folder"]),
    # item 11: fewer classes than the data have (was an index error mid-epoch, files left behind)
    (lambda t: ["--set", "num_classes=3"], ["num_classes is 3 but the training data have 4 classes",
                                            "set num_classes: 4"]),
    # item 11: --resume at a folder that is neither a checkpoint nor a run (was a misleading load_state message)
    (lambda t: ["--resume", t / "data"], ["error: --resume", "not a checkpoint folder (RUN/checkpoints/step_N)"]),
    (lambda t: ["--resume", t / "empty_run"], ["error: --resume", "that run folder holds no checkpoint"]),
    # item 11: pretrained=local-dir:... (was 'names weights of local-dir:...')
    (lambda t: ["--set", "pretrained=local-dir:checkpoints/x"], ["set init_checkpoint: checkpoints/x"]),
    # item 7: options that would do nothing
    (lambda t: ["--set", "num_classes=-5"], ["num_classes must be at least 1"]),
    (lambda t: ["--set", "sched=step"], ["sched step needs decay_epochs"]),
    (lambda t: ["--set", "freeze=backbone", "mixup=0", "cutmix=0"], ["neither pretrained nor init_checkpoint"]),
    (lambda t: ["--set", "model_kwargs.pretrained_cfg_overlay={file: w.safetensors}"],
     ["set init_checkpoint: w.safetensors instead"]),
], ids=["no-data", "no-val", "num-classes", "resume-not-checkpoint", "resume-empty-run", "local-dir", "classes<1",
        "step-no-decay", "freeze-random", "overlay-file"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, config, args, fragments):
    data = tmp_path / "data"
    shutil.copytree(data, tmp_path / "data_no_val", ignore=lambda d, names: ["val"] if d == str(data) else [])
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    before = snapshot(tmp_path)
    code, _, err = train_cli(capsys, "--config", config, *args(tmp_path))
    assert_one_line(code, err, 2, *fragments)
    assert snapshot(tmp_path) == before  # no run folder, no config.yaml, nothing changed


def test_published_weights_offline_are_one_line_exit_1(tmp_path, capsys, config, monkeypatch):
    """No network: timm's download raises URLError; the run says so in one line and writes nothing."""
    import urllib.error
    import torch.hub

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torch.hub, "urlopen", offline)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # an empty cache: a download is needed
    before = snapshot(tmp_path)
    code, _, err = train_cli(capsys, "--config", config, "--set", "pretrained=lipsformer_swin_t.official_in1k",
                             "num_classes=4")
    assert_one_line(code, err, 1, "error: pretrained lipsformer_swin_t.official_in1k: could not download",
                    "Temporary failure in name resolution", "init_checkpoint")
    assert snapshot(tmp_path) == before


def _rows(run: Path) -> list:
    """metrics.jsonl without the wall-clock figures."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "img_per_s")} for r in read_metrics(run)]


def test_resumed_runs_log_one_whole_row_per_epoch(tmp_path, capsys, caplog, config):
    """Item 3: a mid-epoch resume and the fallback from a damaged checkpoint leave metrics.jsonl as the
    uninterrupted run wrote it: one row per step and per epoch, the resumed epoch's figures whole. Item 8: epochs
    count from 1 everywhere, and the last line names the best and the last weights for what they are.
    Item 7: --resume auto into a folder that does not exist says so."""
    run = tmp_path / "run"
    code, out, err = train_cli(capsys, "--config", config, "--resume", "auto")
    assert code == 0, err
    assert f"--resume auto: {run} does not exist; starting a new run there" in caplog.text
    assert "epoch 1/2" in err and "epoch 2/2" in err and "epoch 0" not in err  # the progress bars
    assert f"best top-1" in out and f"({run / 'best.safetensors'})" in out
    assert f"last weights {run / 'last.safetensors'}" in out and f"last checkpoint {run / 'checkpoints'}" in out
    reference = _rows(run)
    epochs = [r for r in reference if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["train_samples"] for r in epochs] == [24, 24]
    assert [(r["step"], r["epoch"]) for r in reference if r["kind"] == "train"] == \
        [(s, 1) for s in range(1, 7)] + [(s, 2) for s in range(7, 13)]  # the same numbers as the epoch rows

    # resume mid-epoch 2 (2 of its 6 batches done) from an explicit checkpoint
    code, out, err = train_cli(capsys, "--config", config, "--resume", run / "checkpoints" / "step_000000008")
    assert code == 0, err
    assert "resumed from" in out and "(step 8: epoch 2, 2 of its batches done)" in out
    assert _rows(run) == reference

    # the newest checkpoint damaged: --resume auto falls back to step 10 (4 of 6 batches of epoch 2)
    weights = run / "checkpoints" / "step_000000012" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, out, err = train_cli(capsys, "--config", config, "--resume", "auto")
    assert code == 0, err
    assert "skipped damaged checkpoint step_000000012" in caplog.text
    assert _rows(run) == reference


def test_resume_refuses_a_changed_schedule_and_takes_a_run_folder(tmp_path, capsys, config):
    """Item 4: --resume with another epochs (or lr, ...) would keep the checkpoint's schedule: refused, naming the
    key and the way to train further. Item 11: --resume RUN resumes from that run's newest checkpoint."""
    run = tmp_path / "run"
    assert train_cli(capsys, "--config", config, "--set", "epochs=1")[0] == 0
    before = snapshot(run)
    for change in ("epochs=3", "lr=0.01"):
        code, _, err = train_cli(capsys, "--config", config, "--resume", "auto", "--set", "epochs=1", change)
        key, value = change.split("=")
        assert_one_line(code, err, 2, f"--resume: {key} is {yaml.safe_load(value)!r} here but",
                        f"init_checkpoint: {run}")
        assert snapshot(run) == before
    code, out, err = train_cli(capsys, "--config", config, "--set", "epochs=1", "--resume", run)
    assert code == 0, err
    assert f"resumed from {run / 'checkpoints' / 'step_000000006'}" in out
