"""The one writer: every file a command writes goes through here.

    with replacing(path) as tmp:          # a file or a folder written at a temporary name beside ``path``,
        fig.savefig(tmp, format="png")    # renamed over ``path`` when the block ends
    write_text(path, text)
    write_json(path, value)               # strict JSON: a non-finite number is null, with a ``KEY_reason``
    write_csv(path, rows)                 # a table of dicts, one line each
    append_text(path, row)                # metrics rows: appended, cut back on a failure

A write either completes or leaves the target as it was: a failure (disk full, a read-only file system, no
permission, a file where a folder should be) removes the temporary (or cuts an append back to its length before)
and raises :class:`WriteFailed`, exit 3, naming the target and the cause. A missing parent folder is created. Files
get the mode ``open()`` gives any other output, 0666 less the umask, whatever wrote them (safetensors and Accelerate
write 0600). Each command's error boundary prints the paths it wrote (:func:`written`).

Standard library only: every module may write through it.
"""
import argparse
import contextlib
import csv
import errno
import fcntl
import io
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .errors import Mistake, Stopped
from .settings import expand_path

TMP_PREFIX = ".tmp-"  # a file or folder being written; never taken for a finished one
OLD_PREFIX = ".old-"  # a folder being replaced by a new one of the same name, removed once it is
MARK = ".complete"  # in a folder a command writes whole (the data writers): what wrote it, with which settings

_written: Dict[Path, None] = {}  # what this command wrote, in order (a dict: each path once)


class WriteFailed(Stopped):
    """A file or folder could not be written (disk full, read-only, no permission, ...): exit 3. The temporary is
    removed and the target is as it was."""

    def __init__(self, path, error: OSError, note: str = "", what: str = ""):
        self.path, self.error = Path(path), error
        at = f", at {error.filename}" if error.filename and Path(error.filename) != self.path else ""
        name = errno.errorcode.get(error.errno or 0)
        cause = f"{error.strerror or error} ({name}{at})" if name else f"{error.strerror or error}{at}"
        note = note or ("the previous file is intact" if self.path.exists() else "nothing was written there")
        super().__init__(f"could not write {what or path}: {cause}; {note}")


def umask() -> int:
    """The process's file-mode creation mask (Linux's /proc/self/status states it; elsewhere read by setting it and
    setting it back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_as_outputs(path: Path) -> None:
    """Give ``path`` (a file, or every file under a folder) the mode ``open()`` gives any other output, 0666 less the
    umask (0644 under umask 022): safetensors writes through a temporary file of mode 0600, which a colleague on a
    shared file system could not read."""
    path = Path(path)
    mode = 0o666 & ~umask()
    for file in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
        if file.stat().st_mode & 0o777 != mode:
            os.chmod(file, mode)


def temporary(path, prefix: str = TMP_PREFIX) -> Path:
    """Where ``path`` is written before its rename: ``.tmp-NAME`` beside it."""
    path = Path(path)
    return path.with_name(prefix + path.name)


def remove(path: Path) -> None:
    """Remove a file or a folder if it is there; what cannot be removed is left (a failure is being told already)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def io_error(e: BaseException, place: Path) -> Optional[OSError]:
    """The OSError behind a failure of a library's writer (``place``: where it wrote), or None for one that is not a
    write's. Safetensors (Rust) says ``... (os error 28)`` in a SafetensorError; torch.save's stream writer raises
    a RuntimeError naming no cause (``PytorchStreamWriter failed writing``, ``unexpected pos``), taken as a full
    disk when no space is left there, else as an I/O error."""
    if isinstance(e, OSError):
        return e
    text = str(e)
    code = re.search(r"\(os error (\d+)\)", text)
    if code:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(place))
    if isinstance(e, RuntimeError) and "inline_container" in text:
        try:
            full = os.statvfs(next(p for p in (place, *place.parents) if p.exists())).f_bavail == 0
        except OSError:
            full = False
        code = errno.ENOSPC if full else errno.EIO
        return OSError(code, os.strerror(code), str(place))
    return None


def _commit(path: Path, finish: Callable[[], None]) -> None:
    """Every write ends here: ``finish`` makes it count (the temporary renamed over ``path``, an appended row
    flushed), and ``path`` joins what this command wrote. A failure injected here is a failure of the write."""
    finish()
    _written[Path(path)] = None


