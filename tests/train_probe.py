"""train.py under test, with three optional probes; run by torchrun, or imported by in-process tests.

    torchrun --nproc_per_node 2 tests/train_probe.py [--fsdp] [--record DIR] [--signal-at-step K] -- TRAIN.PY ARGS

``--fsdp``: Accelerate's FSDP2 on CPU processes (gloo). Accelerate turns FSDP on for accelerators only, so its
state is forced to FSDP (version 2, sharded state dicts) before anything is prepared; everything after that is
the loop's own FSDP path.
``--record DIR``: each process writes ``DIR/<pid>.json``, the targets of every batch it trained on, with the epoch
and the optimizer step the batch belongs to (a data set with one image per class makes targets sample ids).
``--signal-at-step K``: process 0 sends itself SIGUSR1 while its first batch of optimizer step K is in progress.
``--kill-in-save N``: the process sends itself SIGKILL in the middle of writing checkpoint N (its files written,
not yet its manifest nor the rename), as a scheduler's SIGKILL would land when the grace time is too short.
``--signal NAME``: the signal ``--signal-at-step`` sends (USR1; INT is Ctrl-C).
``--signal-in-shutdown NAME``: the process sends itself that signal once the command has said how it ended (in its
``wrote:`` line, :func:`lipsformer.cli._say_written`): a second signal during the shutdown.
``--rank-loss``: process r's every batch loss is r + 1 (the criterion's own times 0, plus r + 1), so the loss a
run logs tells whose losses it holds: the whole run's mean, or one process's.
The exit code is train.py's.
"""
import argparse
import json
import os
import runpy
import signal
import sys
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import lipsformer.engine.train as loop

ROOT = Path(__file__).resolve().parents[1]


def fsdp2_accelerator(create_accelerator):
    def create(cfg):
        accelerator = create_accelerator(cfg)
        for state in (accelerator.state, PartialState()):
            state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                       state_dict_type="SHARDED_STATE_DICT")
        return accelerator
    return create


def probed_step(train_step, records: list, signal_at_step: int = 0, sig: int = signal.SIGUSR1):
    """``loop._train_step`` that appends ``(epoch, step, targets)`` to ``records`` and, on process 0, sends
    ``sig`` (SIGUSR1) to its own process at the first batch of step ``signal_at_step``."""
    def step(run, meter, images, targets, epoch):
        update = run.state.step + 1
        if update == signal_at_step and run.accelerator.is_main_process \
                and not any(r["step"] == update for r in records):
            os.kill(os.getpid(), sig)
        records.append(dict(epoch=epoch, step=update, targets=targets.tolist()))
        return train_step(run, meter, images, targets, epoch)
    return step


def killed_in_save(save_state, step: int):
    """``Accelerator.save_state`` that kills its process once the files of checkpoint ``step`` are written."""
    def save(self, output_dir=None, **kwargs):
        result = save_state(self, output_dir, **kwargs)
        if Path(output_dir).name.endswith(f"step_{step:09d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return save


def rank_loss(build_criterion):
    """``loop.build_criterion`` whose loss is ``r + 1`` on process r."""
    def build(cfg):
        mixup, criterion = build_criterion(cfg)
        rank = PartialState().process_index
        return mixup, lambda logits, targets: criterion(logits, targets) * 0 + (rank + 1)
    return build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--record")
    parser.add_argument("--signal-at-step", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--rank-loss", action="store_true")
    parser.add_argument("--signal", default="USR1")
    parser.add_argument("--signal-in-shutdown")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.fsdp:
        loop.create_accelerator = fsdp2_accelerator(loop.create_accelerator)
    if args.kill_in_save:
        from accelerate import Accelerator
        Accelerator.save_state = killed_in_save(Accelerator.save_state, args.kill_in_save)
    if args.rank_loss:
        loop.build_criterion = rank_loss(loop.build_criterion)
    if args.signal_in_shutdown:
        from lipsformer import cli
        say = cli._say_written
        second = getattr(signal, "SIG" + args.signal_in_shutdown)

        def said_then_signalled():
            say()
            os.kill(os.getpid(), second)
        cli._say_written = said_then_signalled
    if args.signal == "INT" or args.signal_in_shutdown == "INT":
        # Ctrl-C as a terminal delivers it, even where this process was started with SIGINT ignored (a background
        # job of a non-interactive shell), which Python would otherwise leave ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
    records = []
    loop._train_step = probed_step(loop._train_step, records, args.signal_at_step,
                                   getattr(signal, "SIG" + args.signal))
    sys.argv = [str(ROOT / "train.py"), *[a for a in args.train_args if a != "--"]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if args.record:
            Path(args.record, f"{os.getpid()}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
