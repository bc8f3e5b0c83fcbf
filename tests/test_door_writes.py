"""The disk door: every file a command writes goes through lipsformer.writer, generated rather than listed. Each
command runs once with the writer's commit wrapped, which finds its writes (target and call site); then each call
site's write fails with ENOSPC, EROFS, ENOTDIR and EACCES injected there, and the command must stop with exit 3 in one
line naming the target and the cause, no traceback, no temporary or partial file left, and nothing written before
lost. A real full tmpfs, two runs racing for one folder, a run stopped before its first checkpoint, strict JSON, output
paths and the data writers' folders complete the door.
"""
import ast
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, TINY
from helpers import EVAL, TRAIN, call, interrupted, refused, snapshot
from lipsformer import writer

pytestmark = pytest.mark.usefixtures("fresh_accelerate")
ERRORS = (errno.ENOSPC, errno.EROFS, errno.ENOTDIR, errno.EACCES)


# -- the writer, wrapped --------------------------------------------------------------------------------------------
def _call_site() -> str:
    """``file:function`` of the code that asked the writer to write."""
    import traceback
    for frame in reversed(traceback.extract_stack()):
        if Path(frame.filename).name not in ("writer.py", "contextlib.py", "test_door_writes.py"):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.name}"
    raise AssertionError("no caller")


class Writes:
    """``writer._commit`` wrapped: records each write as ``(target, call site)``; once :meth:`arm`-ed, the write
    numbered ``fail`` (1-based) raises ``OSError(error)`` instead, after noting what its target held
    (``before``)."""

    def __init__(self, monkeypatch):
        self.arm(0)
        real = writer._commit

        def commit(path, finish):
            self.seen.append((Path(path), _call_site()))
            if len(self.seen) == self.fail:
                self.before = Path(path).read_bytes() if Path(path).is_file() else None
                raise OSError(self.error, os.strerror(self.error), str(path))
            return real(path, finish)
        monkeypatch.setattr(writer, "_commit", commit)

    def arm(self, fail: int, error: int = errno.ENOSPC) -> None:
        self.seen, self.fail, self.error, self.before = [], fail, error, None


def leftovers(root: Path) -> list:
    return [p for p in root.rglob("*") if p.name.startswith((writer.TMP_PREFIX, writer.OLD_PREFIX))]


@pytest.fixture(scope="module")
def fakes():
    """Small stand-ins for the data writers' sources: 20 digits each."""
    import numpy as np
    from sklearn.utils import Bunch
    rng = np.random.default_rng(0)
    return dict(digits=Bunch(images=rng.integers(0, 17, (20, 8, 8)).astype(float), target=np.arange(20) % 10),
                mnist=(rng.integers(0, 256, (20, 28, 28)).astype(np.uint8), np.arange(20) % 10))


def commands(base: Path, out: Path) -> dict:
    """Every command that writes, with arguments that write everything it can into ``out``."""
    from lipsformer import convert, flops
    from lipsformer.data import digits, mnist
    from lipsformer.lipschitz.__main__ import main as lipschitz
    return {
        "train.py": (TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", out / "run"]),
        "eval.py": (EVAL.main, ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers", 0,
                                "--predictions", out / "p.csv", "--output", out / "r.json"]),
        "lipschitz": (lipschitz, ["--model", "lipsformer_swin_t", "--model-args", json.dumps(TINY["swin"]),
                                  "--json", out / "b.json", "--plot", out / "b.png"]),
        "flops": (flops.main, ["--models", "lipsformer_swin_t", "--no-flops", "--json", out / "f.json"]),
        "convert": (convert.main, [base / "run", "--out", out / "export"]),
        "digits": (digits.main, [out / "digits"]),
        "mnist": (mnist.main, [out / "mnist"]),
    }


@pytest.fixture
def sources(fakes, monkeypatch):
    """The data writers' stand-ins, and the toolkit's report computed once (the writes are what is tested)."""
    import sklearn.datasets
    import lipsformer.lipschitz.__main__ as toolkit
    from lipsformer.data import mnist
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: fakes["digits"])
    monkeypatch.setattr(mnist, "load_mnist_5k", lambda: fakes["mnist"])
    report, real = [], toolkit.lipschitz_report
    monkeypatch.setattr(toolkit, "lipschitz_report", lambda model: report[0] if report else
                        report.append(real(model)) or report[0])