def _rename(tmp: Path, path: Path) -> None:
    """``tmp`` over ``path``: a file atomically; a folder over a folder holding files by two renames (the old one
    aside, then removed), put back if the second fails."""
    readable_as_outputs(tmp)
    if tmp.is_file():
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # on NFS a full disk may only be told here
        finally:
            os.close(fd)
    if tmp.is_dir() and path.is_dir() and any(path.iterdir()):
        old = temporary(path, OLD_PREFIX)
        remove(old)
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            os.replace(old, path)
            raise
        remove(old)
        return
    os.replace(tmp, path)


@contextlib.contextmanager
def replacing(path, note: str = "", what: str = "", main: bool = True, exclusive: bool = False) -> Iterator[Path]:
    """A temporary name beside ``path`` for the block to write a file or a folder at; when the block ends it is
    renamed over ``path``. On a failure the temporary is removed and an OSError becomes :class:`WriteFailed`
    (``note``: what is intact, for its line; ``what``: how the line names the target).

    ``main=False``: a process that writes into the temporary beside the main one (a checkpoint's own files under
    several processes): it neither clears a stale temporary nor renames, the main process does.

    ``exclusive``: a second writer of ``path`` while this one writes (the same command started twice) is refused, a
    Mistake naming ``path``, rather than clearing this one's temporary as a stale one (:func:`writing_alone`)."""
    path = Path(path)
    tmp = temporary(path)
    with writing_alone(path, tmp) if exclusive else contextlib.nullcontext():
        try:
            if main:
                remove(tmp)
                path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            if main:
                _commit(path, lambda: _rename(tmp, path))
        except BaseException as e:
            remove(tmp)
            error = io_error(e, tmp) if isinstance(e, Exception) else None
            if error is None:
                raise
            raise WriteFailed(path, error, note, what) from None


