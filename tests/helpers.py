"""What several test files share: the tiny training run and its image folder, the commands run as users run them
(``train.py`` in a subprocess, ``torchrun`` on CPU processes, a command's ``main(argv)`` in this process) and the
assertions made on them (a mistake refused in one line with nothing written, a killed run resumed bit for bit).
Test files import from here and from conftest, never from one another."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List
from unittest import mock

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from conftest import ROOT, load_script, reset_accelerate

from lipsformer.engine.checkpoint import latest_checkpoint
from lipsformer.config import load_config
from lipsformer.run_folder import RunFolder

PY = sys.executable
TINY_MODEL = dict(img_size=32, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=2)
TINY_RUN = dict(
    model="lipsformer_swin_t", num_classes=4, img_size=32, crop_pct=1.0, drop_path=0.1,
    model_kwargs={k: v for k, v in TINY_MODEL.items() if k != "img_size"},
    workers=0, epochs=2, global_batch=4, batch_size=4, lr=1e-3, aa=None, reprob=0.0, mixup=0.8, cutmix=1.0,
    ema_decay=0.9, mixed_precision="no", checkpoint_every_steps=2, keep_last=2, log_every_steps=1)


# -- the tiny run: its data, its config, train.py as users run it ---------------------------------------------------
def make_folder(root: Path, train_per_class=(6, 6, 6, 6), val_per_class=(3, 3, 3, 2)) -> Path:
    rng = np.random.default_rng(0)
    for split, counts in (("train", train_per_class), ("val", val_per_class)):
        for c, n in enumerate(counts):
            d = root / split / f"class_{c}"
            d.mkdir(parents=True)
            for i in range(n):
                pixels = (rng.random((16, 16, 3)) * 60 + c * 60 % 196).astype(np.uint8)  # any number of classes
                Image.fromarray(pixels).save(d / f"{i}.jpg")
    return root


def make_wds(folder: Path, root: Path, shards: int = 2) -> Path:
    """The image folder as webdataset shards (``.jpg`` + ``.cls``) with timm's ``_info.json``."""
    import webdataset as wds
    root.mkdir(parents=True)
    classes = sorted(p.name for p in (folder / "train").iterdir())
    splits = {}
    for split in ("train", "val"):
        files = sorted((folder / split).glob("*/*.jpg"))
        names, lengths = [], []
        for k in range(shards):
            part = files[k::shards]
            names.append(f"{split}-{k:04d}.tar")
            lengths.append(len(part))
            with wds.TarWriter(str(root / names[-1])) as sink:
                for f in part:
                    sink.write({"__key__": f"{f.parent.name}_{f.stem}", "jpg": f.read_bytes(),
                                "cls": classes.index(f.parent.name)})
        splits[split] = dict(name=split, num_samples=len(files), filenames=names, shard_lengths=lengths)
    (root / "_info.json").write_text(json.dumps(dict(splits=splits)))
    return root


