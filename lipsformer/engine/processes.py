"""The processes torchrun or ``accelerate launch`` start: saying a mistake once, and ending them cleanly."""
import datetime
import os
import signal
import sys
import time
from typing import Optional

from ..errors import Stopped

# How long a process that failed waits for the others to fail the same way before it tells its own line: the
# processes run the same checks on the same inputs, so a mistake every one of them finds arrives within this.
AGREE_SECONDS = 5.0
_FAILED, _SAID = "lipsformer/failed", "lipsformer/said/"


def _rank_and_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _store():
    """The store every process of the launch reaches: the launcher's (torchrun, ``accelerate launch``: its agent
    serves one at MASTER_ADDR:MASTER_PORT from the start), else the process group's once one is started; None
    when there is neither."""
    import torch.distributed as dist
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=datetime.timedelta(seconds=AGREE_SECONDS))
        except (RuntimeError, KeyError, ValueError):  # no server reachable
            return None
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


def _ending() -> None:
    """This process is ending with an exit code it has: the launcher's SIGTERM (sent to the others once one process
    ends with an error) is ignored from here, so that it ends with that code, not with the signal. Ignored, not
    handled: the interpreter restores the default action of a handled signal while it finalises."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def agree(code: int, label: str, line: str) -> int:
    """Tell ``label: line`` (exit ``code``) once across the processes of a launch, and return the code to exit with.

    Each failing process records its code and line in the launch's store and waits up to :data:`AGREE_SECONDS`
    for the others. When every process failed, the main process says its line (and any other process whose line
    differs says its own, naming its rank) and all exit with the main process's code. When some did not fail (a
    file one node cannot see), each failing process says its line naming its rank and exits: the launcher then
    stops the others, and one waiting in a collective with it gets an error it does not tell again
    (:func:`failed_elsewhere`). Without a store every process says its line, naming its rank."""
    rank, world = _rank_and_world()
    store = _store()
    if store is None:
        print(f"{label}: rank {rank} of {world}: {line}", file=sys.stderr)
        return code
    _ending()
    store.set(f"{_SAID}{rank}", f"{code} {line}")
    failed, deadline = store.add(_FAILED, 1), time.monotonic() + AGREE_SECONDS
    while failed < world and time.monotonic() < deadline:
        time.sleep(0.05)
        failed = store.add(_FAILED, 0)
    if failed < world:
        print(f"{label}: rank {rank} of {world}: {line}", file=sys.stderr)
        return code
    main_code, main_line = store.get(f"{_SAID}0").decode().split(" ", 1)
    if rank == 0 or line != main_line:
        print(f"{label}: {line}" if rank == 0 else f"{label}: rank {rank} of {world}: {line}", file=sys.stderr)
    return int(main_code)


def failed_elsewhere() -> Optional[int]:
    """The exit code another process of the launch failed with (it said why, :func:`agree`), or None when none has
    failed: an error here that only follows from it (a collective whose peer is gone) is then not told again."""
    try:
        store = _store()
        if store is None or store.add(_FAILED, 0) == 0:
            return None
        code = int(store.get(next(f"{_SAID}{r}" for r in range(_rank_and_world()[1])
                                  if store.check([f"{_SAID}{r}"]))).decode().split(" ", 1)[0])
    except (RuntimeError, StopIteration, ValueError):  # the store is gone with the launch
        return None
    _ending()
    return code


def agree_on_outcome(accelerator, error: Optional[BaseException], what: str) -> None:
    """Where every process would wait for the others (a barrier), learn first whether any failed: ``error`` is this
    process's failure (None: it did its part). Raises ``error`` where it is set, and :class:`~lipsformer.errors.Stopped`
    naming ``what`` on a process whose part went well while another's failed, so that every process ends (the one
    that failed says why, :func:`agree`) rather than one waiting for the others forever. One all-reduce of a flag."""
    import torch
    failed = torch.tensor([0 if error is None else 1], device=accelerator.device)
    if accelerator.num_processes > 1:
        failed = accelerator.reduce(failed, reduction="max")
    if error is not None:
        raise error
    if int(failed.item()):
        raise Stopped(f"could not write {what}: another process failed to, and says why")


def end_process_group() -> None:
    """Destroy the process group, if one was started, while the interpreter is still whole. Every command's
    boundary (:func:`lipsformer.cli.command`) calls it once ``main`` has an exit code (the errors it tells in one
    line included).

    Left to the interpreter's exit, gloo's worker threads can abort the process ("terminate called without an
    active exception", SIGABRT), now and then, after every result was written: torchrun then reports the run as
    failed (pytorch/pytorch#190489). After a bug or Ctrl-C the boundary leaves the group alone, since destroying it
    while another process may still be in a collective can hang.
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