@contextlib.contextmanager
def writing_alone(path: Path, tmp: Path) -> Iterator[None]:
    """Hold an exclusive lock (``flock``, released by the system when the process ends, however it ends) on
    ``TMP.lock`` beside ``path`` while it is written; a Mistake naming ``path`` when another process holds it."""
    lock = tmp.with_name(tmp.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_WRONLY, 0o644)
    except OSError as e:
        raise WriteFailed(path, io_error(e, lock) or e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Mistake(f"{path} is being written by another process right now (its lock {lock}): wait for it "
                          f"to end, or choose another folder") from None
        try:
            yield
        finally:
            remove(lock)
    finally:
        os.close(fd)


def write_text(path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def write_json(path, value, reason: str = "", indent: int = 2) -> None:
    """``value`` as strict JSON (:func:`to_json`)."""
    write_text(path, to_json(value, reason, indent) + "\n")


def write_csv(path, rows) -> None:
    """``rows`` (dicts) as CSV: a header of their keys in the order first seen, then one line each; a missing key,
    None or a non-finite number is an empty cell."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    text = io.StringIO()
    out = csv.writer(text)
    out.writerow(columns)
    for r in rows:
        out.writerow(["" if v is None or isinstance(v, float) and not math.isfinite(v) else v
                      for v in (r.get(k) for k in columns)])
    write_text(path, text.getvalue())


def save_figure(fig, path) -> None:
    """A matplotlib figure, in the format its name's suffix says (PNG without one)."""
    with replacing(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix[1:].lower() or "png", dpi=100)


def append_text(path, text: str) -> None:
    """Add ``text`` (whole rows) at the end of ``path`` (the first rows make the file, as :func:`write_text` does). A
    failure cuts the file back to its length before, so no partial row is left; the file stays the same file
    (``tail -f`` follows it)."""
    path = Path(path)
    if not path.exists():
        write_text(path, text)
        return
    size = path.stat().st_size
    try:
        with open(path, "a") as f:
            f.write(text)
            _commit(path, f.flush)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise WriteFailed(path, e, "the rows before it are intact") from None


def write_held(fd: int, path, text: str, note: str = "") -> None:
    """Write ``text`` over the content of the open file ``fd`` (at ``path``) in place: a lock file, whose inode is
    the lock, is never replaced by a rename."""
    def finish():
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)
    try:
        _commit(Path(path), finish)
    except OSError as e:
        raise WriteFailed(path, e, note) from None


# -- strict JSON ----------------------------------------------------------------------------------------------------
_NOT_FINITE = {math.inf: "infinite", -math.inf: "infinite (negative)"}


def strict(value, reason: str = ""):
    """``value`` as strict JSON can hold it: each non-finite float becomes None (null), and a dict holding one at key
    ``K`` gets ``K_reason``: ``reason``, or what the value was ("infinite", "not a number"), unless it has one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k] = strict(v, reason)
            if isinstance(v, float) and not math.isfinite(v) and f"{k}_reason" not in value:
                out[f"{k}_reason"] = reason or _NOT_FINITE.get(v, "not a number")
        return out
    if isinstance(value, (list, tuple)):
        return [strict(v, reason) for v in value]
    return value


def to_json(value, reason: str = "", indent=None) -> str:
    """The one encoder of every JSON a command writes (results, metrics rows): :func:`strict`, then ``json.dumps``
    refusing any non-finite number left."""
    return json.dumps(strict(value, reason), indent=indent, allow_nan=False)


# -- output paths ---------------------------------------------------------------------------------------------------
def check_target(path, folder: bool = False) -> Path:
    """A Mistake (exit 2, before any work) unless ``path`` can be written as a file (``folder``: as a folder): an
    existing folder where a file is meant, a file where a folder is meant, a file among its parents or a parent this
    user cannot write in (named as a read-only file system where it is one) are refused; missing parents are
    created when it is written."""
    path = Path(path)
    if path.is_dir() and not folder:
        raise Mistake(f"{path} is a folder; name the file to write")
    if path.exists() and not path.is_dir() and folder:
        raise Mistake(f"{path} is a file, not a folder")
    for place in (path, *path.parents) if folder else path.parents:
        if place.exists():
            if not place.is_dir():
                raise Mistake(f"{path}: {place} is a file, not a folder")
            if not os.access(place, os.W_OK | os.X_OK):
                why = "a read-only file system" if os.statvfs(place).f_flag & os.ST_RDONLY else "permission denied"
                raise Mistake(f"{path}: cannot write in {place} ({why})")
            break
    return path


def output_folder(text: str) -> str:
    """argparse type of an option naming a folder to write: ``~`` and ``$VARIABLES`` expanded, then
    :func:`check_target` as a folder, said as that option's error."""
    try:
        text = expand_path(text, "")
        check_target(text, folder=True)
    except Mistake as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return text


def output_file(text: str) -> str:
    """argparse type of an option naming a file to write: ``~`` and ``$VARIABLES`` expanded
    (:func:`lipsformer.settings.expand_path`), then :func:`check_target`, said as that option's error."""
    try:
        text = expand_path(text, "")
        check_target(text)
    except Mistake as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return text


FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")  # what matplotlib's Agg saves


def output_figure(text: str) -> str:
    """argparse type of an option naming a figure to write: :func:`output_file`, in a format its suffix names
    (:func:`save_figure`)."""
    suffix = Path(text).suffix[1:].lower()
    if suffix and suffix not in FIGURE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: cannot draw a .{suffix} figure; name a "
                                         f"{', '.join('.' + f for f in FIGURE_FORMATS[:4])}, ... file")
    return output_file(text)


# -- what a run folder and an export own ----------------------------------------------------------------------------
# A train.py output folder's own names (lipsformer/run_folder.py lays the folder out with them) and an export's
# files (lipsformer/weights.py): every output of every command is checked against them (:func:`check_outputs`).
CONFIG = "config.yaml"  # a folder holding it is a run
CLASSES = "classes.json"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
LAST = "last.safetensors"
LAST_EMA = "last_ema.safetensors"
BEST = "best.safetensors"
BEST_KEPT = "best"  # the folder of the keep_best best epochs' weights
SUMMARY = "summary.csv"
CHECKPOINTS = "checkpoints"
TRACKER = "lipsformer"  # the TensorBoard folder
TRACKER_RUNS = "trackers.json"
LOCK = ".lock"
OUTPUTS = (CONFIG, CLASSES, METRICS, SUMMARY, CURVES, LAST, LAST_EMA, BEST, BEST_KEPT, TRACKER,
           TRACKER_RUNS)  # what a start writes beside checkpoints
EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"  # an exported weight folder (timm's layout)


def is_run(folder) -> bool:
    """Whether ``folder`` is a train.py output folder."""
    return (Path(folder) / CONFIG).is_file()


