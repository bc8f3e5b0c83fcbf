"""One error boundary for every command (train.py, eval.py, ``python -m lipsformer.lipschitz``, ``.convert``,
``.flops``, the data writers): a mistake is one line naming what to fix, with an exit code from one table.

    @command
    def main(argv=None) -> int:
        parser = ArgumentParser(prog="python -m lipsformer.something", description=__doc__)
        ...

Deeper code raises typed errors of the kinds in :mod:`lipsformer.errors`; the exceptions of the libraries underneath
(PyYAML, safetensors, Pillow, pickle, file-system errors, Ctrl-C) are translated here by family (:data:`FAMILIES`),
not at each call site. Anything else is a bug in lipsformer: its traceback is shown (lipsformer's frames and the one
that raised), with a line saying so. ``LIPSFORMER_TRACEBACK=1`` shows the full traceback of any error.
"""
import argparse
import functools
import json
import os
import pickle
import sys
import traceback
import urllib.error
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple, Type

import yaml
from PIL import Image, UnidentifiedImageError
from safetensors import SafetensorError

from .engine.processes import agree, end_process_group, failed_elsewhere
from .errors import (DownloadFailed, Interrupted, Mistake, Preempted, Stopped, UsageError, hold_stop_signals,
                     release_stop_signals)
from .extras import MissingExtra
from .settings import SettingError, expand_path, unique_pairs
from .writer import Output, check_outputs, forget_written, output_figure, output_file, output_folder, written

# the argparse types of the options that name an output, and whether it is a folder (ArgumentParser.check_outputs)
OUTPUT_TYPES = {output_file: False, output_figure: False, output_folder: True}

# The one table of exit codes, shared by every command (README "Exit codes"; each command's --help).
DONE, FAILED, MISTAKE, STOPPED, PREEMPTED, INTERRUPTED = 0, 1, 2, 3, 75, 130
EXIT = {
    DONE: "done",
    FAILED: "a download failed (try again), or a bug in lipsformer (shown with its traceback)",
    MISTAKE: "a mistake in the input: the line names what to fix; nothing was written",
    STOPPED: "a run stopped (divergence, unreadable data, a failed write); what it wrote before is intact",
    PREEMPTED: "preempted (SIGTERM / SIGUSR1): the step's checkpoint is written; requeue with --resume auto",
    INTERRUPTED: "interrupted (Ctrl-C); what was written before is intact",
}
TRACEBACK_ENV = "LIPSFORMER_TRACEBACK"  # set to 1: the full traceback of any error, before its line


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _message(e: BaseException) -> str:
    return _one_line(getattr(e, "line", None) or str(e)) or type(e).__name__


