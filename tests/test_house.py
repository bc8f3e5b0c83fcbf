"""The house stays readable (issue 38): the training loop reads top to bottom in one sitting, with the resume policy,
the preemption handling and the metrics in modules of their own, and no module of the package grows past what one
reads in one go; a module that does is split along the concepts it already has."""
import ast
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


# (module, name) -> why that module may import a private name of another / a name it does not use.
PRIVATE_IMPORTS_ALLOWED: dict = {}
REEXPORTS_ALLOWED = {
    ("lipsformer/__init__.py", "models"): "imported for its side effect: registers every model with timm",
    ("lipsformer/models/__init__.py", "peer"): "imported for its side effect: registers torchlip_cnn, the peer baseline",
}


def _imports(tree: ast.Module):
    """``(name bound here, name in its home, line)`` of every ``from X import name`` of the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield alias.asname or alias.name, alias.name, node.lineno


def _used(tree: ast.Module) -> set:
    """Names the module reads (a bare name, or the head of ``name.attr``), and names its annotations give as strings."""
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    strings = (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return used | {s.split(".")[0].strip('"') for s in strings if s.isidentifier() or s.split(".")[0].isidentifier()}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text())


def test_no_module_imports_a_private_name_of_another():
    """A ``_name`` is its module's own: a helper two modules share is public in its home, or lives with its user."""
    found = [f"{module}:{line}: {home}" for module, tree in _modules() for _, home, line in _imports(tree)
             if home.startswith("_") and not home.startswith("__") and (module, home) not in PRIVATE_IMPORTS_ALLOWED]
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def test_no_module_re_exports_names_it_does_not_use():
    """Every import comes from the module where the name lives: a module imports only what it uses. A package's
    ``__init__`` is its public API: what it imports without using is listed in its ``__all__``."""
    found = []
    for module, tree in _modules():
        used = _used(tree)
        exported = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                exported = set(ast.literal_eval(node.value))
        is_api = module.endswith("__init__.py")
        for bound, _, line in _imports(tree):
            if bound in used or (is_api and bound in exported) or (module, bound) in REEXPORTS_ALLOWED:
                continue
            found.append(f"{module}:{line}: {bound}")
    assert not found, "names imported but not used (re-exports; import them from their home):\n" + "\n".join(found)


def test_one_function_builds_a_model_for_every_entry_point():
    """``lipsformer.build.build_model`` is the one caller of ``timm.create_model`` in the package (the entry points:
    training, fine-tuning, eval.py, the toolkit, convert and flops go through it), and the only builder by that name."""
    calls, builders = [], []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "create_model", "create_from_checkpoint", "start_model") and module != "lipsformer/build.py":
                calls.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.FunctionDef) and node.name in ("build_model", "create_model", "start_model",
                                                                  "create_from_checkpoint", "_create_model"):
                builders.append(f"{module}:{node.lineno}: {node.name}")
    assert not calls, "models built elsewhere than lipsformer/build.py:\n" + "\n".join(calls)
    assert [b.split(":")[0] + b.split(":")[2] for b in builders] == ["lipsformer/build.py build_model"], builders


def test_build_model_says_where_the_weights_came_from(tmp_path):
    """The start record of each source: none, a weight file (a classifier of another class count re-created only
    with ``new_head``), and a run of the same classes given a new classifier (``reset_head``)."""
    import pytest
    from safetensors.torch import save_file

    from conftest import TINY
    from lipsformer.build import ModelStart, build_model
    from lipsformer.weights import CheckpointError
    model, start = build_model("lipsformer_swin_t", **TINY["swin"], num_classes=5)
    assert start == ModelStart("scratch")
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    _, start = build_model("lipsformer_swin_t", tmp_path / "w.safetensors", **TINY["swin"], num_classes=3,
                           new_head=True)
    assert start == ModelStart(str(tmp_path / "w.safetensors"), reinitialised=["head.fc.weight", "head.fc.bias"])
    with pytest.raises(CheckpointError, match="is a classifier of 5 classes, lipsformer_swin_t is built for 3"):
        build_model("lipsformer_swin_t", tmp_path / "w.safetensors", **TINY["swin"], num_classes=3)
    same, start = build_model("lipsformer_swin_t", tmp_path / "w.safetensors", **TINY["swin"], reset_head=True)
    assert start.reinitialised == ["head.fc.weight", "head.fc.bias"] and same.num_classes == 5
