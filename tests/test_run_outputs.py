"""Around a run: experiment trackers as a config key (``log_with``: wandb offline, MLflow's file store, TensorBoard),
the ``keep_best`` best epochs' weights, and ``summary.csv``. One tiny run of three epochs logs to every tracker that
is installed; it is then resumed mid-way from one of its own checkpoints, and the resumed run must continue the
trackers' runs and end with the files the uninterrupted run wrote. No test reaches the network."""
import csv
import importlib.util
import io
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from conftest import load_script, reset_accelerate
from helpers import TINY_RUN, call, make_folder, mlflow_run, refused, start_mlflow, write_config

from lipsformer.engine.checkpoint import TrainState, keep_best
from lipsformer.config import load_config
from lipsformer.engine.metrics import summary_csv
from lipsformer.run_folder import RunFolder, read_metrics
from lipsformer.engine.trackers import hparams

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

TRAIN = load_script("train.py")
INSTALLED = [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name) is not None]
TIMM_COLUMNS = ["epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr"]


def offline_trackers(monkeypatch, tmp: Path) -> None:
    """wandb offline and MLflow on a local file store, both under ``tmp``: nothing reaches the network."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch


@dataclass
class Runs:
    cfg: object
    run: Path
    tmp: Path
    before: Dict[str, object]  # what the uninterrupted run left: best/ files, summary.csv, epoch rows, trackers.json


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three epochs of two steps (8 training images, EMA on, every installed tracker), keep_best 2; then resumed from
    step 3 (epoch 2 half done) into the same folder."""
    from lipsformer.engine.train import train
    tmp = tmp_path_factory.mktemp("outputs")
    monkeypatch = pytest.MonkeyPatch()
    offline_trackers(monkeypatch, tmp)
    try:
        make_folder(tmp / "data", train_per_class=(2, 2, 2, 2))
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(dict(
            TINY_RUN, epochs=3, checkpoint_every_steps=1, keep_last=20, keep_best=2, tracker_run_name="tiny",
            log_with=["tensorboard", *INSTALLED], data_dir=str(tmp / "data"), output_dir=str(tmp / "run"))))
        cfg = load_config(tmp / "cfg.yaml")
        train(cfg)
        reset_accelerate()
        run = Path(cfg.output_dir)
        before = dict(kept={p.name: p.read_bytes() for p in RunFolder(run).kept_files()},
                      summary=(run / "summary.csv").read_text(), epochs=epoch_rows(run),
                      record=json.loads((run / "trackers.json").read_text()) if INSTALLED else {})
        train(cfg, resume=str(run / "checkpoints" / "step_000000003"))
        reset_accelerate()
    finally:
        monkeypatch.undo()
    return Runs(cfg, run, tmp, before)


def epoch_rows(run: Path) -> List[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "epoch"]


def logged_numbers(run: Path) -> Dict[tuple, float]:
    """``(KIND/KEY, step) -> value`` of every finite number of every metrics.jsonl row, as trackers receive them."""
    return {(f"{r['kind']}/{k}", r["step"]): v for r in read_metrics(run / "metrics.jsonl") for k, v in r.items()
            if k not in ("kind", "step") and isinstance(v, (int, float)) and v == v}