def owner(path, folder: bool = False) -> Optional[Tuple[str, Path]]:
    """What writing ``path`` (``folder``: a folder) would overwrite that a run or an export owns (a phrase:
    ``training run R's own summary.csv``), with the folder where a new output may go instead; None when it
    overwrites nothing. In a run folder: its own files and folders (:data:`OUTPUTS`, its checkpoints, its lock) and
    anything inside them; in an export: its ``config.json`` and ``model.safetensors``; anywhere: an existing weight
    file (``*.safetensors``). A new file beside a run's own (``eval.json``) overwrites nothing."""
    path = Path(path).absolute()
    for run in path.parents:
        own = path.relative_to(run).parts[0]
        if own in (*OUTPUTS, CHECKPOINTS, LOCK) and is_run(run):
            return (f"training run {run}'s own {own}" if own == path.name else
                    f"a file in training run {run}'s {own}/"), run
    if path.name in (EXPORT_CONFIG, EXPORT_WEIGHTS) and all((path.parent / n).is_file()
                                                            for n in (EXPORT_CONFIG, EXPORT_WEIGHTS)):
        return f"exported weights {path.parent}'s own {path.name}", path.parent.parent
    if path.suffix == ".safetensors" and path.is_file() and not folder:
        return "weights", path.parent
    return None


class Output(NamedTuple):
    """One output of a call, as :func:`check_outputs` takes it: how the line names it (``--json``, ``output_dir``),
    its path, whether it is a folder, and a name for a new file where the line suggests one (``eval.json``)."""

    label: str
    path: str
    folder: bool = False
    example: str = ""


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_outputs(outputs: Sequence[Output], reads: Sequence[Tuple[str, str]] = (),
                  data: Sequence[Tuple[str, str]] = ()) -> None:
    """The one check every output of every command passes, before any work: a Mistake (exit 2) naming the output
    when it would overwrite what a run or an export owns (:func:`owner`), when it lies inside the input data
    (``data``: ``(label, folder)`` pairs, the folders a call reads as data: a file written there would be read as
    data, a run folder there as a class), when it is a file the call reads (``reads``: ``(label, path)``; a folder
    output may be a folder the call reads, as a resumed run's), or when two outputs of the call name one path."""
    seen: Dict[Path, str] = {}
    for out in outputs:
        path = Path(out.path).absolute()
        taken = owner(path, out.folder)
        if taken:
            kind = "folder" if out.folder else "file"
            example = f" (e.g. {taken[1] / (out.example or 'output' + path.suffix)})" if not out.folder else ""
            raise Mistake(f"{out.label} {out.path} would overwrite {taken[0]}; name another {kind}{example}")
        resolved = path.resolve()
        for label, folder in data:
            if folder and _within(resolved, Path(folder).resolve()):
                raise Mistake(f"{out.label} {out.path} is inside {label} {folder}, the input data: an output there "
                              f"would be read as data; write it outside {folder}")
        for label, read in reads:
            if not out.folder and read and resolved == Path(read).resolve() and Path(read).is_file():
                raise Mistake(f"{out.label} {out.path} is {label} {read}, which this call reads; name another file")
        if resolved in seen:
            raise Mistake(f"{seen[resolved]} and {out.label} both name {out.path}; give each its own "
                          f"{'folder' if out.folder else 'file'}")
        seen[resolved] = out.label


# -- folders a command writes whole ---------------------------------------------------------------------------------
def written_as(root, settings: dict) -> bool:
    """For a command that writes a whole folder and marks it (:data:`MARK`: the data writers): True when ``root`` is
    already written with ``settings`` (left as it is), False when it may be written (absent, empty, or marked by such
    a command with other settings). A Mistake (exit 2) when it is a file or a folder holding files it did not
    write."""
    root = check_target(root, folder=True)
    if (root / MARK).is_file():
        text = (root / MARK).read_text().strip()
        try:
            return not text or json.loads(text) == settings  # an empty mark: written before marks said how
        except ValueError:
            return False
    if root.is_dir():
        found = sorted(p.name for p in root.iterdir())
        if found:
            raise Mistake(f"{root} holds files that {settings.get('written_by', 'this command')} did not write "
                          f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); choose a new or empty folder")
    return False


def mark(folder: Path, settings: dict) -> None:
    """Record in ``folder`` that it is complete, and how it was written (:func:`written_as` reads it)."""
    (Path(folder) / MARK).write_text(to_json(settings) + "\n")


# -- what a command wrote -------------------------------------------------------------------------------------------
def forget_written() -> None:
    """Start a new record of what is written (each command's boundary does, before the command runs)."""
    _written.clear()


def written() -> List[Path]:
    """The files and folders written since :func:`forget_written` that are still there (a rotated checkpoint is
    not), in the order of their first write."""
    return [p for p in _written if p.exists()]
