"""Experiment trackers (``log_with``): Accelerate's own tracker classes, started by the main process once the run
holds its folder, fed every ``metrics.jsonl`` row by :class:`~.metrics.MetricsLog` through ``Accelerator.log`` (main
process only) and finished by ``Accelerator.end_training``, or by :class:`Trackers` with a failed status when the run
stops on an error.

TensorBoard writes ``OUTPUT_DIR/lipsformer/`` whatever ``tracker_project`` (the other trackers' project: the wandb
project, the MLflow experiment), the config as hparams in its one events file. A new tracker run gets the config as
flat values (:func:`hparams`); ``trackers.json`` in the run folder records what continues the runs of the trackers
that can continue one (wandb's run ``id``, MLflow's ``run_id``), and a resumed run passes it back, so its rows go on
in the same tracker run.
"""
import logging
from typing import Any, Callable, Dict, List

from ..errors import Mistake, Preempted
from ..extras import TRACKERS, MissingExtra, require
from ..run_folder import on_main
from ..settings import SettingError, read_json
from ..writer import TRACKER, to_json, write_json

_logger = logging.getLogger(__name__)

# The keyword of a tracker's run that names it (tracker_run_name); the others keep Accelerate's naming.
RUN_NAME = {"wandb": "name", "mlflow": "run_name"}
# What continues a run a tracker started: its keywords, recorded in trackers.json and passed back on resume.
CONTINUE: Dict[str, Callable[[Any], dict]] = {
    "wandb": lambda tracker: dict(id=tracker.run.id, resume="allow"),
    "mlflow": lambda tracker: dict(run_id=tracker.active_run.info.run_id),
}


class TrackerError(Mistake):
    """A tracker of ``log_with`` could not start its run (no login, an unreachable server, a refused store): exit 2,
    none of the run's own files written."""


def check_installed(names: List[str]) -> None:
    """A MissingExtra naming what to install for the first tracker of ``names`` whose package is missing."""
    for name in names:
        module, install = TRACKERS[name]
        if install.startswith("lipsformer["):
            require(module, install[len("lipsformer["):-1], f"log_with {name}")
            continue
        try:
            __import__(module)
        except ImportError as e:
            raise MissingExtra(f"log_with {name} needs {module}, which is not installed ({e}): "
                               f"pip install {install}") from None


def hparams(cfg) -> Dict[str, Any]:
    """The config as the flat values every tracker takes: a mapping's keys joined with dots
    (``model_kwargs.embed_dim``), a list as its JSON text."""
    flat: Dict[str, Any] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (list, tuple)):
            flat[prefix] = to_json(list(value))
        else:
            flat[prefix] = value
    walk("", cfg.to_dict())
    return flat


def read_record(path) -> Dict[str, dict]:
    """What ``trackers.json`` records (none when it does not exist): each tracker's keys that continue its run. A
    file of another shape is a SettingError naming it."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        return {}
    if not isinstance(record, dict) or not all(isinstance(keys, dict) for keys in record.values()):
        raise SettingError(f"{path}: not a record of tracker runs (an object of tracker name: the keys that continue "
                           f"its run); restore it as the run wrote it, or remove it to start new tracker runs")
    return record


def _tensorboard(root):
    """Accelerate's TensorBoard tracker writing ``root/lipsformer/``, the config written as hparams into its own
    events file (Accelerate's writes a second events file and a YAML file in a folder per start)."""
    from accelerate.tracking import TensorBoardTracker
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    class TensorBoard(TensorBoardTracker):
        def store_init_configuration(self, values: dict) -> None:
            for summary in hparams_summaries(values, {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.flush()
    return TensorBoard(TRACKER, root)


class Trackers:
    """The run's trackers. Checks at once that each tracker's package is installed (:func:`check_installed`);
    :meth:`start` starts them. As a context manager it finishes them when the run stops on an error, with a failed
    status (wandb's exit code 1, MLflow's ``KILLED`` for a preempted or interrupted run, else ``FAILED``), so that a
    later start in the same process is not refused by a run still active."""

    def __init__(self, names: List[str]):
        check_installed(names)
        self.accelerator = None

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None and self.accelerator is not None:
            _finish_failed(self.accelerator, error)

    def start(self, accelerator, cfg, folder, resumed: bool) -> None:
        """Start every tracker of ``cfg.log_with`` on the main process, TensorBoard (which writes in the run folder)
        last; a tracker run recorded in ``trackers.json`` is continued when ``resumed``, a new one gets the config.
        A tracker that cannot start raises a TrackerError on every process."""
        self.accelerator = accelerator
        on_main(accelerator, lambda: _start(accelerator, cfg, folder, resumed))


def _start(accelerator, cfg, folder, resumed: bool) -> None:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS
    record = read_record(folder.tracker_runs) if resumed else {}
    before = dict(record)
    run_name = cfg.tracker_run_name or folder.root.name
    for name in sorted(cfg.log_with, key=lambda n: n == "tensorboard"):  # a stable sort: the order given
        kwargs = dict(record.get(name, {}))
        if name in RUN_NAME:
            kwargs[RUN_NAME[name]] = run_name
        kind = LOGGER_TYPE_TO_CLASS[name]
        try:
            if name == "tensorboard":
                tracker = _tensorboard(folder.root)
            elif kind.requires_logging_directory:
                tracker = kind(cfg.tracker_project, accelerator.logging_dir, **kwargs)
            else:
                tracker = kind(cfg.tracker_project, **kwargs)
            tracker.start()
            accelerator.trackers.append(tracker)
            if name not in record:
                tracker.store_init_configuration(hparams(cfg))
        except Exception as e:  # noqa: BLE001 - the tracker's own error, said in one line
            said = (str(e).strip().splitlines() or [type(e).__name__])[0]  # whole: its advice often comes last
            said = said if len(said) <= 1000 else said[:1000].rsplit(" ", 1)[0] + " ..."
            again = (f"; it continues the run recorded in {folder.tracker_runs}: remove {name!r} there to start a "
                     f"new one" if name in record else "")
            raise TrackerError(f"log_with {name}: its run did not start ({type(e).__name__}: {said}){again}; fix its "
                               f"settings or leave {name} out of log_with") from None
        if name in CONTINUE:
            record[name] = CONTINUE[name](tracker)
    if record != before:
        write_json(folder.tracker_runs, record)


def _finish_failed(accelerator, error: BaseException) -> None:
    stopped = isinstance(error, (Preempted, KeyboardInterrupt))
    for tracker in accelerator.trackers:
        try:
            if tracker.name == "wandb":
                tracker.run.finish(exit_code=1)
            elif tracker.name == "mlflow":
                import mlflow
                mlflow.end_run(status="KILLED" if stopped else "FAILED")
            else:
                tracker.finish()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to tell
            _logger.warning(f"log_with {tracker.name}: could not finish its run ({e})")
    accelerator.trackers.clear()

