"""A tool users run, through benchmarks/gpu.sh (docs/gpu.md): benchmarks/gpu.sh's two Python steps (standard library
and ``packaging`` only, so they run before anything is installed):

    python benchmarks/gpu_check.py requirements WHEEL_DIR   # wheels to install: one path a line; exit 2 on a gap
    python benchmarks/gpu_check.py report RESULTS_DIR       # RESULTS_DIR/gpu.json and gpu.md from the parts
                                                            # (and step_cost.json's estimates beside them)

``requirements`` reads the project's dependencies (pyproject.toml, plus the test runner of the ``dev`` extra),
finds each one missing or too old on this Python, and takes its wheel from WHEEL_DIR (``make gpu-wheels``), then
the wheels' own dependencies the same way. torch is never replaced: a missing or too old torch is an error.
"""
import json
import re
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
NEVER_REPLACED = {"torch", "torchvision"}  # built for the machine's CUDA
TEST_EXTRAS = ("pytest", "pytest-timeout", "pytest-xdist", "scikit-learn")


def project_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = [r for r in project["optional-dependencies"]["dev"] if canonicalize_name(Requirement(r).name)
           in TEST_EXTRAS]
    return [Requirement(r) for r in project["dependencies"] + dev]


def installed(req: Requirement):
    """The installed version when it satisfies ``req``, else None (with the version found, or None)."""
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False, None
    return req.specifier.contains(version, prereleases=True), version


def wheel_requirements(path: Path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = dict(default_environment(), extra="")
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def requirements(wheel_dir: str) -> int:
    wheels = {}
    for path in sorted(Path(wheel_dir).glob("*.whl")) if Path(wheel_dir).is_dir() else []:
        name, version, *_ = parse_wheel_filename(path.name)
        wheels[canonicalize_name(name)] = (version, path)
    queue, chosen, errors, seen = project_requirements(), {}, [], set()
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        ok, have = installed(req)
        if ok:
            continue
        what = f"{req.name}{req.specifier or ''} (installed: {have or 'none'})"
        if name in NEVER_REPLACED:
            errors.append(f"{what}: this machine's {req.name} is not replaced; use a machine with a newer one")
        elif name not in wheels or not req.specifier.contains(wheels[name][0], prereleases=True):
            errors.append(f"{what}: no matching wheel in {wheel_dir}/ (run make gpu-wheels where pip reaches PyPI)")
        else:
            chosen[name] = wheels[name][1]
            queue += wheel_requirements(wheels[name][1])
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    print("\n".join(str(p) for p in chosen.values()))
    return 2 if errors else 0


def _estimate(cost, row) -> str:
    """benchmarks/step_cost.py's estimate for a measured eager row: training and inference img/s, ratios."""
    if cost is None or row.get("mode") != "eager":
        return "-"
    found = {r["mode"]: r for r in cost["rows"] if r["model"] == row["model"]}
    batch = str(row["batch"])
    if set(found) != {"train", "infer"} or batch not in found["train"]["estimate"]:
        return "-"
    return " / ".join(f"{found[m]['estimate'][batch]['img_s']:.0f} ({found[m]['img_s_ratio'][batch]:.2f})"
                      for m in ("train", "infer"))


def report(results: str) -> int:
    """gpu.json (versions, test summary, every throughput row) and gpu.md (one table) under ``results``."""
    out = Path(results)
    files = sorted(out.glob("throughput_*.json"), key=lambda p: p.stat().st_mtime)  # in the order they ran
    parts = {p.stem: json.loads(p.read_text()) for p in files}
    tests = {}
    xml = out / "gpu_tests.xml"
    if xml.exists():
        head = re.search(r"<testsuite [^>]*>", xml.read_text())
        tests = {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', head.group(0))}
        log = (out / "gpu_tests.log").read_text() if (out / "gpu_tests.log").exists() else ""
        collected = re.search(r"workers \[(\d+) items?\]", log)  # pytest-xdist's header: the tests it was to run
        if collected:  # those left when the step's time ran out (pytest's --session-timeout)
            tests["not run"] = int(collected.group(1)) - tests["tests"]
        tests["sdpa_kernels"] = dict(re.findall(
            r'<testcase [^>]*name="([^"]*)"[^>]*>\s*<properties>\s*<property name="sdpa_kernels" value="([^"]*)"',
            xml.read_text()))
    versions = json.loads((out / "versions.json").read_text()) if (out / "versions.json").exists() else {}
    cost = json.loads((out / "step_cost.json").read_text()) if (out / "step_cost.json").exists() else None
    (out / "gpu.json").write_text(json.dumps(dict(versions=versions, tests=tests, throughput=parts, step_cost=cost),
                                             indent=2))
    lines = [f"# GPU check: {versions.get('device', '?')}", "",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "device"), "",
             "tests: " + (", ".join(f"{k} {v}" for k, v in tests.items() if k != "sdpa_kernels") or "not run"), "",
             "| run | model | GFLOPs | infer img/s | ratio | train img/s | ratio | train peak MB | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    no_train = " | ".join([""] * 4)
    matrix = []
    for run, part in parts.items():
        bases = {}  # the baseline of each group: the first row of a run, or of a --matrix run's mode and batch
        for r in part["rows"]:
            group = (r.get("mode"), r.get("threads"), r.get("batch"))
            base = bases.setdefault(group, r)
            label = run.removeprefix("throughput_") + (f" {r['mode']} b{r['batch']}" if "mode" in r else "")
            train = (f"{r['train_img_s']:.0f} | {r['train_ratio']:.2f} | {r['train_memory_mb']:.0f} | "
                     f"{r['train_memory_mb'] / base['train_memory_mb']:.2f}") if "train_img_s" in r else no_train
            lines.append(f"| {label} | {r['model']} | {r['gflops']:.2f} | "
                         f"{r['infer_img_s']:.0f} | {r['infer_ratio']:.2f} | {train} |")
        saved = [r for r in part["rows"] if "saved_mb" in r]
        # --matrix: per-FLOP ratios and the bytes autograd saves, against each group's baseline, and the step-cost
        # tool's estimate of the eager rows (img/s and ratio, training and inference)
        matrix += [f"| {run.removeprefix('throughput_')} | {r['mode']} | {r['batch']} | {r['model']} | "
                   f"{r['train_per_flop']:.2f} | {r['saved_mb']:.0f} | {r['saved_ratio']:.2f} | "
                   f"{' '.join(r['missed']) or '-'} | {_estimate(cost, r)} |" for r in saved]
    if matrix:
        lines += ["", "Training benchmark (`--matrix`; the train peak MB above is the peak allocated; estimate: "
                  "benchmarks/step_cost.py's img/s (ratio), eager rows):", "",
                  "| run | mode | batch | model | train per-FLOP | saved MB | ratio | missed targets | "
                  "estimate train / infer |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + matrix
    lines += ["", "setups:"] + [f"- {run}: {part['setup']}" for run, part in parts.items()]
    if tests.get("sdpa_kernels"):
        lines += ["", "SDPA kernel per attention kind:"] + [f"- {k}: {v}" for k, v in tests["sdpa_kernels"].items()]
    (out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    command, arg = sys.argv[1:3]
    sys.exit({"requirements": requirements, "report": report}[command](arg))
