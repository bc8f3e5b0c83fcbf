"""benchmarks/gpu_check.py: which wheels a GPU machine gets, and the report it writes (no GPU needed)."""
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires=()):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(
            [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]))
    return path


@pytest.fixture
def machine(monkeypatch):
    """A machine that has everything but fvcore and its dependency yacs, and an old timm."""
    real = gpu_check.installed

    def installed(req):
        name = req.name.lower()
        if name in ("fvcore", "yacs"):
            return False, None
        if name == "timm":
            return req.specifier.contains("0.9.16"), "0.9.16"
        return real(req)
    monkeypatch.setattr(gpu_check, "installed", installed)


def test_missing_and_too_old_packages_come_from_the_wheels_with_their_dependencies(tmp_path, machine, capsys):
    fvcore = _wheel(tmp_path, "fvcore", "0.1.5.post20221221",
                    ["yacs>=0.1.6", "termcolor>=1.1", 'shapely; extra == "all"'])
    yacs = _wheel(tmp_path, "yacs", "0.1.8")
    timm = _wheel(tmp_path, "timm", "1.0.31", ["torch"])
    _wheel(tmp_path, "termcolor", "3.3.0")  # present on the machine: not installed
    assert gpu_check.requirements(str(tmp_path)) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(map(str, (timm, fvcore, yacs)))


def test_a_gap_is_one_error_line_naming_the_package_and_the_fix(tmp_path, machine, capsys):
    _wheel(tmp_path, "timm", "1.0.20")  # too old for the floor as well
    assert gpu_check.requirements(str(tmp_path)) == 2
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("error: timm>=1.0.31 (installed: 0.9.16): no matching wheel") for line in err)
    assert any(line.startswith("error: fvcore") and "make gpu-wheels" in line for line in err)


def test_torch_is_never_replaced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "installed", lambda req: (req.name != "torch", "2.2.0"))
    _wheel(tmp_path, "torch", "2.11.0")
    assert gpu_check.requirements(str(tmp_path)) == 2
    assert "torch>=2.9 (installed: 2.2.0): this machine's torch is not replaced" in capsys.readouterr().err


def test_report_tables_every_run_in_order(tmp_path):
    row = dict(gflops=4.5, infer_img_s=1000.0, infer_ratio=1.0, train_img_s=300.0, train_ratio=1.0,
               train_memory_mb=5000.0)
    for i, run in enumerate(("tiny_eager", "tiny_compiled")):
        path = tmp_path / f"throughput_{run}.json"
        path.write_text(json.dumps(dict(setup=f"setup of {run}", rows=[
            dict(row, model="swin_tiny_patch4_window7_224"),
            dict(row, model="lipsformer_swin_t", infer_ratio=0.9, train_memory_mb=6000.0)])))
        os.utime(path, (1000 + i, 1000 + i))  # written in this order
    (tmp_path / "versions.json").write_text(json.dumps({"device": "NVIDIA H100", "torch": "2.11.0"}))
    gpu_check.report(str(tmp_path))
    md = (tmp_path / "gpu.md").read_text()
    assert md.startswith("# GPU check: NVIDIA H100")
    assert "| tiny_eager | lipsformer_swin_t | 4.50 | 1000 | 0.90 | 300 | 1.00 | 6000 | 1.20 |" in md
    assert md.index("| tiny_eager |") < md.index("| tiny_compiled |")
    assert set(json.loads((tmp_path / "gpu.json").read_text())["throughput"]) == {"throughput_tiny_eager",
                                                                                 "throughput_tiny_compiled"}


