"""The layout of a train.py output folder, in one place.

The training loop writes it, the checkpoint code rotates checkpoints inside it, and ``lipsformer.weights``
reads finished runs from it::

    OUTPUT_DIR/
      config.yaml            the TrainConfig the run used
      classes.json           the train folder's class names in label order (lipsformer.data.classes)
      metrics.jsonl          one JSON row per log event (kind: init | train | epoch)
      summary.csv            one row per epoch, timm's columns then ours, rewritten from metrics.jsonl each epoch
      curves.png             loss, accuracy and |alpha| curves, drawn at the end
      last.safetensors       weights after the last epoch
      last_ema.safetensors   their EMA (when ema_decay is set)
      best.safetensors       the best of model / EMA by val top-1
      best/epoch_EEE_top1_SS.SS.safetensors   the keep_best highest-scoring epochs' weights (model or EMA, as best)
      checkpoints/step_NNNNNNNNN/   Accelerate save_state folders, each with manifest.json
      checkpoints/.damaged-step_N/  checkpoints --resume auto skipped, set aside so the run can write them again
      lipsformer/            TensorBoard events (log_with: tensorboard)
      trackers.json          what continues the runs of wandb / MLflow on resume (their run ids), when they log
      attempt-N/             the outputs of an earlier start that left no checkpoint, moved aside by the next start
      .lock                  held by the run writing the folder (:class:`RunLock`): its pid, host and start time

Every file is written through :mod:`lipsformer.writer` (a temporary name, then a rename). The names above are
defined there, on the writers' floor, whose one check of outputs (:func:`lipsformer.writer.check_outputs`) keeps every
command's outputs off them.
"""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import socket
from pathlib import Path
from typing import Callable, List, Optional

from .errors import ConfigError, Mistake, Stopped
from .settings import SettingError, read_json_lines
from .writer import (BEST, BEST_KEPT, CHECKPOINTS, CLASSES, CONFIG, CURVES, LAST, LAST_EMA, LOCK, METRICS, OUTPUTS,
                      SUMMARY, TMP_PREFIX, TRACKER_RUNS, Output, WriteFailed, check_outputs, check_target,
                      is_run, remove, replacing, to_json, write_held)

MANIFEST = "manifest.json"  # inside each checkpoint folder
ATTEMPT = "attempt-{}"
DAMAGED_PREFIX = ".damaged-"  # a checkpoint that failed verification, set aside (kept for inspection)

_CHECKPOINT = re.compile(r"^step_(\d{9})$")
_KEPT = re.compile(r"^epoch_\d{3,}_top1_[\d.]+\.safetensors$")


KINDS = ("init", "train", "epoch")  # of a metrics.jsonl row