@pytest.mark.parametrize("name", ["train.py", "eval.py", "lipschitz", "flops", "convert", "digits", "mnist"])
def test_every_write_of_every_command_that_fails_stops_in_one_line_and_keeps_what_was_there(
        base, sources, capsys, monkeypatch, tmp_path, name):
    # what the command writes, found by wrapping the writer; the command names every path in its wrote: line
    main, argv = commands(base, tmp_path / "found")[name]
    writes = Writes(monkeypatch)
    code, out, _ = call(capsys, main, argv)
    assert code == 0 and writes.seen, (name, code)
    wrote = next(line for line in out.splitlines() if line.startswith("wrote: "))
    assert set(wrote[len("wrote: "):].split(", ")) == {str(p) for p, _ in writes.seen if p.exists()}, wrote
    sites = {}
    for k, (_, site) in enumerate(writes.seen, 1):
        sites.setdefault(site, k)
    files = {p.name for p, _ in writes.seen if p.parent == tmp_path / "found" and p.is_file()}  # given by name
    assert len(sites) >= {"train.py": 7, "eval.py": 2, "lipschitz": 2}.get(name, 1), sites
    # every error at the command's first write (train.py: one, each of its writes costing a start), then one each,
    # in turn, at the first write of every other call site, over earlier files of the same names
    first = ERRORS[:1] if name == "train.py" else ERRORS
    cases = [(1, e) for e in first] + [(k, ERRORS[(len(first) + i) % 4])
                                       for i, k in enumerate(sorted(sites.values())[1:])]
    for k, error in cases:
        out = tmp_path / f"{k}-{errno.errorcode[error]}"
        out.mkdir()
        for name_ in ["kept.txt", *files]:  # an earlier file where the command writes one: kept when it fails
            (out / name_).write_text("written before the command")
        main, argv = commands(base, out)[name]
        before = snapshot(base)
        writes.arm(k, error)
        code, _, err = call(capsys, main, argv)
        target, site = writes.seen[k - 1]
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 3 and len(lines) == 1 and "Traceback" not in err, (name, site, err)
        assert lines[0].startswith("stopped: could not write ") and str(target) in lines[0], (site, lines[0])
        assert f"{os.strerror(error)} ({errno.errorcode[error]}" in lines[0], lines[0]
        assert not leftovers(out), (site, leftovers(out))
        if writes.before is None or target.name == ".lock":  # no partial file or folder (the lock file: made
            assert not target.exists(), (site, target)  # empty by the lock, removed when it is let go)
        else:  # what the target held is as it was: no partial row
            assert target.read_bytes() == writes.before, site
        for earlier, _ in writes.seen[:k - 1]:  # what the command wrote before the failure is there (but the run
            assert earlier.exists() or earlier.name == ".lock" or earlier.parent.name == "checkpoints", earlier  # lock)
        assert (out / "kept.txt").read_text() == "written before the command" and snapshot(base) == before


def test_no_command_writes_around_the_writer():
    """Every call that writes a file in lipsformer/, train.py and eval.py (``open`` for writing, a method that writes
    a file, ``torch.save``) is inside a ``with replacing(...)`` block (into the temporary it names) or in the writer
    itself; the one other is the checkpoint's manifest, written into the checkpoint's temporary folder inside
    save_checkpoint's block."""
    inside_a_temporary = {("lipsformer/engine/checkpoint.py", "write_manifest")}
    methods = {"write_text", "write_bytes", "savefig", "save_file", "save_for_hf", "save_state", "dump", "touch"}
    found = []
    for path in [*ROOT.glob("lipsformer/**/*.py"), ROOT / "train.py", ROOT / "eval.py"]:
        rel = str(path.relative_to(ROOT))
        if rel == "lipsformer/writer.py":
            continue
        tree = ast.parse(path.read_text())
        parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def within(node, test):
            while node in parent:
                node = parent[node]
                if test(node):
                    return node
            return None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            method = isinstance(f, ast.Attribute) and (f.attr in methods or f.attr == "save" and
                                                       getattr(f.value, "id", "") == "torch")
            opened = getattr(f, "id", "") == "open" and any(
                isinstance(a, ast.Constant) and set(str(a.value)) & set("wax+") for a in node.args[1:2])
            guarded = within(node, lambda n: isinstance(n, ast.With) and any(
                getattr(getattr(i.context_expr, "func", None), "id", "") == "replacing" for i in n.items))
            function = within(node, lambda n: isinstance(n, ast.FunctionDef))
            if (method or opened) and not guarded and (rel, getattr(function, "name", "")) not in inside_a_temporary:
                found.append(f"{rel}:{node.lineno}")
    assert not found, found