def test_report_tables_a_training_matrix_against_each_groups_baseline(tmp_path):
    """throughput.py --matrix rows (mode, threads, batch): ratios against the first row of each group."""
    rows = []
    for mode, batch, peak in (("eager", 64, 1000.0), ("compiled none", 256, 3000.0)):
        rows += [dict(mode=mode, threads=16, batch=batch, model=m, gflops=4.5, infer_img_s=1000.0, infer_ratio=1.0,
                      train_img_s=300.0, train_ratio=1.0, train_memory_mb=peak * f, saved_mb=500.0 * f,
                      saved_ratio=f, train_per_flop=1.1, missed=missed)
                 for m, f, missed in (("swin_tiny_patch4_window7_224", 1.0, []),
                                      ("lipsformer_swin_t", 1.5, ["saved_ratio"]))]
    (tmp_path / "throughput_matrix.json").write_text(json.dumps(dict(setup="matrix", rows=rows)))
    estimate = {"64": dict(img_s=812.4)}  # benchmarks/step_cost.py --json, its rows of lipsformer_swin_t
    (tmp_path / "step_cost.json").write_text(json.dumps(dict(rows=[
        dict(model="lipsformer_swin_t", mode="train", estimate=estimate, img_s_ratio={"64": 0.81}),
        dict(model="lipsformer_swin_t", mode="infer", estimate={"64": dict(img_s=2500.0)}, img_s_ratio={"64": 0.9})])))
    gpu_check.report(str(tmp_path))
    md = (tmp_path / "gpu.md").read_text()
    assert "| matrix compiled none b256 | lipsformer_swin_t | 4.50 | 1000 | 1.00 | 300 | 1.00 | 4500 | 1.50 |" in md
    assert "| matrix | eager | 64 | lipsformer_swin_t | 1.10 | 750 | 1.50 | saved_ratio | 812 (0.81) / 2500 (0.90) |" \
        in md
    assert "| matrix | eager | 64 | swin_tiny_patch4_window7_224 | 1.10 | 500 | 1.00 | - | - |" in md  # no estimate
    assert "| matrix | compiled none | 256 | lipsformer_swin_t | 1.10 | 750 | 1.50 | saved_ratio | - |" in md


def test_report_counts_the_tests_the_session_timeout_left(tmp_path):
    """gpu.sh runs the GPU tests in pytest-xdist's workers with pytest-timeout's --session-timeout: pytest stops
    handing out tests when the time is up and writes its XML of those that ran; the report counts the rest from the
    log's header. Here a real run of 8 tests that each sleep a second, in 2 workers, with a session timeout of
    two of those seconds: each worker stops after its test that ends past it, its second or third."""
    import subprocess
    (tmp_path / "test_sleeps.py").write_text(
        "import time, pytest\n@pytest.mark.parametrize('i', range(8))\ndef test_sleep(i):\n    time.sleep(1)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--session-timeout",
                           "2", "--junitxml", str(tmp_path / "gpu_tests.xml"), "test_sleeps.py"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    (tmp_path / "gpu_tests.log").write_text(proc.stdout)
    gpu_check.report(str(tmp_path))
    tests = json.loads((tmp_path / "gpu.json").read_text())["tests"]
    assert tests["failures"] == tests["errors"] == 0
    assert tests["not run"] == 8 - tests["tests"] >= 2, proc.stdout
    assert f"not run {tests['not run']}" in (tmp_path / "gpu.md").read_text()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the stop on a machine without CUDA")
def test_gpu_sh_installs_the_project_then_stops_in_one_line_without_cuda(tmp_path):
    # the command's first step, as a GPU machine runs it (no registry: pip --no-index into a target folder), then
    # its one-line stop where torch sees no device, before any test or benchmark
    import subprocess
    site, out = tmp_path / "site", tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--python", sys.executable, "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, LIPSFORMER_SITE=str(site)),
                          timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: torch sees no CUDA device"
    assert (site / "lipsformer" / "models" / "lipsformer_swin.py").is_file()
    assert not (out / "versions.json").exists() and not (out / "gpu_tests.log").exists()


def test_gpu_sh_refuses_an_unknown_step_in_one_line(tmp_path):
    import subprocess
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--out", str(tmp_path / "out"), "--only",
                           "tests,bench"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --only takes steps among tests, matrix, base (comma-separated), got bench"]
    assert not (tmp_path / "out").exists()
