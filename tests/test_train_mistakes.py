"""train.py when the user slips: one clear line and nothing written, or the right numbers after a resume."""
import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import load_script, reset_accelerate
from helpers import read_metrics, write_config

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
    # a missing data folder: refused before config.yaml is written
    (lambda t: ["--data-dir", t / "nope"], ["error: data_dir", "nope: no such folder"]),
    (lambda t: ["--data-dir", t / "data_no_val"], ["error: data_dir", "has no val/ folder"]),
    # fewer classes than the data have: refused before an epoch starts
    (lambda t: ["--set", "num_classes=3"], ["num_classes is 3 but the training data have 4 classes",
                                            "set num_classes: 4"]),
    # --resume at a folder that is neither a checkpoint nor a run
    (lambda t: ["--resume", t / "data"], ["error: --resume", "not a checkpoint folder (RUN/checkpoints/step_N)"]),
    (lambda t: ["--resume", t / "empty_run"], ["error: --resume", "that run folder holds no checkpoint"]),
    # pretrained=local-dir:... points at init_checkpoint
    (lambda t: ["--set", "pretrained=local-dir:checkpoints/x"], ["set init_checkpoint: checkpoints/x"]),
    # options that would do nothing
    (lambda t: ["--set", "num_classes=-5"], ["num_classes must be at least 2"]),
    (lambda t: ["--set", "sched=step"], ["sched step needs decay_epochs"]),
    (lambda t: ["--set", "freeze=backbone", "mixup=0", "cutmix=0"], ["neither pretrained nor init_checkpoint"]),
    (lambda t: ["--set", "model_kwargs.pretrained_cfg_overlay={file: w.safetensors}"],
     ["set init_checkpoint: w.safetensors instead"]),
    # webdataset shards without the _info.json that names their splits
    (lambda t: ["--set", "dataset=wds/x", f"data_dir={t / 'data'}"],
     ["error: dataset wds/x", "no split 'train'", "set train_split", "_info.json"]),
], ids=["no-data", "no-val", "num-classes", "resume-not-checkpoint", "resume-empty-run", "local-dir", "classes<1",
        "step-no-decay", "freeze-random", "overlay-file", "wds-no-info"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, config, args, fragments):
    data = tmp_path / "data"
    shutil.copytree(data, tmp_path / "data_no_val", ignore=lambda d, names: ["val"] if d == str(data) else [])
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    before = snapshot(tmp_path)
    code, _, err = train_cli(capsys, "--config", config, *args(tmp_path))
    assert_one_line(code, err, 2, *fragments)
    assert snapshot(tmp_path) == before  # no run folder, no config.yaml, nothing changed


def test_a_split_the_hf_dataset_lacks_is_one_line_naming_the_key(tmp_path, capsys, config):
    """An imagefolder through Hugging Face datasets calls val/ "validation": the default val_split is named."""
    pytest.importorskip("datasets")
    code, _, err = train_cli(capsys, "--config", config, "--output-dir", tmp_path / "run", "--set",
                             f"dataset=hfds/{tmp_path / 'data'}", f"data_dir={tmp_path / 'hf_cache'}")
    last = err.strip().splitlines()[-1]  # after Hugging Face's progress bars
    assert code == 2 and "Traceback" not in err and last.startswith("error: "), err
    assert "no split 'val'" in last and "'validation'" in last and "set val_split" in last, last
    assert not (tmp_path / "run").exists()


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


def test_resumed_runs_log_one_whole_row_per_epoch(tmp_path, capsys, caplog, monkeypatch, config):
    """A mid-epoch resume and the fallback from a damaged checkpoint leave metrics.jsonl as the
    uninterrupted run wrote it (so does a preemption): one row per step and per epoch, the resumed epoch's figures
    whole. Epochs count from 1 everywhere, and the last line names the best and the last weights for what they are.
    --resume auto into a folder that does not exist says so."""
    run = tmp_path / "run"
    code, out, err = train_cli(capsys, "--config", config, "--resume", "auto")
    assert code == 0, err
    assert f"--resume auto: {run} does not exist; starting a new run there" in caplog.text
    # in a log file (not a terminal) the progress is a plain line every log_every_steps, epochs counted from 1
    lines = [line for line in out.splitlines() if line.startswith("epoch ") and " step " in line]
    assert lines and {line.split()[1] for line in lines} == {"1/2", "2/2"} and "\r" not in out + err
    assert "best top-1" in out and f"({run / 'best.safetensors'})" in out
    assert f"last weights {run / 'last.safetensors'}" in out and f"last checkpoint {run / 'checkpoints'}" in out
    reference = _rows(run)
    epochs = [r for r in reference if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["train_samples"] for r in epochs] == [24, 24]
    assert all(0 < r["val_loss"] < 10 for r in epochs)
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

    # preempted after step 9 (mid-epoch 2, off the checkpoint period): the preemption checkpoint carries the sums
    from lipsformer.engine import train as loop
    from train_probe import probed_step
    monkeypatch.setattr(loop, "_train_step", probed_step(loop._train_step, [], signal_at_step=9))
    code, _, err = train_cli(capsys, "--config", config, "--resume", run / "checkpoints" / "step_000000006")
    assert code == 75 and "step_000000009 is written (epoch 2," in err, err
    monkeypatch.undo()
    code, _, err = train_cli(capsys, "--config", config, "--resume", run / "checkpoints" / "step_000000009")
    assert code == 0, err
    assert _rows(run) == reference