# -- a real full disk -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(path: Path, size: str = "256k"):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):
        while True:
            os.write(fd, b"\0" * 512)
    os.close(fd)


def test_a_real_full_disk_stops_the_command_in_one_line_and_leaves_no_partial_file(base, capsys, tmp_path):
    from lipsformer import flops
    with small_disk(tmp_path / "small") as disk:
        # a run whose checkpoint does not fit: its first files do, then the checkpoint fills the disk
        out = disk / "run"
        code, _, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", out])
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 3 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"stopped: could not write checkpoint {out}/checkpoints/step_000000002: No space "
                                   f"left on device (ENOSPC, at {out}/checkpoints/.tmp-step_000000002"), lines[0]
        assert lines[0].endswith("the partial folder was removed and no earlier checkpoint is intact: free space and "
                                 "continue with --resume auto")
        assert not leftovers(disk) and not (out / ".lock").exists()
        assert yaml.safe_load((out / "config.yaml").read_text())["epochs"] == 1  # written before: intact
        assert [r["kind"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [
            "init", "train", "train"]
        # a full disk: the JSON of a command
        fill(disk)
        before = snapshot(disk)
        line = refused(capsys, flops.main, ["--models", "lipsformer_swin_t", "--no-flops", "--json", disk / "f.json"],
                       disk, f"stopped: could not write {disk}/f.json: No space left on device (ENOSPC)", code=3)
        assert line.endswith("nothing was written there") and snapshot(disk) == before


# -- one writer per run folder --------------------------------------------------------------------------------------
# another train.py as the folder's lock sees it (RunLock's record lock and content), without the imports of one
HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), started="today")).encode())
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_dead_holders_lock_is_taken_over(base, capsys):
    """A run stopped after step 3 (checkpoint 2 written: the finished run without its later files); another process
    holds its folder: --resume auto is refused naming that process, and nothing is written. Killed (kill -9), its lock
    file stays: the next --resume auto takes it over and ends the run, each step logged once."""
    run = base / "raced"
    shutil.copytree(base / "run", run)
    for later in ("checkpoints/step_000000004", "last.safetensors", "best.safetensors", "curves.png"):
        writer.remove(run / later)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", run, "--resume", "auto"], run,
                f"error: output_dir {run} is in use by another train.py (pid {holder.pid} on host "
                f"{socket.gethostname()}, started today; ",
                f"its lock {run}/.lock): wait for it to end or choose another output_dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((run / ".lock").read_text())["pid"] == holder.pid  # left by the killed holder
    code, out, err = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", run, "--resume", "auto"])
    assert code == 0 and f"resumed from {run}/checkpoints/step_000000002" in out, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4] and not (run / ".lock").exists()