def _yaml_line(e: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one line, naming the file (or ``--set`` item) and the place."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if isinstance(e, yaml.reader.ReaderError):  # bytes that are not text
        return f"{e.name} is not a text (UTF-8) file: {e.reason} at byte {e.position}"
    if mark is None:
        return f"not valid YAML: {_one_line(str(e))}"
    problem = ": ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
    return f"{mark.name}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _os_line(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    also = f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
    return f"{e.strerror or _one_line(str(e))}{where}{also}"


class Family(NamedTuple):
    """Exceptions of ``types`` end a command with ``code``, told as ``label: line(e)``; ``once``: the same event
    reaches every process (a signal), so only the main one says it."""

    types: Tuple[Type[BaseException], ...]
    code: int
    label: str
    line: Callable[[BaseException], str] = _message
    once: bool = False


# First match wins. Ours by kind (lipsformer.errors), then the libraries underneath by family.
FAMILIES: List[Family] = [
    Family((Preempted,), PREEMPTED, "preempted", lambda e: f"{_message(e)} (exit code {PREEMPTED}: requeue)", True),
    Family((Interrupted,), INTERRUPTED, "interrupted", _message, True),
    Family((KeyboardInterrupt,), INTERRUPTED, "interrupted", lambda e: "Ctrl-C; what was written before is intact",
           True),
    Family((Mistake, MissingExtra), MISTAKE, "error"),
    Family((DownloadFailed,), FAILED, "error"),
    Family((Stopped,), STOPPED, "stopped"),
    Family((yaml.YAMLError,), MISTAKE, "error", _yaml_line),
    Family((UnicodeDecodeError,), MISTAKE, "error", lambda e: f"a file that should be text (UTF-8) is not: {e}"),
    Family((SafetensorError,), MISTAKE, "error", lambda e: f"cannot read a safetensors file: {_message(e)}"),
    Family((pickle.UnpicklingError,), MISTAKE, "error", lambda e: f"cannot read a pickled file: {_message(e)}"),
    Family((UnidentifiedImageError, Image.DecompressionBombError), MISTAKE, "error",
           lambda e: f"cannot read an image: {_message(e)}"),
    Family((FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError), MISTAKE,
           "error", _os_line),
    Family((urllib.error.URLError, ConnectionError, TimeoutError), FAILED, "error",
           lambda e: f"a download failed: {_one_line(getattr(e, 'reason', None) or e)}; check the network"),
    Family((OSError,), STOPPED, "stopped", _os_line),  # disk full, I/O error
]


def family(e: BaseException) -> Optional[Family]:
    """The row of :data:`FAMILIES` that ``e`` belongs to; None for a bug."""
    return next((f for f in FAMILIES if isinstance(e, f.types)), None)


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun / accelerate launch set RANK; a lone process is rank 0


_ROOT = Path(__file__).resolve().parent.parent  # the repository (or site-packages) holding lipsformer


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    if path == Path(__file__).resolve():  # the boundary itself
        return False
    return path.is_relative_to(_ROOT / "lipsformer") or (path.parent == _ROOT and path.suffix == ".py")


def _report_bug(e: BaseException) -> None:
    frames = traceback.extract_tb(e.__traceback__)
    kept = [f for i, f in enumerate(frames) if _ours(f.filename) or i == len(frames) - 1]
    print("Traceback (most recent call last; lipsformer's frames and the one that raised):", file=sys.stderr)
    print("".join(traceback.format_list(kept)), end="", file=sys.stderr)
    print("".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)


def report(e: BaseException) -> int:
    """Tell ``e`` on stderr as the boundary does and return its exit code.

    Launched as several processes (torchrun, ``accelerate launch``), the processes agree first
    (:func:`lipsformer.engine.processes.agree`): a mistake every process found is said once, by the main process,
    and every process exits with its code; one found by some processes only is said by each of them, naming its
    rank. An error that only follows from another process having failed (a collective whose peer is gone) is not
    told again: that process exits with the code the failed one gave."""
    row = family(e)
    if row is None and _multi_process():
        code = failed_elsewhere()
        if code is not None:
            return code
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    elif row is None:
        _report_bug(e)
    if row is None:
        print(f"bug: lipsformer raised an unexpected {type(e).__name__}, which is a bug in lipsformer and not a "
              f"mistake in the input; please report it with the lines above ({TRACEBACK_ENV}=1 shows the full "
              f"traceback)", file=sys.stderr)
        return FAILED
    if row.once:  # the same signal reached every process
        if is_main_process():
            print(f"{row.label}: {row.line(e)}", file=sys.stderr)
        return row.code
    if _multi_process():
        return agree(row.code, row.label, row.line(e))
    print(f"{row.label}: {row.line(e)}", file=sys.stderr)
    return row.code


def _multi_process() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def command(main: Callable[..., Optional[int]]) -> Callable[..., int]:
    """Wrap a command's ``main(argv=None)``: every exception becomes one line and an exit code (:func:`report`);
    ``main`` returning None is 0. The main process ends with a ``wrote:`` line naming every file and folder the
    command wrote (:func:`lipsformer.writer.written`), whatever the exit code. Afterwards the process group, if one
    was started, is destroyed while the interpreter is still whole
    (:func:`lipsformer.engine.processes.end_process_group`), except after a bug or Ctrl-C, where another process may
    still be inside a collective.

    Stopped by a signal (preempted: 75, interrupted: 130), the command ignores further stop signals while it shuts
    down (:func:`lipsformer.errors.hold_stop_signals`), so a second SIGTERM or Ctrl-C keeps that exit code: run as
    the program (``main()``, no ``argv``) until the process ends; called with an ``argv`` (in-process) until it
    returns."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        forget_written()
        as_program = (args[0] if args else kwargs.get("argv")) is None
        try:
            code = main(*args, **kwargs) or DONE
        except SystemExit:  # --help
            raise
        except BaseException as e:  # noqa: BLE001 - the boundary: every exception is told in one line or as a bug
            if isinstance(e, (Preempted, KeyboardInterrupt)):
                hold_stop_signals()
            code = report(e)
            if family(e) is None or code == INTERRUPTED:
                _say_written()
                _release(as_program)
                return code
        _say_written()
        end_process_group()
        _release(as_program)
        return code
    return run


def _release(as_program: bool) -> None:
    if not as_program:  # an in-process caller goes on with its own handlers
        release_stop_signals()


def _say_written() -> None:
    paths = written()
    if paths and is_main_process():
        print(f"wrote: {', '.join(map(str, paths))}", flush=True)


def exit_codes_help() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT.items())


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (examples keep their lines); each option's default where it says something."""

    def _get_help_string(self, action):
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default in ([], {}, ""):
            return action.help
        return super()._get_help_string(action)


class Ignored(NamedTuple):
    """A flag that the mode the other flags choose would ignore: given while ``acts(args)`` is false, the command
    refuses it with the line ``{prog}: {flag} {says}``, which names the flag that decides."""

    flag: str
    says: str  # e.g. "is read only with --dataset imagenet_real"
    acts: Callable[[argparse.Namespace], bool]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in ``--help``, the exit codes as its epilog, and an error that is one line
    (a :class:`~lipsformer.errors.UsageError` for the boundary, not argparse's usage block and ``sys.exit``).

    :meth:`ignored_unless` adds a row to the parser's table of flags a mode ignores (:attr:`ignored`); after
    parsing, a flag given on the command line (``given``: default values do not count) whose row says it would not
    act is refused."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("epilog", exit_codes_help())
        super().__init__(*args, **kwargs)
        self.ignored: List[Ignored] = []
        self.given: Set[str] = set()  # the dests of the options the last parse read from the command line
        self.examples: Dict[str, str] = {}  # an output flag's example file name, for the line that refuses a path

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} ({self.prog} --help lists the options)")

    def ignored_unless(self, flag: str, says: str, acts: Callable[[argparse.Namespace], bool]) -> None:
        self.ignored.append(Ignored(flag, says, acts))

    def flag_dest(self, flag: str) -> str:
        return next(a.dest for a in self._actions if flag in a.option_strings)

    def parse_known_args(self, args=None, namespace=None):
        self.given = set()
        return super().parse_known_args(args, namespace)

    def _get_values(self, action, arg_strings):  # argparse calls it for each option the command line gives
        self.given.add(action.dest)
        return super()._get_values(action, arg_strings)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for row in self.ignored:
            if self.flag_dest(row.flag) in self.given and not row.acts(parsed):
                raise UsageError(f"{self.prog}: {row.flag} {row.says}; drop {row.flag}")
        self.check_outputs(parsed)
        return parsed

    def paths(self, parsed: argparse.Namespace) -> Tuple[List[Output], List[Tuple[str, str]], List[Tuple[str, str]]]:
        """What the parsed command line writes and reads, told by each option's type: the outputs (a type of
        :data:`OUTPUT_TYPES`), the paths it reads (:func:`path`) and the input data (:func:`data_path`), each as
        :func:`lipsformer.writer.check_outputs` takes it. An output's example name (for the line's suggestion) is
        :attr:`examples`' for its flag, else the command's name with the output's suffix."""
        stem = self.prog.split()[-1].rsplit(".", 1)[-1] if self.prog.startswith("python -m") else Path(self.prog).stem
        outputs, reads, data = [], [], []
        for action in self._actions:
            values = getattr(parsed, action.dest, None)
            if values is None or action.type not in (*OUTPUT_TYPES, path, data_path):
                continue
            label = max(action.option_strings, key=len) if action.option_strings else action.dest
            for value in values if isinstance(values, list) else [values]:
                if action.type in OUTPUT_TYPES:
                    example = self.examples.get(label, stem + Path(value).suffix)
                    outputs.append(Output(label, value, OUTPUT_TYPES[action.type], example))
                else:
                    (reads if action.type is path else data).append((label, value))
        return outputs, reads, data

    def check_outputs(self, parsed: argparse.Namespace) -> None:
        """Every output the command line names passes the writers' one check (:func:`lipsformer.writer.check_outputs`:
        nothing a run or an export owns, nothing inside the input data, no file the call reads, no two outputs on one
        path), refused in one line before any work."""
        try:
            check_outputs(*self.paths(parsed))
        except Mistake as e:
            self.error(str(e))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def json_value(text: str):
    """argparse type: JSON (``--model-args '{"img_size": 32}'``), or one line saying where it is not; an object
    that gives a key twice is refused (:func:`lipsformer.settings.unique_pairs`)."""
    try:
        return json.loads(text, object_pairs_hook=unique_pairs)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}; write e.g. '{{\"img_size\": 32}}'") from None
    except SettingError as e:
        raise argparse.ArgumentTypeError(f"{e}: {text}") from None


def data_path(text: str) -> str:
    """argparse type of a flag naming the input data (an image folder): :func:`path`; no output of the call may lie
    inside it (:meth:`ArgumentParser.check_outputs`)."""
    return path(text)


def path(text: str) -> str:
    """argparse type of every flag that names a file or folder: ``~`` and ``$VARIABLES`` expanded
    (:func:`lipsformer.settings.expand_path`); an unset variable is one line naming it."""
    try:
        return expand_path(text, "")
    except SettingError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
