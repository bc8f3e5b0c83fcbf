"""Preemption: what a cluster scheduler sends before it stops a job, noted by a signal handler and acted on by the
loop between optimizer steps (that step's checkpoint written, then :class:`~lipsformer.errors.Preempted`: exit 75).
"""
import contextlib
import signal
import threading
from typing import Optional

import torch

from ..errors import Preempted, hold_stop_signals, stop_signals_held
from .checkpoint import save_checkpoint
from .metrics import EpochMeter

# What a cluster scheduler sends before it stops a job (SLURM: ``--signal=USR1@120``; SIGTERM at preemption or
# at the time limit, SIGKILL some seconds later).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes a preemption signal and nothing else: the loop acts on it between optimizer steps
    (:func:`stop_if_preempted`), so a signal never interrupts a step or a checkpoint write, and a second one only
    notes it again."""

    def __init__(self):
        self.signal = 0  # the number of the last signal received, 0 for none

    def __call__(self, signum, frame) -> None:
        self.signal = signum

    @contextlib.contextmanager
    def watching(self):
        """Within the block the preemption signals set the flag; the previous handlers are restored after it.
        Blocking system calls interrupted by them are restarted (gloo, loader workers) rather than failing."""
        previous = {}
        if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
            for sig in PREEMPTION_SIGNALS:
                previous[sig] = signal.signal(sig, self)
                signal.siginterrupt(sig, False)
        try:
            yield self
        finally:
            held = stop_signals_held()
            for sig, handler in previous.items():
                if sig in held:  # stopping: the signal stays ignored; its handler before this block comes back later
                    held[sig] = handler
                else:
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def stop_if_preempted(run, meter: Optional[EpochMeter] = None) -> None:
    """Between optimizer steps (``run``: the loop's run): when any process was sent a preemption signal (on several
    processes the flag is reduced, so every process must call this at the same step, and all stop there), write this
    step's checkpoint and raise Preempted."""
    accelerator, state = run.accelerator, run.state
    received = run.preemption.signal
    if accelerator.num_processes > 1:
        received = int(accelerator.reduce(torch.tensor([float(received)], device=accelerator.device), "max").item())
    if not received:
        return
    if meter is not None:  # mid-epoch: the resumed run completes the epoch's sums
        state.epoch_sums = meter.totals(accelerator)
    run.last_good = save_checkpoint(accelerator, run.model, run.folder.root, state, run.cfg.keep_last)
    hold_stop_signals()  # from here the exit code is 75, whatever signal comes next
    accelerator.end_training()
    raise Preempted(f"{signal.Signals(received).name} received: every process finished step {state.step} and "
                    f"checkpoint {run.last_good} is written (epoch {state.epoch + 1}, {state.samples_in_epoch} of its "
                    f"samples used); continue with --resume auto")