def test_a_start_after_one_that_left_no_checkpoint_begins_afresh_and_keeps_its_outputs_aside(base, capsys,
                                                                                               monkeypatch):
    """A run that stopped before its first checkpoint (Ctrl-C in step 1) left config.yaml, an init row and
    TensorBoard events: the next start moves them to attempt-1/ and writes the folder afresh, so no row is written
    twice and nothing is lost."""
    run = base / "afresh"
    assert interrupted(capsys, monkeypatch, ["--config", base / "cfg.yaml", "--output-dir", run], 1)[0] == 130
    dead = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert {"config.yaml", "metrics.jsonl"} <= {str(p) for p in dead} and any("tfevents" in str(p) for p in dead)
    code, out, _ = call(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", run, "--resume", "auto"])
    assert code == 0 and (f"{run} held the outputs of an earlier start that left no checkpoint: moved to "
                          f"{run}/attempt-1; this run starts the folder afresh") in out
    assert {p: (run / "attempt-1" / p).read_bytes() for p in dead} == dead  # nothing lost
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows if r["kind"] != "epoch"] == [
        ("init", 0), ("train", 1), ("train", 2), ("train", 3), ("train", 4)]
    assert len(list((run / "lipsformer").rglob("*tfevents*"))) == 1


# -- strict JSON ----------------------------------------------------------------------------------------------------
def test_results_json_is_strict_a_bound_that_is_not_finite_is_null_with_its_reason(base, capsys, tmp_path):
    """The tiny Swin's SCSA (the released defaults) has no finite certified bound: eval.py --output wrote
    "lipschitz": Infinity, which strict parsers refuse."""
    def strict(token):
        raise ValueError(f"not JSON: {token}")
    code, _, err = call(capsys, EVAL.main, ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers",
                                             0, "--certify-eps", 0.1, "--output", tmp_path / "r.json"])
    assert code == 0, err
    robustness = json.loads((tmp_path / "r.json").read_text(), parse_constant=strict)["robustness"]
    assert robustness["lipschitz"] is None and robustness["network_bound"] is None
    assert robustness["lipschitz_reason"] == robustness["reason"] and "infinite" in robustness["reason"]
    assert writer.to_json({"a": float("nan"), "b": [float("-inf")]}) == \
        '{"a": null, "a_reason": "not a number", "b": [null]}'