def read_metrics(path: Path) -> List[dict]:
    """The rows of a ``metrics.jsonl`` file in order; none when it does not exist. A last row cut short (the machine
    went down in the middle of an append) is left out. A line the run cannot have written (not JSON, not an object,
    no known kind or whole step, an epoch row without its epoch) is a SettingError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    rows = read_json_lines(path)
    for n, row in rows:
        problem = _row_problem(row)
        if problem:
            raise SettingError(f"{path} line {n}: {problem}; a run writes one JSON object per line, with its kind "
                               f"and step: restore the line as the run wrote it, or remove it")
    return [row for _, row in rows]


def _row_problem(row) -> Optional[str]:
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not isinstance(row, dict):
        return f"{type(row).__name__} where a row is an object"
    if row.get("kind") not in KINDS:
        return f"kind {row.get('kind')!r} is not one of {', '.join(KINDS)}"
    if not whole(row.get("step")):
        return f"step {row.get('step')!r} is not a whole number"
    if row["kind"] == "epoch" and not whole(row.get("epoch")):
        return f"an epoch row's epoch {row.get('epoch')!r} is not a whole number"
    return None


def check_output(folder: "RunFolder", data_dir=None) -> None:
    """A ConfigError unless ``output_dir`` is (or can become) a folder this user can write in
    (:func:`~lipsformer.writer.check_target`) and passes the writers' one check of outputs
    (:func:`~lipsformer.writer.check_outputs`): not inside ``data_dir`` (the run's own folder would become a class of
    its data), nor a folder a run owns (another run's checkpoints/ or best/)."""
    try:
        check_target(folder.root, folder=True)
    except Mistake as e:
        raise ConfigError(f"output_dir {e}; choose another output_dir") from None
    try:
        check_outputs([Output("output_dir", str(folder.root), folder=True)], data=[("data_dir", data_dir)] * bool(
            data_dir))
    except Mistake as e:
        raise ConfigError(str(e)) from None


class RunFolder:
    """Paths of one run's output folder (see the module docstring for the layout)."""

    def __init__(self, root):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def curves(self) -> Path:
        return self.root / CURVES

    @property
    def classes(self) -> Path:
        return self.root / CLASSES

    @property
    def best(self) -> Path:
        return self.root / BEST

    def best_kept(self, epoch: int, top1: float) -> Path:
        """The weights of ``epoch`` (from 1), which scored ``top1`` (%), among the keep_best best."""
        return self.root / BEST_KEPT / f"epoch_{epoch:03d}_top1_{top1:.2f}.safetensors"

    def kept_files(self) -> List[Path]:
        """The weight files in ``best/`` (:meth:`best_kept`'s names), by name."""
        folder = self.root / BEST_KEPT
        return sorted(p for p in folder.iterdir() if _KEPT.match(p.name)) if folder.is_dir() else []

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def tracker_runs(self) -> Path:
        return self.root / TRACKER_RUNS

    def read_metrics(self) -> List[dict]:
        """The rows of ``metrics.jsonl`` in order (none when the run wrote none, e.g. it stopped at once)."""
        return read_metrics(self.metrics)

    def keep_metrics_until(self, step: int, epochs: int) -> None:
        """Drop the rows a resumed run logs again: train rows after optimizer ``step``, epoch rows after epoch
        ``epochs`` (what the checkpoint resumed from had finished), and a last row cut short. Rewritten beside the
        file and renamed."""
        rows = self.read_metrics()
        kept = [r for r in rows if (r["epoch"] <= epochs if r["kind"] == "epoch" else r["step"] <= step)]
        if len(kept) == len(rows) and (not rows or self.metrics.read_bytes().endswith(b"\n")):
            return
        with replacing(self.metrics) as tmp:
            tmp.write_text("".join(to_json(r) + "\n" for r in kept))

    def weights(self, ema: bool = False) -> Path:
        """The final weights (``last.safetensors``), or their EMA."""
        return self.root / (LAST_EMA if ema else LAST)

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:09d}"

    @staticmethod
    def set_aside(damaged: Path) -> Path:
        """A name beside ``damaged`` for a checkpoint that failed verification; no earlier one is overwritten."""
        n, target = 0, damaged.with_name(DAMAGED_PREFIX + damaged.name)
        while target.exists():
            n += 1
            target = damaged.with_name(f"{DAMAGED_PREFIX}{damaged.name}.{n}")
        return target

    def finished_checkpoints(self) -> List[Path]:
        """Renamed (complete) checkpoint folders, oldest first; half-written ``.tmp-*`` ones are left out."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name))

    def is_run(self) -> bool:
        return is_run(self.root)

    def clear_temporaries(self) -> None:
        """Remove what a killed writer left half-written (``.tmp-*`` files and checkpoint folders): called by the
        holder of the folder's lock, so no one is writing them."""
        for place in (self.root, self.checkpoints, self.root / BEST_KEPT):
            if place.is_dir():
                for tmp in place.glob(TMP_PREFIX + "*"):
                    remove(tmp)

    def set_aside_attempt(self) -> Optional[Path]:
        """Move the outputs of an earlier start that left no checkpoint to resume from (its config, metrics rows,
        TensorBoard events, weights, set-aside checkpoints) into ``attempt-N/``, so that a new start writes the
        folder afresh and inherits none of its rows, while nothing written is lost. Returns that folder (None when
        there was nothing to move)."""
        self.clear_temporaries()
        if self.checkpoints.is_dir() and not any(self.checkpoints.iterdir()):
            self.checkpoints.rmdir()
        found = [self.root / name for name in (*OUTPUTS, CHECKPOINTS) if (self.root / name).exists()]
        if not found:
            return None
        n = 1
        while (self.root / ATTEMPT.format(n)).exists():
            n += 1
        aside = self.root / ATTEMPT.format(n)
        aside.mkdir()
        for path in found:
            os.replace(path, aside / path.name)
        return aside


