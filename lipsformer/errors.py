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


def did_you_mean(word: str, candidates: Sequence[str], n: int = 3) -> str:
    """`` (did you mean a, b?)`` with the candidates closest to ``word`` (difflib), or ``""`` when none is close."""
    import difflib
    close: List[str] = difflib.get_close_matches(str(word), list(candidates), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""