# -- output paths ---------------------------------------------------------------------------------------------------
def test_every_file_output_naming_a_folder_is_refused_before_any_work(base, capsys, monkeypatch):
    """Found from the parsers: every option whose type is a file to write (writer.output_file / output_figure)."""
    from lipsformer import cli, flops
    from lipsformer.lipschitz.__main__ import main as lipschitz
    parsers = []
    real = cli.ArgumentParser.parse_args
    monkeypatch.setattr(cli.ArgumentParser, "parse_args",
                        lambda self, *a, **k: parsers.append(self) or real(self, *a, **k))
    valid = {"eval.py": (EVAL.main, ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers", 0]),
             "lipschitz": (lipschitz, ["--model", "lipsformer_swin_t"]),
             "flops": (flops.main, ["--models", "lipsformer_swin_t", "--no-flops"])}
    cases = []
    for name, (main, argv) in valid.items():
        with pytest.raises(SystemExit), contextlib.redirect_stdout(None):
            main(["--help"])
        cases += [(name, a.option_strings[-1]) for a in parsers[-1]._actions
                  if a.type in (writer.output_file, writer.output_figure)]
    assert sorted(cases) == [("eval.py", "--output"), ("eval.py", "--predictions"), ("flops", "--json"),
                             ("lipschitz", "--json"), ("lipschitz", "--plot")]
    for name, flag in cases:
        main, argv = valid[name]
        refused(capsys, main, [*argv, flag, base / "data"], base, f"argument {flag}: {base / 'data'} is a folder; "
                                                                  f"name the file to write")
        refused(capsys, main, [*argv, flag, base / "a_file" / "x.png"], base, f"argument {flag}: ",
                f"{base / 'a_file'} is a file, not a folder")


def _commands(base: Path) -> dict:
    """Every command: its ``main``, its parser, a call that would run (an output flag is added to it) and what the
    call reads as data (the folder outputs must stay out of) and as a file (``READ``, which no output may be)."""
    from lipsformer import convert, flops
    from lipsformer.data import digits, mnist
    from lipsformer.lipschitz import __main__ as toolkit
    read = base / "read.pth"  # a weight file the call reads
    return {
        "train.py": (TRAIN.main, TRAIN.build_parser(), ["--config", base / "cfg.yaml", "--data-dir", base / "data"],
                     "--data-dir", None),
        "eval.py": (EVAL.main, EVAL.build_parser(), ["--checkpoint", base / "run", "--data-dir", base / "data",
                                                      "--workers", 0], "--data-dir", None),
        "lipschitz": (toolkit.main, toolkit.build_parser(), ["--model", "lipsformer_swin_t", "--checkpoint", read],
                      None, read),
        "flops": (flops.main, flops.build_parser(), ["--models", "lipsformer_swin_t", "--no-flops"], None, None),
        "convert": (convert.main, convert.build_parser(), [read, "--model", "lipsformer_swin_t"], None, read),
        "digits": (digits.main, digits.build_parser(), [], None, None),
        "mnist": (mnist.main, mnist.build_parser(), [], None, None),
    }



def test_every_output_of_every_command_passes_the_one_check_of_outputs(base, capsys):
    """Found from the parsers (an output is an option of an output type: cli.OUTPUT_TYPES), for every command:
    each output that would overwrite what a training run owns is refused, one inside the input data is refused, one
    that is a file the call reads is refused, and two outputs of one call on one path are refused: one line, exit 2,
    nothing written. (Every option that names a path has a path type: tests/test_door_settings.py.)"""
    from lipsformer import cli
    shutil.copy(base / "run" / "last.safetensors", base / "read.pth")
    found = []
    for name, (main, parser, argv, data, read) in _commands(base).items():
        outputs = [a for a in parser._actions if a.type in cli.OUTPUT_TYPES]
        for action in outputs:
            flag = max(action.option_strings, key=len) if action.option_strings else None
            found.append((name, flag or action.dest))
            folder = cli.OUTPUT_TYPES[action.type]

            def given(value):
                return [*argv, *([flag] if flag else []), value]
            owned = base / "run" / ("best" if folder else "curves.png" if action.type is writer.output_figure
                                    else "summary.csv")
            refused(capsys, main, given(owned), base, "would overwrite training run", "'s own ")
            if folder:
                refused(capsys, main, given(base / "run" / "checkpoints" / "new"), base,
                        "would overwrite a file in training run")
            if data:
                inside = base / "data" / "val" / ("out" if folder else "out" + (Path(owned).suffix or ".json"))
                refused(capsys, main, given(inside), base, f"is inside {data} {base / 'data'}, the input data")
            if read and action.type is writer.output_file:  # a figure's name is a figure's (it cannot be a .pth)
                refused(capsys, main, given(read), base, f"is --checkpoint {read}, which this call reads")
    assert sorted(found) == [("convert", "--out"), ("digits", "root"), ("eval.py", "--output"),
                             ("eval.py", "--predictions"), ("flops", "--json"), ("lipschitz", "--json"),
                             ("lipschitz", "--plot"), ("mnist", "root"), ("train.py", "--output-dir")]
    main, _, argv, _, read = _commands(base)["lipschitz"]
    refused(capsys, main, [*argv, "--json", base / "same.png", "--plot", base / "same.png"], base,
            f"--json and --plot both name {base / 'same.png'}; give each its own file")
    main, _, argv, _, _ = _commands(base)["eval.py"]
    refused(capsys, main, [*argv, "--predictions", base / "x.csv", "--output", base / "x.csv"], base,
            f"--predictions and --output both name {base / 'x.csv'}")
    (base / "read.pth").unlink()


def test_a_training_output_folder_inside_its_data_is_refused_before_any_work(base, capsys):
    """output_dir inside data_dir, from the config or --set: the run's folder would become a class of its own data
    (a preempted run could then not resume). One line, exit 2, nothing written."""
    for inside in (base / "data" / "train" / "run", base / "data"):
        refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--set", f"output_dir={inside}"], base,
                f"output_dir {inside} is inside data_dir {base / 'data'}, the input data")
    refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--set", f"output_dir={base / 'run' / 'best'}"],
            base, "output_dir", "would overwrite training run")