def checkpoint_step(path) -> Optional[int]:
    """The optimizer step a checkpoint folder was written at, or None when the name is not a checkpoint's."""
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def on_main(accelerator, action: Callable[[], None]) -> None:
    """Run ``action`` on the main process; a Mistake or a failed write (a Stopped) that it raises is raised on every
    process, so the others stop as the main one does."""
    refused = None
    if accelerator.is_main_process:
        try:
            action()
        except (Mistake, WriteFailed) as e:
            refused = e
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        said = broadcast_object_list([refused and (Stopped if isinstance(refused, Stopped) else type(refused),
                                                   str(refused))])[0]
        if said and refused is None:
            refused = said[0](said[1])
    if refused is not None:
        raise refused


class FolderInUse(Mistake):
    """Another train.py holds the run folder's lock: exit 2, nothing written."""


# A file system that keeps no locks (Lustre mounted without -o flock, NFS without a lock daemon) says so with these:
# the lock file's content (pid, host) is then the only lock.
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class RunLock:
    """One writer per run folder: ``OUTPUT_DIR/.lock``, a POSIX record lock (``lockf``) the main process takes before
    the run's first write and holds to its end, holding the holder's pid, host and start time for whoever is refused.

    The kernel lets go of the lock when its process ends however it ends (kill -9 included), and a forked loader
    worker does not inherit it, so a lock file left by a killed run is taken over by the next start. On NFS the
    server holds the lock for the client (NFSv3's lock daemon, NFSv4's state): it keeps one writer across hosts, and
    a node that went down gives its locks up when its lease runs out (about 90 s on NFSv4). Where the file system
    keeps no locks, the file's content decides: a pid that no longer runs on this host is taken over, a holder on
    another host is refused with a line saying how to take over. Used as a context manager, it is let go (and its
    file removed) when the block ends."""

    def __init__(self, root):
        self.folder = RunFolder(root)
        self.path = self.folder.root / LOCK
        self.fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def check(self, accelerator) -> None:
        """A FolderInUse naming the holder when another process holds the lock (read only: nothing is written),
        said by every process."""
        on_main(accelerator, self._check)

    def take(self, accelerator) -> None:
        """Take the lock on the main process (the folder is created); a FolderInUse naming the holder, or a
        WriteFailed, on every process when it could not. Then nothing half-written by an earlier holder is left."""
        on_main(accelerator, self._take)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)  # while still held: no one takes a file that is then removed
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def _check(self) -> None:
        if self.fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file (or none this user can read): the take says
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            holder = None
        except OSError as e:
            holder = _holder(fd) if e.errno not in _NO_LOCKS else _running(fd)
        finally:
            os.close(fd)  # lets go of the shared lock, if taken
        if holder is not None:
            raise self._in_use(holder)

    def _take(self) -> None:
        if self.fd is not None:
            return
        made = not self.folder.root.exists()
        try:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            while True:  # the holder may remove the file between our open and our lock: then lock the new one
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    holder = None
                except OSError as e:
                    holder = _holder(fd) if e.errno not in _NO_LOCKS else _running(fd)
                if holder is not None:
                    os.close(fd)
                    raise self._in_use(holder)
                if os.path.exists(self.path) and os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
                os.close(fd)
        except FolderInUse:
            raise
        except OSError as e:
            raise WriteFailed(self.path, e) from None
        self.fd = fd
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:
            write_held(fd, self.path, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), started=started)),
                       "the run wrote nothing")
        except WriteFailed:
            self.release()
            if made:  # made for this run: left as the run found it
                with contextlib.suppress(OSError):
                    self.folder.root.rmdir()
            raise
        self.folder.clear_temporaries()

    def _in_use(self, holder: dict) -> FolderInUse:
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
               if holder else "it has not written its pid yet")
        elsewhere = holder.get("host") not in (None, socket.gethostname())
        return FolderInUse(
            f"output_dir {self.folder.root} is in use by another train.py ({who}; its lock {self.path}): wait for it "
            f"to end or choose another output_dir"
            + (f"; if it no longer runs (its node went down), remove {self.path} to take over" if elsewhere else ""))


def _holder(fd: int) -> dict:
    """What a lock file says of its holder (empty when it says nothing readable)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _running(fd: int) -> Optional[dict]:
    """Where the file system keeps no locks: the lock file's holder when it may still run (on another host, or a pid
    that runs on this one), else None (no holder, or a stale one to take over)."""
    holder = _holder(fd)
    if not holder.get("pid"):
        return None
    if holder.get("host") != socket.gethostname():
        return holder
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return None
    except (PermissionError, ValueError, OverflowError):
        pass
    return holder