def test_resume_refuses_a_changed_schedule_and_takes_a_run_folder(tmp_path, capsys, config):
    """--resume with another epochs (or lr, ...) would keep the checkpoint's schedule, another num_classes cannot
    continue its model, nor can another model_kwargs: refused, naming the key and the way to train further. --resume
    RUN resumes from that run's newest checkpoint."""
    run = tmp_path / "run"
    assert train_cli(capsys, "--config", config, "--set", "epochs=1")[0] == 0
    before = snapshot(run)
    for change in ("epochs=3", "lr=0.01", "num_classes=3"):  # a schedule the checkpoint keeps; another model
        sets = [change] if change.startswith("epochs=") else ["epochs=1", change]  # a key is set once
        code, _, err = train_cli(capsys, "--config", config, "--resume", "auto", "--set", *sets)
        key, value = change.split("=")
        assert_one_line(code, err, 2, f"--resume: {key} is {yaml.safe_load(value)!r} here but",
                        f"init_checkpoint: {run}")
        assert snapshot(run) == before
    # a model setting changed: its checkpoints do not fit the model built, and the line names the setting, not
    # "no intact checkpoint" as if the files were damaged
    for resume in ("auto", run / "checkpoints" / "step_000000006"):
        code, _, err = train_cli(capsys, "--config", config, "--resume", resume, "--set", "epochs=1",
                                 "model_kwargs.embed_dim=32")
        assert_one_line(code, err, 2, "--resume: model_kwargs.embed_dim is 32 here but 16 in",
                        f"init_checkpoint: {run}")
        assert snapshot(run) == before
    code, out, err = train_cli(capsys, "--config", config, "--set", "epochs=1", "--resume", run)
    assert code == 0, err  # its newest checkpoint, which ends the run: nothing to do, nothing written
    assert f"done already: {run} finished its 1 epochs at step 6 (checkpoint {run / 'checkpoints' / 'step_000000006'}" \
        in out and "init_checkpoint=" in out
    assert snapshot(run) == before


def test_validation_reports_the_mean_cross_entropy_of_the_readable_images():
    """The validation loss behind curves.png's val-loss curve (an unreadable image's stand-in is left out)."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from lipsformer.engine.evaluate import evaluate
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    images, targets = torch.randn(7, 3, 2, 2), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    batches = [(images[:4], targets[:4], []), (images[4:], targets[4:], ["broken.jpg"])]  # the last is a stand-in
    result = evaluate(model, batches, Accelerator(cpu=True))
    with torch.no_grad():
        expected = F.cross_entropy(model(images[:6]), targets[:6]).item()
    assert result["count"] == 6 and result["loss"] == pytest.approx(expected, rel=1e-6)


def test_curves_have_a_title_the_val_loss_and_whole_epoch_ticks():
    """curves.png names the run, draws the val loss beside the training loss (at each evaluated epoch's
    last step), and its epoch axes tick at whole epochs."""
    from lipsformer.engine.metrics import draw_curves
    rows = [dict(kind="init", step=0)]
    rows += [dict(kind="train", step=s, epoch=(s - 1) // 3 + 1, loss=2.0 / s, lr=1e-3) for s in range(1, 10)]
    rows += [dict(kind="epoch", step=3 * e, epoch=e, train_loss=1.0, top1=10.0 * e, val_loss=1.5 / e,
                  ema_top1=9.0 * e, ema_val_loss=1.6 / e, alpha_mean_s0=0.1 * e, alpha_std_s0=0.01) for e in (1, 2, 3)]
    fig = draw_curves(rows, "lipsformer_swin_t: output/run")
    assert fig._suptitle.get_text() == "lipsformer_swin_t: output/run"
    loss, top1, alpha = fig.axes
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert list(lines["val loss"].get_xdata()) == [3, 6, 9]
    assert list(lines["val loss"].get_ydata()) == pytest.approx([1.5, 0.75, 0.5])
    assert list(lines["EMA val loss"].get_ydata()) == pytest.approx([1.6, 0.8, 1.6 / 3])
    fig.canvas.draw()
    for ax in (top1, alpha):
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    import matplotlib.pyplot as plt
    plt.close(fig)