def test_eval_outputs_that_would_replace_a_runs_own_files_are_refused_before_any_work(base, capsys):
    """A training run's own files (run_folder.OUTPUTS, its checkpoints) and any weight file; a new file beside them
    is written (make demo writes its run's eval.json)."""
    run, argv = base / "run", ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers", 0]
    step = sorted(p.name for p in (run / "checkpoints").iterdir())[0]
    for flag, own in [("--predictions", "metrics.jsonl"), ("--predictions", "summary.csv"),
                      ("--output", "summary.csv"), ("--output", "classes.json"), ("--output", "config.yaml"),
                      ("--output", "trackers.json"), ("--output", "last.safetensors")]:
        refused(capsys, EVAL.main, [*argv, flag, run / own], base,
                f"eval.py: {flag} {run / own} would overwrite training run {run}'s own {own}; name another file (e.g. "
                f"{run / ('eval.csv' if flag == '--predictions' else 'eval.json')})")
    manifest = run / "checkpoints" / step / "manifest.json"
    refused(capsys, EVAL.main, [*argv, "--output", manifest], base,
            f"--output {manifest} would overwrite a file in training run {run}'s checkpoints/; name another file")
    weights = base / "w.safetensors"
    shutil.copy(run / "last.safetensors", weights)
    refused(capsys, EVAL.main, [*argv, "--output", weights], base,
            f"eval.py: --output {weights} would overwrite weights; name another file (e.g. {base / 'eval.json'})")
    weights.unlink()
    code, out, err = call(capsys, EVAL.main, [*argv, "--output", run / "eval.json", "--predictions", run / "p.csv"])
    assert code == 0 and f"wrote: {run / 'p.csv'}, {run / 'eval.json'}" in out + err, (out, err)
    (run / "eval.json").unlink(), (run / "p.csv").unlink()


def test_eval_predictions_other_than_csv_and_two_flags_naming_one_file_are_refused(base, capsys):
    argv = ["--checkpoint", base / "run", "--data-dir", base / "data", "--workers", 0]
    for name in ("p.json", "p.jsonl", "p"):
        refused(capsys, EVAL.main, [*argv, "--predictions", base / name], base,
                f"eval.py: --predictions {base / name}: name a .csv file (one row per image)")
    refused(capsys, EVAL.main, [*argv, "--predictions", base / "x.csv", "--output", base / "data" / ".." / "x.csv"],
            base, f"eval.py: --predictions and --output both name {base / 'data' / '..' / 'x.csv'}; give each its own "
                  f"file")


def test_an_output_on_a_read_only_file_system_is_refused_naming_it_before_any_work(base, capsys, tmp_path,
                                                                                  monkeypatch):
    from lipsformer import flops
    ro = tmp_path / "mounted_ro"  # as a read-only mount looks to root: not writable, ST_RDONLY in its flags
    ro.mkdir()
    access, statvfs = os.access, os.statvfs
    monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != ro and access(p, mode, **k))
    monkeypatch.setattr(os, "statvfs", lambda p: type("S", (), {"f_flag": os.ST_RDONLY})() if Path(p) == ro
                        else statvfs(p))
    refused(capsys, flops.main, ["--models", "lipsformer_swin_t", "--no-flops", "--json", ro / "f.json"], tmp_path,
            f"argument --json: {ro / 'f.json'}: cannot write in {ro} (a read-only file system)")


class _Launch:
    """One process of a launch of two as save_checkpoint sees it; ``others_failed``: what the all-reduce brings."""
    num_processes, device = 2, "cpu"

    def __init__(self, main: bool, save_error: OSError = None, others_failed: bool = False):
        self.is_main_process, self.save_error, self.others_failed, self.calls = main, save_error, others_failed, []

    def wait_for_everyone(self):
        self.calls.append("barrier")

    def save_state(self, path):
        self.calls.append("save")
        if self.save_error is not None:
            raise self.save_error
        Path(path).mkdir(parents=True, exist_ok=True)

    def reduce(self, tensor, reduction):
        self.calls.append("agree")
        return torch.maximum(tensor, torch.tensor([int(self.others_failed)]))