# -- wandb's offline files -----------------------------------------------------------------------------------------
def wandb_records(path: Path):
    """The records of a ``.wandb`` file: W&B's LevelDB-style log (a 7-byte header ``:W&B``, 0xBEE1, version; 32 KiB
    blocks of chunks, each with a 7-byte header: checksum, length, type 1 full / 2 first / 3 middle / 4 last), each
    record a ``wandb_internal_pb2.Record``. wandb's own Python reader is gone from its package."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(tmp: Path) -> dict:
    """Every offline run under ``tmp/wandb`` in the order written: ids, names, config, and ``(key, step) -> value``
    (a later value of a key at a step wins, as metrics.jsonl keeps the resumed run's rows)."""
    out = dict(ids=[], names=[], projects=[], config={}, values={})
    for path in sorted(tmp.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime_ns):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(record.run.run_id)
                out["names"].append(record.run.display_name)
                out["projects"].append(record.run.project)
            elif kind == "config":
                out["config"].update({_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in record.history.item}
                out["values"].update({(k, record.history.step.num): v for k, v in items.items()
                                      if not k.startswith("_")})
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


# -- trackers ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_gets_the_config_and_every_row_and_a_resume_continues_its_run(runs, name):
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install -e \".[{name}]\"; the dev extra has it)")
    record = runs.before["record"]
    assert json.loads((runs.run / "trackers.json").read_text()) == record  # the resume continued, nothing new
    config = hparams(runs.cfg)
    assert config["model_kwargs.depths"] == "[1, 1, 1, 1]" and config["log_with"] == json.dumps(runs.cfg.log_with)
    expected = logged_numbers(runs.run)
    assert ("epoch/top1", 6) in expected and ("train/loss", 4) in expected
    if name == "wandb":
        got = wandb_run(runs.tmp)
        assert got["ids"] == [record["wandb"]["id"]] * 2  # the first start and the resume: one run
        assert set(got["names"]) == {"tiny"} and set(got["projects"]) == {"lipsformer"}
        assert {k: got["config"][k] for k in config} == config
    else:
        got = mlflow_run(runs.tmp, record["mlflow"]["run_id"])
        assert got["runs"] == [record["mlflow"]["run_id"]] and got["experiment"] == "lipsformer"
        assert got["run"].info.run_name == "tiny" and got["run"].info.status == "FINISHED"
        assert got["run"].data.params == {k: str(v) for k, v in config.items()}
    assert got["values"] == expected


def test_tensorboard_writes_where_it_always_did_with_the_config_as_its_hparams(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    files = sorted((runs.run / "lipsformer").glob("events.out.tfevents*"))
    assert len(files) == 2  # one per start, and no hparams folder beside them
    assert sorted((runs.run / "lipsformer").iterdir()) == files
    for path in files:
        events = EventAccumulator(str(path)).Reload()
        start = plugin_data_pb2.HParamsPluginData.FromString(
            events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
        kept = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}  # numbers as floats
        assert kept == {k: v for k, v in hparams(runs.cfg).items() if v is not None}  # TensorBoard has no null
    assert "epoch/top1" in EventAccumulator(str(files[0])).Reload().Tags()["scalars"]


def test_a_missing_tracker_package_or_an_unknown_tracker_is_one_line_and_nothing_is_written(tmp_path, capsys,
                                                                                              monkeypatch):
    config = write_config(tmp_path, epochs=1)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    argv = ["--config", config, "--set"]
    refused(capsys, TRAIN.main, argv + ["log_with=tensorboard,wandb"], tmp_path, "log_with wandb needs wandb",
            'pip install "lipsformer[wandb]"')
    if importlib.util.find_spec("aim") is None:  # a tracker without an extra of ours: its own package named
        refused(capsys, TRAIN.main, argv + ["log_with=aim"], tmp_path, "log_with aim needs aim", "pip install aim")
    refused(capsys, TRAIN.main, argv + ["log_with=wandbb"], tmp_path, "log_with must be one of",
            "got 'wandbb' (did you mean wandb")
    refused(capsys, TRAIN.main, argv + ["log_with=none"], tmp_path, "got 'none'; [] for none")
    refused(capsys, TRAIN.main, argv + ["log_with="], tmp_path,
            "log_with must be a list, got null (an empty list is [])")
    written = tmp_path / "comma.yaml"  # YAML takes a comma-separated string as one name
    written.write_text(config.read_text() + "log_with: tensorboard,mlflow\n")
    refused(capsys, TRAIN.main, ["--config", written], tmp_path,
            "got 'tensorboard,mlflow': a list is written [tensorboard, mlflow]")


def test_a_tracker_that_cannot_start_is_one_line_and_the_run_writes_none_of_its_files(tmp_path, capsys,
                                                                                        monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (the dev extra has it)")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
    config = write_config(tmp_path, epochs=1, log_with=["tensorboard", "mlflow"])
    code, _, err = call(capsys, TRAIN.main, ["--config", config])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: log_with mlflow: its run did not start (") and "nosuchscheme" in lines[0]
    assert lines[0].endswith("; fix its settings or leave mlflow out of log_with"), lines[0]
    assert not [p for p in (tmp_path / "run").rglob("*")]  # TensorBoard starts last: no events either


def test_a_trackers_own_error_is_said_whole_with_the_advice_it_ends_with(tmp_path, capsys, monkeypatch):
    """MLflow 3 refuses a file store in a long line whose last words name the fix (MLFLOW_ALLOW_FILE_STORE=true)."""
    from accelerate import tracking

    class Refusing:
        requires_logging_directory = False

        def __init__(self, *args, **kwargs):
            raise RuntimeError("The filesystem tracking backend is in maintenance mode. " + "Migrate. " * 40
                               + "If it is required, set `ALLOW_IT=true` to opt out of this exception.")

    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, "mlflow", Refusing)
    code, _, err = call(capsys, TRAIN.main, ["--config", write_config(tmp_path, epochs=1, log_with=["mlflow"])])
    assert code == 2 and "set `ALLOW_IT=true` to opt out of this exception.); fix its settings" in err, err


# -- the best k -------------------------------------------------------------------------------------------------------
def test_the_best_k_epochs_are_kept_by_score_and_a_resumed_run_keeps_the_same_files(runs):
    from safetensors.torch import load_file
    rows = runs.before["epochs"]
    scores = [(r["epoch"], max(r["top1"], r["ema_top1"])) for r in rows]
    ranked = sorted(scores, key=lambda s: (-s[1], s[0]))[:2]
    names = sorted(f"epoch_{e:03d}_top1_{s:.2f}.safetensors" for e, s in ranked)
    assert sorted(runs.before["kept"]) == names
    first = RunFolder(runs.run).best_kept(*ranked[0])
    best = load_file(str(runs.run / "best.safetensors"))
    assert all(load_file(str(first))[k].equal(v) for k, v in best.items())  # the first of them is best.safetensors
    kept = {p.name: p.read_bytes() for p in RunFolder(runs.run).kept_files()}
    assert kept == runs.before["kept"]  # resumed mid-way: the same files, byte for byte


class _Main:
    """What keep_best asks of an Accelerator, on one process."""
    is_main_process = True

    @staticmethod
    def get_state_dict(model):
        return model.state_dict()


def test_ties_keep_the_earlier_epoch_and_a_file_that_drops_out_is_removed(tmp_path, caplog):
    """A file that drops out of the ranking is removed; one removed for another reason than a better epoch (written
    after the checkpoint resumed from, or cut by a keep_best lowered on resume) is named in a warning."""
    import contextlib
    import torch
    model = torch.nn.Linear(2, 2)
    folder, state = RunFolder(tmp_path), TrainState()
    cfg = load_config(None, ["keep_best=2", "img_size=8"])
    stale = folder.best_kept(9, 99.0)  # written after the checkpoint a run resumed from
    stale.parent.mkdir()
    stale.write_bytes(b"x")
    best = []
    with caplog.at_level("WARNING"):
        for epoch, top1 in enumerate([50.0, 60.0, 60.0, 40.0, 70.0, 60.0], start=1):
            state.epoch = epoch
            best.append(keep_best(_Main, model, contextlib.nullcontext, folder, state, top1, cfg))
    assert best == [True, True, False, False, True, False]  # best.safetensors: strictly better only
    assert state.best_k == [[5, 70.0], [2, 60.0]]
    assert [p.name for p in folder.kept_files()] == ["epoch_002_top1_60.00.safetensors",
                                                       "epoch_005_top1_70.00.safetensors"]
    assert [r.getMessage() for r in caplog.records] == [  # a better epoch's removal is the ranking's own: unsaid
        f"keep_best: removed {stale}, which the ranking of the checkpoint this run resumed from does not name "
        f"(written after that checkpoint)"]
    caplog.clear()
    state.epoch = 7
    with caplog.at_level("WARNING"):
        keep_best(_Main, model, contextlib.nullcontext, folder, state, 10.0, load_config(None, ["keep_best=1"]))
    assert state.best_k == [[5, 70.0]] and [p.name for p in folder.kept_files()] == ["epoch_005_top1_70.00.safetensors"]
    assert [r.getMessage() for r in caplog.records] == [
        f"keep_best is 1, lower than the 2 best the run kept before: removed {folder.best_kept(2, 60.0)}"]
    state.epoch = 8
    keep_best(_Main, model, contextlib.nullcontext, folder, state, 10.0, load_config(None, ["keep_best=0"]))
    assert state.best_k == [] and folder.kept_files() == []


# -- summary.csv ----------------------------------------------------------------------------------------------------
def test_summary_csv_is_timms_columns_then_ours_one_row_per_epoch_from_the_metrics_rows(runs, tmp_path):
    from timm.utils import update_summary
    text = (runs.run / "summary.csv").read_text()
    assert text == runs.before["summary"]  # the resumed run's summary is the uninterrupted one's
    table = list(csv.DictReader(io.StringIO(text)))
    rows = epoch_rows(runs.run)
    assert list(table[0]) == TIMM_COLUMNS + ["ema_eval_loss", "ema_eval_top1", "ema_eval_top5", "best"]
    for line, r in zip(table, rows, strict=True):
        assert [float(line[c]) for c in TIMM_COLUMNS] == [r["epoch"], r["train_loss"], r["val_loss"], r["top1"],
                                                          r["top5"], r["lr"]]
        assert float(line["ema_eval_top1"]) == r["ema_top1"] and line["best"] == r.get("best", "")
    # timm's own writer, given the same figures, writes the same columns with the same text
    for r in rows:
        update_summary(r["epoch"], dict(loss=r["train_loss"]), dict(loss=r["val_loss"], top1=r["top1"],
                                                                     top5=r["top5"]), tmp_path / "timm.csv", lr=r["lr"])
    timm = list(csv.reader(io.StringIO((tmp_path / "timm.csv").read_text())))
    assert [row[:6] for row in csv.reader(io.StringIO(text))] == timm


def test_summary_csv_leaves_a_figure_an_epoch_did_not_have_empty():
    rows = [dict(kind="train", step=1, loss=2.0), dict(kind="epoch", step=3, epoch=1, train_loss=2.0, lr=0.1),
            dict(kind="epoch", step=6, epoch=2, train_loss=1.5, lr=0.05, top1=50.0, top5=90.0, val_loss=None,
                 lipschitz_bound=3.5)]
    assert summary_csv(rows) == ("epoch,train_loss,eval_loss,eval_top1,eval_top5,lr,lipschitz_bound\n"
                                 "1,2.0,,,,0.1,\n2,1.5,,50.0,90.0,0.05,3.5\n")


def test_trackers_project_and_run_name_reach_the_tracker(tmp_path):
    """tracker_project / tracker_run_name as MLflow's experiment and run name (wandb: above)."""
    got = start_mlflow(tmp_path, tmp_path / "one", ["tracker_project=proj", "tracker_run_name=named"])
    assert (got["experiment"], got["run"].info.run_name) == ("proj", "named")
    got = start_mlflow(tmp_path, tmp_path / "two", [])
    assert (got["experiment"], got["run"].info.run_name) == ("lipsformer", "two")  # output_dir's folder name
