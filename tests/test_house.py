"""The house stays readable: the training loop reads top to bottom in one sitting, with the resume policy,
the preemption handling and the metrics in modules of their own, and no module of the package grows past what one
reads in one go; a module that does is split along the concepts it already has."""
from pathlib import Path

import lipsformer

PACKAGE = Path(lipsformer.__file__).resolve().parent
TRAIN_LOOP_MAX = 450  # lines of lipsformer/engine/train.py
MODULE_MAX = 600  # lines of any other module of lipsformer/


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_training_loop_stays_short():
    lines = _lines(PACKAGE / "engine" / "train.py")
    assert lines <= TRAIN_LOOP_MAX, (
        f"lipsformer/engine/train.py has {lines} lines (at most {TRAIN_LOOP_MAX}): it keeps the loop and the order of "
        f"the builders; move what belongs to a concern (resume.py, preemption.py, metrics.py, checkpoint.py) there")


def test_no_module_of_the_package_is_over_600_lines():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30  # the whole package is walked
    over = {str(p.relative_to(PACKAGE.parent)): n for p in modules if (n := _lines(p)) > MODULE_MAX}
    assert not over, f"modules over {MODULE_MAX} lines (split each along its concepts): {over}"
