"""train.py on a cluster: preemption signals, resuming on another number of processes (DDP and FSDP2),
and examples/slurm/ run on one host as two "nodes"."""
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import config_model, load_script, reset_accelerate
from helpers import ROOT, make_folder, read_metrics, torchrun, write_config
from train_probe import probed_step

from lipsformer.engine.checkpoint import latest_checkpoint, verify_checkpoint
from lipsformer.config import load_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate")
PROBE = ROOT / "tests" / "train_probe.py"


def same_weights(a: Path, b: Path, exact: bool = True) -> bool:
    """``last.safetensors`` and ``last_ema.safetensors`` of two runs: equal bit for bit, or to rounding."""
    for name in ("last.safetensors", "last_ema.safetensors"):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys()
        if not all(torch.equal(x[k], y[k]) if exact else torch.allclose(x[k], y[k], rtol=1e-5, atol=1e-6)
                   for k in x):
            return False
    return True


def test_preemption_signal_checkpoints_the_step_it_arrives_in_and_resumes_bit_identical(tmp_path, monkeypatch,
                                                                                         capsys):
    """SIGUSR1 arrives in the first of step 2's two accumulated batches: the step is finished, checkpointed (a
    SIGTERM arriving during that write changes nothing) and the run stops; --resume auto starts at step 3 and
    ends bit-identical to the run nobody interrupted."""
    from accelerate import Accelerator
    from lipsformer.engine import train as loop
    config = write_config(tmp_path, epochs=1, global_batch=8, checkpoint_every_steps=100)
    main = load_script("train.py").main
    reference = tmp_path / "reference"
    assert main(["--config", str(config), "--output-dir", str(reference)]) == 0
    reset_accelerate()

    run = tmp_path / "run"
    records = []
    monkeypatch.setattr(loop, "_train_step", probed_step(loop._train_step, records, signal_at_step=2))
    real_save = Accelerator.save_state
    writes = []

    def save_state(self, output_dir=None, **kwargs):  # a second signal in the middle of the write
        writes.append(output_dir)
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_state)
    assert main(["--config", str(config), "--output-dir", str(run)]) == 75
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if "preempted" in line] == [
        f"preempted: SIGUSR1 received: every process finished step 2 and checkpoint {run}/checkpoints/"
        f"step_000000002 is written (epoch 1, 16 of its samples used); continue with --resume auto (exit code 75: "
        f"requeue)"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are given back
    assert [r["step"] for r in records] == [1, 1, 2, 2]  # step 2 finished, nothing after it
    assert [Path(w).name for w in writes] == [".tmp-step_000000002"]
    checkpoint = latest_checkpoint(run)
    assert checkpoint.name == "step_000000002"
    verify_checkpoint(checkpoint, config_model(load_config(config)))  # intact, manifest and all
    assert max(r["step"] for r in read_metrics(run) if r["kind"] == "train") == 2

    reset_accelerate()
    monkeypatch.setattr(Accelerator, "save_state", real_save)
    records.clear()
    assert main(["--config", str(config), "--output-dir", str(run), "--resume", "auto"]) == 0
    assert records[0]["step"] == 3  # no step lost, none repeated
    assert same_weights(reference, run)

    reset_accelerate()  # the number of processes may change on resume, the global batch may not
    capsys.readouterr()
    assert main(["--config", str(config), "--output-dir", str(run), "--resume", "auto", "--set", "global_batch=4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: global_batch 4 differs from the checkpoint's 8: ")


@pytest.mark.parametrize("first, second, code", [("USR1", "TERM", 75), ("INT", "INT", 130)])
def test_a_second_stop_signal_during_the_shutdown_keeps_the_promised_exit_code(tmp_path, first, second, code):
    """train.py as the program, stopped by a preemption signal (exit 75) or Ctrl-C (130), then sent a second
    SIGTERM or SIGINT after its line said how it ended, while it shuts down: the exit code stays the one said (not
    143 for SIGTERM's default, nor a traceback for Ctrl-C). Every stop signal is held by one call
    (lipsformer.errors.hold_stop_signals): each first and each second signal appears once here."""
    config = write_config(tmp_path, epochs=1, checkpoint_every_steps=100)
    proc = subprocess.run([sys.executable, str(PROBE), "--signal-at-step", "2", "--signal", first,
                           "--signal-in-shutdown", second, "--", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == code and "Traceback" not in said, (proc.returncode, said[-2000:])
    assert ("preempted: SIGUSR1 received" if code == 75 else "interrupted: training stopped at step") in said


def test_a_kill_during_the_preemption_checkpoint_leaves_the_previous_one_the_newest_intact(tmp_path):
    """SIGUSR1 in step 2, then SIGKILL while step 2's checkpoint is being written (a grace time too short): the
    half-written folder is never taken for a checkpoint, step 1's stays the newest intact one, and --resume auto
    goes on from it, writing step 2 again."""
    import sys
    from lipsformer.engine import train as loop
    config = write_config(tmp_path, epochs=1, global_batch=8, checkpoint_every_steps=1)
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(PROBE), "--signal-at-step", "2", "--kill-in-save", "2", "--",
                           "--config", str(config), "--output-dir", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (run / "checkpoints" / ".tmp-step_000000002").is_dir()
    assert latest_checkpoint(run).name == "step_000000001"
    verify_checkpoint(latest_checkpoint(run), config_model(load_config(config)))
    summary = loop.train(load_config(config, [f"output_dir={run}"]), resume="auto")
    assert summary["step"] == 3
    verify_checkpoint(run / "checkpoints" / "step_000000002", config_model(load_config(config)))


# -- another number of processes ----------------------------------------------------------------------
# One image per class, so a batch's targets say which samples it holds; 24 images, batch 4, global batch 8:
# 2 processes x 1 or 1 process x 2 accumulated batches, 3 optimizer steps an epoch. No mixup and no drop path,
# so runs on different numbers of processes differ by rounding only; and SGD, since Adam's update of a weight
# whose gradient is near 0 is +-lr whichever way rounding tips it (AdamW ended 4e-4 apart, lr 1e-3).
WORLD = dict(num_classes=24, epochs=2, global_batch=8, batch_size=4, mixup=0.0, cutmix=0.0, drop_path=0.0,
             opt="sgd", lr=0.05, checkpoint_every_steps=1, keep_last=6)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The uninterrupted run on 2 processes (DDP), with what each process trained on at every step."""
    tmp = tmp_path_factory.mktemp("two")
    ids = make_folder(tmp / "ids", train_per_class=(1,) * 24, val_per_class=(1,) * 24)
    config = write_config(tmp, data_dir=str(ids), **WORLD)
    (tmp / "records").mkdir()
    torchrun(PROBE, "--record", tmp / "records", "--", "--config", config)
    return config, tmp / "run", recorded(tmp / "records")


def recorded(folder: Path) -> list:
    return [r for f in sorted(folder.glob("*.json")) for r in json.loads(f.read_text())]


def assert_epoch_covered_once(records: list, epoch: int, steps: range, global_batch: int = 8) -> None:
    """Each sample of ``epoch`` trained on exactly once, ``global_batch`` of them at each optimizer step."""
    mine = [r for r in records if r["epoch"] == epoch]
    assert sorted(t for r in mine for t in r["targets"]) == list(range(24))
    assert {s: sum(len(r["targets"]) for r in mine if r["step"] == s) for s in steps} == \
        {s: global_batch for s in steps}


def lrs(run: Path) -> dict:
    return {r["step"]: r["lr"] for r in read_metrics(run) if r["kind"] == "train"}


NOTICE = "no longer bit-exact: gradients are summed in another order"


@pytest.mark.slow
def test_ddp_run_resumes_on_one_process_and_back_on_two(two_processes, tmp_path, capsys):
    """2 -> 1 -> 2 processes, mid-epoch each time: the global batch, the schedule and the epoch's samples carry
    over, each resume says it is no longer bit-exact, and the weights and the epoch's training loss (every
    process's batches, the ones before the resume included) end as the uninterrupted run's to rounding."""
    config, reference, before = two_processes
    run = tmp_path / "run"
    main = load_script("train.py").main
    records = []
    from lipsformer.engine import train as loop
    loop_step = loop._train_step
    loop._train_step = probed_step(loop_step, records, signal_at_step=5)
    try:  # 2 -> 1: the reference's checkpoint after step 4 (mid-epoch 1), preempted after step 5
        assert main(["--config", str(config), "--output-dir", str(run), "--resume",
                     str(reference / "checkpoints" / "step_000000004")]) == 75
    finally:
        loop._train_step = loop_step
    said = capsys.readouterr().out
    assert said.count(NOTICE) == 1 and "resumed on 1 process(es) x batch 4 from a checkpoint written on 2 x batch 4: " \
        "global batch 8 kept (2 accumulation step(s)), schedule at step 4, epoch 2 continues after its first 8 " \
        "samples" in said
    reset_accelerate()
    (tmp_path / "records").mkdir()
    said = torchrun(PROBE, "--record", tmp_path / "records", "--", "--config", config, "--output-dir", run,
                    "--resume", "auto")  # 1 -> 2
    assert said.count(NOTICE) == 1 and "on 2 process(es) x batch 4 from a checkpoint written on 1 x batch 4" in said
    after = recorded(tmp_path / "records")
    assert [r["step"] for r in records] == [5, 5] and {r["step"] for r in after} == {6}
    assert_epoch_covered_once([r for r in before if r["step"] <= 4] + records + after, epoch=1, steps=range(4, 7))
    assert lrs(run) == {s: lr for s, lr in lrs(reference).items() if s >= 5}  # the schedule's own steps
    assert same_weights(reference, run, exact=False)
    epoch_2 = [[r["train_loss"] for r in read_metrics(d) if r["kind"] == "epoch" and r["epoch"] == 2]
               for d in (reference, run)]
    assert epoch_2[1] == [pytest.approx(epoch_2[0][0], rel=1e-5)], epoch_2


def test_the_resume_notice_names_what_cannot_carry_over():
    """Written on 1 process with 28 images (7 batches of 4, 4 steps an epoch, the last with one batch), resumed
    on 2 (3 rounds of 2 batches: 3 steps) with streamed data: the place moves, and the line names the random
    states, the samples and the steps an epoch takes, which do not carry over."""
    from types import SimpleNamespace
    from torch.utils.data import IterableDataset
    from lipsformer.engine.checkpoint import TrainState
    from lipsformer.engine.resume import move_position as _move_position
    cfg = load_config(None, ["global_batch=8", "batch_size=4"])
    state = TrainState(processes=1, batch_size=4, global_batch=8, updates_per_epoch=4)
    state.epoch, state.step, state.batch_in_epoch = 1, 6, 4  # 2 steps into epoch 1
    accelerator = SimpleNamespace(num_processes=2, gradient_accumulation_steps=1, step=4)
    loader = SimpleNamespace(dataset=type("Streamed", (IterableDataset,), {"__iter__": lambda self: iter(())})())
    line = _move_position(state, cfg, accelerator, loader, updates_per_epoch=3)
    assert (state.batch_in_epoch, state.processes, accelerator.step) == (2, 2, 2)
    assert "epoch 2 continues after its first 16 samples (streamed data shard by process: which samples" in line
    assert "(an epoch now takes 3 optimizer steps, not 4: " in line and NOTICE in line
    assert line.endswith("(processes 1.. had none saved)")
    assert _move_position(state, cfg, accelerator, loader, updates_per_epoch=3) is None  # nothing changed


@pytest.mark.slow
def test_fsdp2_sharded_checkpoints_reshard_from_two_processes_to_one_and_back(two_processes, tmp_path):
    """The loop under Accelerate's FSDP2 (forced on CPU, see tests/train_probe.py) on 2 processes, preempted in
    epoch 1; resumed on 1 (its sharded checkpoint resharded), preempted again; resumed on 2 to the end: every sample
    of the epoch once, and the uninterrupted DDP run's losses, accuracies, weights and EMA."""
    config, reference, _ = two_processes
    run = tmp_path / "run"
    args = ["--config", config, "--output-dir", run]
    (tmp_path / "records").mkdir()
    record = ["--fsdp", "--record", tmp_path / "records"]
    torchrun(PROBE, *record, "--signal-at-step", 4, "--", *args, exitcode=75)
    assert latest_checkpoint(run).name == "step_000000004"
    assert (latest_checkpoint(run) / "pytorch_model_fsdp_0").is_dir()  # sharded
    said = torchrun(PROBE, *record, "--signal-at-step", 5, "--", *args, "--resume", "auto", procs=1, exitcode=75)
    assert said.count(NOTICE) == 1 and "preempted: SIGUSR1" in said
    assert latest_checkpoint(run).name == "step_000000005"
    said = torchrun(PROBE, *record, "--", *args, "--resume", "auto")
    assert said.count(NOTICE) == 1
    records = recorded(tmp_path / "records")
    assert_epoch_covered_once(records, epoch=0, steps=range(1, 4))
    assert_epoch_covered_once(records, epoch=1, steps=range(4, 7))
    assert lrs(run) == lrs(reference)
    rows = [[r for r in read_metrics(d) if r["kind"] == "epoch"] for d in (reference, run)]
    assert [r["epoch"] for r in rows[1]] == [1, 2]
    for a, b in zip(*rows):  # the training loss is the mean over every process's batches, carried over a resume
        for key in ("top1", "ema_top1", "val_count", "train_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["epoch"], key)
    assert same_weights(reference, run, exact=False)


# -- examples/slurm/ ----------------------------------------------------------------------------------
SLURM = ROOT / "examples" / "slurm"


def fake_slurm(tmp_path: Path, nodes: int = 2, **env) -> dict:
    """The environment of a SLURM batch job on ``nodes`` "nodes" of this host, one process each, with
    tests/fake_slurm.py as srun and scontrol."""
    import sys
    from helpers import free_port
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for tool in ("srun", "scontrol"):
        (bin_ / tool).write_text(f'#!/bin/bash\nexec {sys.executable} {ROOT / "tests" / "fake_slurm.py"} {tool} "$@"\n')
        (bin_ / tool).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_}:{Path(sys.executable).parent}:{os.environ['PATH']}", SLURM_JOB_ID="42",
                SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST="node[1-2]", GPUS="1", PORT=str(free_port()),
                OMP_NUM_THREADS="1", FAKE_SLURM_LOG=str(tmp_path / "slurm.log"), **env)


def test_slurm_launch_lines_parse(tmp_path, monkeypatch):
    """Both launchers the script can build, from the multi-node script: torchrun's line by torchrun's parser,
    accelerate launch's by Accelerate's, with the FSDP2 config; the launcher passes SIGUSR1 on."""
    import shlex
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.run import get_args_parser
    for script in ("train.sbatch", "train_multinode.sbatch"):
        assert subprocess.run(["bash", "-n", str(SLURM / script)]).returncode == 0
    lines = {}
    for launcher, extra in (("torchrun", {}),
                            ("accelerate", dict(ACCELERATE_CONFIG=str(SLURM / "fsdp2_multinode.yaml")))):
        env = fake_slurm(tmp_path, FAKE_SLURM_ECHO="1", SLURM_SUBMIT_DIR=str(ROOT), **extra)
        proc = subprocess.run(["bash", str(SLURM / "train_multinode.sbatch"), "--config", "my config.yaml"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        echoed = json.loads(proc.stdout)
        bash, c, command = echoed["command"]
        assert (bash, c) == ("bash", "-c") and command.startswith("exec ")
        lines[launcher] = shlex.split(command.replace("$SLURM_NODEID", "1"))[1:]
    for name, value in echoed["env"].items():  # torchrun reads them (accelerate launch runs torchrun)
        monkeypatch.setenv(name, value)
    torchrun = get_args_parser().parse_args(lines["torchrun"][1:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_id) == \
        ("2", "1", "c10d", "42")
    assert "SIGUSR1" in torchrun.signals_to_handle.split(",")
    assert echoed["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "110"
    assert (torchrun.training_script, torchrun.training_script_args) == \
        ("train.py", ["--config", "my config.yaml", "--resume", "auto"])
    assert lines["accelerate"][:2] == ["accelerate", "launch"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(lines["accelerate"][2:]))
    assert (args.num_machines, args.num_processes, args.machine_rank, args.rdzv_backend) == (2, 2, 1, "c10d")
    assert args.training_script_args == ["--config", "my config.yaml", "--resume", "auto"]
    fsdp = prepare_multi_gpu_env(args)
    assert (fsdp["FSDP_VERSION"], fsdp["FSDP_STATE_DICT_TYPE"], fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"]) == \
        ("2", "SHARDED_STATE_DICT", "LipsBlock")
    from lipsformer.layers import LipsBlock  # noqa: F401  (the class the config wraps exists under that name)


@pytest.mark.slow
def test_two_node_slurm_job_preempted_mid_epoch_is_requeued_and_ends_identical(two_processes, tmp_path):
    """examples/slurm/train.sbatch on two "nodes" (torchrun, c10d rendezvous) gets USR1 as SLURM's
    --signal=B:USR1@120 sends it: the training stops after the step in progress with its checkpoint, the script
    requeues the job, and the requeued job ends with the uninterrupted run's weights, bit for bit (that run is on
    2 processes of one torchrun: two nodes of one process each equal it)."""
    import time
    config, reference, _ = two_processes
    run = tmp_path / "run"
    env = fake_slurm(tmp_path)
    command = ["bash", str(SLURM / "train.sbatch"), "--config", str(config), "--output-dir", str(run)]
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, steps = time.time() + 600, []
    while time.time() < deadline and job.poll() is None:
        steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"] if (run / "metrics.jsonl").exists() \
            else []
        if steps and max(steps) >= 2:
            break
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    assert (tmp_path / "slurm.log").read_text() == "requeue 42\n"
    stopped = latest_checkpoint(run)
    last = max(r["step"] for r in read_metrics(run) if r["kind"] == "train")
    assert max(steps) <= last == int(stopped.name.split("_")[1]) < 6, "stopped at the next step, mid-run"
    assert err.count("preempted: SIGUSR1 received") == 1

    job = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # the requeued job
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "slurm.log").read_text() == "requeue 42\n"  # done: not requeued again
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"][len(range(1, last + 1)):][0] == last + 1
    assert same_weights(reference, run)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_outputs_are_readable_as_any_other_file_and_a_log_gets_plain_progress_lines(tmp_path, capsys, monkeypatch,
                                                                                    terminal):
    """Weight files are not 0600 (safetensors writes through a temporary file) where every other
    output is 0666 less the umask, and the progress bar writes no updates into log files: every file of the run
    and of its export has the umask's mode, and stderr that is not a terminal gets no bar but a plain line every
    log_every_steps on stdout."""
    from lipsformer.convert import main as convert
    config = write_config(tmp_path, epochs=1, global_batch=4, batch_size=4, log_every_steps=2,
                          checkpoint_every_steps=100)
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    mask = os.umask(0o027)
    try:
        assert load_script("train.py").main(["--config", str(config)]) == 0
        assert convert([str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    finally:
        os.umask(mask)
    said = capsys.readouterr()
    shown, out = sys.stderr.getvalue() if terminal else said.err, said.out
    plain = [line for line in out.splitlines() if line.startswith("epoch 1/1 step ")]
    if terminal:
        assert "epoch 1/1:" in shown and "6/6 [" in shown and not plain, shown
        return
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for folder in ("run", "export")
             for p in (tmp_path / folder).rglob("*") if p.is_file()}
    assert {"run/best.safetensors", "run/last.safetensors", "run/last_ema.safetensors",
            "export/model.safetensors"} <= set(modes) and any(k.endswith("/model.safetensors") for k in modes)
    assert set(modes.values()) == {"0o640"}, modes  # umask 027: group-readable, like every other output
    assert "it/s" not in shown and "6/6" not in shown, shown
    assert [line.split(" (")[0] for line in plain] == ["epoch 1/1 step 2", "epoch 1/1 step 4", "epoch 1/1 step 6"]
    assert all(", lr " in line and " img/s" in line for line in plain), plain