def write_config(tmp_path: Path, **overrides) -> Path:
    cfg = dict(TINY_RUN, data_dir=str(make_folder(tmp_path / "data")), output_dir=str(tmp_path / "run"))
    cfg.update(overrides)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_train(*args, check=True, **kwargs):
    proc = subprocess.run([PY, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=ROOT, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def read_metrics(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_killed_run_resumes_exactly(config: Path, tmp_path: Path, total_steps: int, timeout: float = 600) -> None:
    """Train ``config`` once uninterrupted, once killed with SIGKILL mid-epoch 2 (after step 8 is on disk) and
    resumed with ``--resume auto``: both end with the same weights and EMA, bit for bit. The first two run side by
    side, one thread each (so that every run sums in the same order)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    said = tmp_path / "reference.txt"
    uninterrupted = subprocess.Popen([PY, str(ROOT / "train.py"), "--config", str(config), "--output-dir",
                                      str(reference)], cwd=ROOT, env=env, stdout=said.open("w"),
                                     stderr=subprocess.STDOUT)
    proc = subprocess.Popen([PY, str(ROOT / "train.py"), "--config", str(config), "--output-dir", str(interrupted)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:  # kill mid-epoch 2, after step 8 is safely on disk
        ckpt = latest_checkpoint(interrupted)
        if ckpt is not None and int(ckpt.name.split("_")[1]) >= 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = int(latest_checkpoint(interrupted).name.split("_")[1])
    assert 8 <= step < total_steps, "the kill must land before the run finishes"
    assert uninterrupted.wait(timeout) == 0, said.read_text()[-3000:]
    run_train("--config", str(config), "--output-dir", str(interrupted), "--resume", "auto", env=env)
    for name in ("last.safetensors", "last_ema.safetensors"):
        a, b = load_file(str(reference / name)), load_file(str(interrupted / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


# -- several processes on this host -------------------------------------------------------------------------------
def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, *args, procs=2, cwd=ROOT, exitcode=0) -> str:
    """Run ``script`` on ``procs`` CPU processes. They must exit with ``exitcode`` (torchrun stops the others once
    one exits with another code than 0); returns what they printed (stdout, then stderr)."""
    launcher = str(Path(PY).with_name("torchrun"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([launcher, "--nnodes", "1", "--nproc_per_node", str(procs), "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), str(script), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    if exitcode == 0:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:  # torchrun names the process that failed first, and its exit code
        assert proc.returncode != 0 and f"exitcode  : {exitcode} " in proc.stderr, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


# -- a command's main(argv) in this process, and a mistake it refuses ---------------------------------------------
SEED = 34  # the mistake generators' seed: the same cases every run
TRAIN, EVAL = load_script("train.py"), load_script("eval.py")
RUN = dict(TINY_RUN, epochs=1, ema_decay=None, mixup=0.0, cutmix=0.0, drop_path=0.0, checkpoint_every_steps=2)


def snapshot(root: Path) -> dict:
    """Every folder, file and link under ``root`` with its size, modification time and permissions: what 'nothing
    written' compares."""
    return {str(p.relative_to(root)): (s.st_size, s.st_mtime_ns, s.st_mode)
            for p in sorted(root.rglob("*")) for s in [p.lstat()]}


def call(capsys, main, argv) -> tuple:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    finally:
        reset_accelerate()
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, main, argv, root: Path, *fragments: str, code: int = 2) -> str:
    """Run ``main(argv)``; assert exit ``code``, one line on stderr holding every fragment, no traceback, and no
    change under ``root``. Returns the line."""
    before = snapshot(root)
    got, _, err = call(capsys, main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == code and len(lines) == 1 and "Traceback" not in err, (argv, got, err)
    for fragment in fragments:
        assert fragment in lines[0], (argv, fragment, lines[0])
    assert snapshot(root) == before, argv
    return lines[0]


def interrupted(capsys, monkeypatch, argv: list, step: int) -> tuple:
    """:func:`call` of train.py ``argv`` with Ctrl-C pressed in optimizer step ``step``."""
    from lipsformer.engine import train as loop
    real, steps = loop._train_step, []

    def interrupted_at_step(run, *args, **kwargs):
        steps.append(1)
        if len(steps) == step:
            raise KeyboardInterrupt
        return real(run, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(loop, "_train_step", interrupted_at_step)
        return call(capsys, TRAIN.main, argv)


# -- shared by the evaluation, certified and tracker tests --------------------------------------------------------
NUM_CLASSES = 12  # of the images write_image draws


def write_image(path: Path, predicted: int) -> None:
    """An image test_eval.py's ``ColourModel`` classifies as ``predicted`` (its red level encodes the class)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), predicted * 20, dtype=np.uint8)).save(path)


CERTIFIED = {"lipsformer_swin_t_cert": "lipsformer_swin_t", "lipsformer_cswin_t_cert": "lipsformer_cswin_t"}


def mlflow_run(tmp: Path, run_id: str) -> dict:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    found = client.get_run(run_id)
    values = {}
    for key in found.data.metrics:
        for m in client.get_metric_history(run_id, key):  # in the order logged: a later value at a step wins
            values[(key, m.step)] = m.value
    return dict(run=found, experiment=client.get_experiment(found.info.experiment_id).name, values=values,
                runs=[r.info.run_id for r in client.search_runs([found.info.experiment_id])])


def start_mlflow(store: Path, output_dir: Path, overrides: List[str]) -> dict:
    """Start the trackers of a config logging to MLflow's file store under ``store`` (as _start does, without a
    model) and read its run back; skipped where mlflow is not installed."""
    pytest.importorskip("mlflow", reason="mlflow is not installed (the dev extra has it)")
    from lipsformer.engine.train import create_accelerator
    from lipsformer.engine.trackers import Trackers
    cfg = load_config(None, ["log_with=mlflow", f"output_dir={output_dir}", *overrides])
    accelerator = create_accelerator(cfg)
    env = dict(MLFLOW_TRACKING_URI=f"file:{store / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true")
    try:
        with mock.patch.dict(os.environ, env):
            Trackers(cfg.log_with).start(accelerator, cfg, RunFolder(cfg.output_dir), resumed=False)
            accelerator.end_training()
    finally:
        reset_accelerate()
    return mlflow_run(store, json.loads(RunFolder(cfg.output_dir).tracker_runs.read_text())["mlflow"]["run_id"])
