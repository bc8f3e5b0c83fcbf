"""No assertion in tests/ depends on how fast the machine is: a timing compared with another timing or a number, a
ratio of timings held to a floor, a throughput target. Such a figure is reported by its benchmark (medians and ratios,
docs/speed.md); a test asserts the deterministic quantity it stands for (calls, solver steps, multiply-adds, bytes,
the order of phases), or that a timing exists and is positive."""
import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# a dict key or a name that holds a time or a rate: train_s, keep_bound_s, seconds, elapsed, img_per_s, wall,
# infer_ratio (a ratio of two timings in a benchmark's row), ms_per_batch, duration
TIMING = re.compile(r"(?:^|_)(?:s|ms|us|secs?|seconds|elapsed|wall|duration|took|img_s|per_s|throughput)$"
                    r"|(?:^|_)ratio$|^ms_|(?:^|_)per_flop$", re.IGNORECASE)
CLOCKS = {"time", "perf_counter", "monotonic", "perf_counter_ns", "monotonic_ns", "time_ns", "process_time"}
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# (file, the assertion's source line, why its order holds whatever the machine's speed)
ALLOWED = [
    ("test_attlip.py", "assert float(ratio.max()) <= 1 + 1e-6",
     "a ratio of distances (a Lipschitz quotient), not of timings"),
    ("test_certified_solver.py", "assert float(ratio.max()) <= 1e-3", "a ratio of residuals"),
    ("test_certified_solver.py", "assert float(ratio.max()) > 1", "a ratio of residuals"),
    ("test_lipschitz.py", "assert float(ratio.max()) <= report.bound", "a ratio of distances against the bound"),
    ("test_step_cost.py", 'assert r["ops_ratio"] <= 1.3 and r["bytes_ratio"] <= 1.2, r',
     "ratios of ops and bytes counted on the meta device"),
    ("test_step_cost.py", 'assert r["ops_ratio"] <= 1.6 and r["bytes_ratio"] <= 1.3, r',
     "ratios of ops and bytes counted on the meta device"),
]


def _timing(node: ast.AST) -> bool:
    """Whether an operand reads a clock, or a name, attribute or dict key that holds a time, a rate or a timing
    ratio (outside a comprehension, whose conditions compute an expectation rather than assert one)."""
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)):
        return False
    if isinstance(node, ast.Call):
        fn = node.func
        if getattr(fn, "attr", getattr(fn, "id", None)) in CLOCKS:
            return True
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        if TIMING.search(node.slice.value):
            return True
    if isinstance(node, ast.Name) and TIMING.search(node.id):
        return True
    if isinstance(node, ast.Attribute) and TIMING.search(node.attr):
        return True
    return any(_timing(child) for child in ast.iter_child_nodes(node))


def _zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _compares(node: ast.AST):
    """The comparisons an assertion makes: its test, through ``and`` / ``or`` / ``not``."""
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _compares(value)
    elif isinstance(node, ast.UnaryOp):
        yield from _compares(node.operand)
    elif isinstance(node, ast.Compare):
        yield node


def timed_assertions(source: str, name: str = "planted.py"):
    """``file:line: source`` of each assertion of ``source`` that orders a timing against anything but zero (the
    allowed ones left out)."""
    found = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in _compares(node.test):
            operands = [cmp.left, *cmp.comparators]
            for op, left, right in zip(cmp.ops, operands, operands[1:]):
                if not isinstance(op, ORDER) or not (_timing(left) or _timing(right)):
                    continue
                if _zero(left) or _zero(right):
                    continue  # a timing that exists and is positive
                line = lines[node.lineno - 1].strip()
                if any(name == f and line.startswith(text) for f, text, _ in ALLOWED):
                    continue
                found.append(f"{name}:{node.lineno}: {line}")
    return found


def test_no_assertion_orders_a_timing():
    files = sorted(TESTS.glob("*.py"))
    assert len(files) > 40
    found = [hit for f in files if f.name != "test_timing_free.py" for hit in timed_assertions(f.read_text(), f.name)]
    assert not found, ("assertions whose outcome depends on the machine's speed; assert the deterministic quantity "
                       "the timing stands for (calls, solver steps, multiply-adds, bytes), or move the target to its "
                       "benchmark:\n" + "\n".join(found))


def test_every_allowed_assertion_still_exists():
    for f, text, _ in ALLOWED:
        assert any(line.strip().startswith(text) for line in (TESTS / f).read_text().splitlines()), (f, text)


@pytest.mark.parametrize("planted, caught", [
    ('assert 0 < row["keep_bound_s"] < row["cert_train_s"]', True),
    ('assert row["train_ratio"] >= 0.9', True),
    ('assert r["img_per_s"] > 100', True),
    ("assert elapsed < 2.0", True),
    ("assert time.perf_counter() - start < 5", True),
    ("assert compiled_s <= eager_s", True),
    ('assert result["ms_per_batch"]["ours"]["step"] < 50', True),
    ('assert x > 0 and row["infer_ratio"] < 1.2', True),
    ('assert r["img_s"] > 0 and r["ratio"] == pytest.approx(r["img_s"] / base["img_s"])', False),
    ('assert row["keep_bound_s"] > 0', False),
    ('assert 0 < macs["keep_bound"] < macs["cert_train"]', False),
    ('assert set(r["missed"]) == {k for k in ("a", "b") if r[k] < 0.9}', False),
    ("assert len(rows) >= 2", False),
    ("assert float(ratio.max()) <= 1 + 1e-6", True),  # outside ALLOWED's files
])
def test_a_planted_timed_assertion_is_caught(planted, caught):
    assert bool(timed_assertions(planted + "\n")) is caught
