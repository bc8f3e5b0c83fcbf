"""The kinds of failure a command tells apart. Deeper code raises a typed error of one of these kinds (ConfigError,
CheckpointError, TooManyBadSamples, ...); it never prints or exits. Each command's one error boundary
(:func:`lipsformer.cli.command`) turns the kind into one line and an exit code from one table
(:data:`lipsformer.cli.EXIT`).

No imports beyond the standard library: every module may raise these.
"""
from typing import List, Sequence


class Mistake(Exception):
    """The input names something to fix (a config key, a flag, a file, a folder): exit 2, nothing written."""


class DownloadFailed(Exception):
    """Published weights could not be fetched (no network, the server refused): exit 1; try again."""


class Stopped(Exception):
    """A run stopped on something found while it ran (divergence, too many unreadable images, a failed write):
    exit 3; what was written before is intact."""


class Preempted(Exception):
    """A preemption signal stopped the run after the step it arrived in, with that step's checkpoint written:
    exit 75 (EX_TEMPFAIL); requeue with --resume auto."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the interrupted work had already written (the newest checkpoint): exit 130."""


class UsageError(Mistake, ValueError):
    """A command-line value that cannot be used (argparse's own errors included)."""


class ConfigError(Mistake, ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


# -- the exit code a stop promised ------------------------------------------------------------------------------------
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")  # a scheduler's (preemption, requeue) and Ctrl-C's
_held: dict = {}  # while held: each stop signal's handler before it was held


def hold_stop_signals() -> None:
    """Ignore the signals that stop a command from now on: once it stops with the exit code a first one promised
    (75 preempted, 130 interrupted), a second one, during the checkpoint's last steps or the shutdown, must not end it
    with another (143 for SIGTERM's default, a traceback for Ctrl-C). The handlers they replace are kept for
    :func:`release_stop_signals`. Python sets handlers on the main thread only; elsewhere nothing is held."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    for name in STOP_SIGNALS:
        sig = getattr(signal, name)
        previous = signal.signal(sig, signal.SIG_IGN)
        _held.setdefault(sig, previous)


def stop_signals_held() -> dict:
    """The handlers held signals had before (empty while none is held); a handler set up for a block that ends
    while they are held (the loop's preemption watch) records its own predecessor here instead of restoring it."""
    return _held


def release_stop_signals() -> None:
    """Give the held stop signals their handlers back (a command run in-process, whose caller goes on)."""
    import signal
    while _held:
        sig, handler = _held.popitem()
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def did_you_mean(word: str, candidates: Sequence[str], n: int = 3) -> str:
    """`` (did you mean a, b?)`` with the candidates closest to ``word`` (difflib), or ``""`` when none is close."""
    import difflib
    close: List[str] = difflib.get_close_matches(str(word), list(candidates), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""