def test_a_checkpoint_write_that_fails_on_one_process_stops_every_process_rather_than_one_waiting(tmp_path):
    from lipsformer.engine.checkpoint import TrainState, save_checkpoint
    from lipsformer.errors import Stopped
    state, model = TrainState(), torch.nn.Linear(2, 2)
    state.step = 2
    main = _Launch(True, OSError(errno.ENOSPC, "No space left on device"))  # it joins the agreement, then raises
    with pytest.raises(writer.WriteFailed, match=r"No space left on device \(ENOSPC"):
        save_checkpoint(main, model, tmp_path, state, keep_last=2)
    other = _Launch(False, others_failed=True)  # its part went well: it learns of the failure instead of waiting
    with pytest.raises(Stopped, match=r"could not write checkpoint \S+step_000000002: another process failed to"):
        save_checkpoint(other, model, tmp_path, state, keep_last=2)
    assert main.calls == other.calls == ["barrier", "save", "agree"] and not list(tmp_path.rglob("*step_*"))
    fine = _Launch(True)
    assert save_checkpoint(fine, model, tmp_path, state, keep_last=2).is_dir()
    assert fine.calls == ["barrier", "save", "agree", "agree"]


def test_convert_names_the_folder_it_wrote_once(base, capsys, tmp_path):
    from lipsformer import convert
    code, out, err = call(capsys, convert.main, [base / "run", "--out", tmp_path / "export"])
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("wrote")] == [f"wrote: {tmp_path / 'export'}"]
    assert out.splitlines()[0].startswith("model.safetensors sha256 ")


def test_a_missing_parent_folder_is_created(base, capsys, tmp_path):
    from lipsformer import flops
    code, out, _ = call(capsys, flops.main, ["--models", "lipsformer_swin_t", "--no-flops", "--json",
                                             tmp_path / "new" / "deeper" / "f.json"])
    assert code == 0 and json.loads((tmp_path / "new" / "deeper" / "f.json").read_text())[0]["model"] == \
        "lipsformer_swin_t"
    assert out.splitlines()[-1] == f"wrote: {tmp_path / 'new' / 'deeper' / 'f.json'}"


def test_a_folder_writer_started_twice_refuses_the_second_rather_than_both_writing_one_folder(capsys, tmp_path):
    """Two data writers into one folder would clear each other's temporary as a stale one and both say wrote: the
    folder, marked complete, would hold part of the images. The second is refused; the same holds for convert's
    export folder."""
    import fcntl
    from lipsformer.data import digits
    root = tmp_path / "digits"
    lock = writer.temporary(root).with_name(writer.temporary(root).name + ".lock")
    with open(lock, "w") as first:  # the first writer, still writing
        fcntl.flock(first, fcntl.LOCK_EX)
        refused(capsys, digits.main, [root], tmp_path, f"{root} is being written by another process right now")
    with writer.replacing(root, exclusive=True) as tmp:  # once it has ended, a writer goes ahead
        tmp.mkdir()
    assert root.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["digits"]


# -- the data writers' folders --------------------------------------------------------------------------------------
def test_the_data_writers_refuse_a_folder_they_did_not_write_and_rewrite_their_own(base, sources, capsys, tmp_path):
    from lipsformer.data import digits, mnist
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for main in (digits.main, mnist.main):
        refused(capsys, main, [foreign], tmp_path, f"{foreign} holds files that python -m lipsformer.data.",
                "did not write (notes.txt); choose a new or empty folder")
    ours = tmp_path / "ours"
    ours.mkdir()  # an empty folder may be written
    assert call(capsys, digits.main, [ours])[:2] == (0, f"wrote: {ours}\n")
    before = snapshot(tmp_path)
    assert call(capsys, digits.main, [ours])[:2] == (0, f"{ours} holds these digits already: left as it is\n")
    assert snapshot(tmp_path) == before
    assert call(capsys, digits.main, [ours, "--size", "16"])[:2] == (0, f"wrote: {ours}\n")  # its own: rewritten
    from PIL import Image
    assert Image.open(next(ours.rglob("*.png"))).size == (16, 16) and not leftovers(tmp_path)
    assert call(capsys, mnist.main, [ours])[:2] == (0, f"wrote: {ours}\n")  # a data writer's: rewritten
    assert Image.open(next(ours.rglob("*.png"))).size == (28, 28)
