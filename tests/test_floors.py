"""Imports run one way: every module imports only from its own room or a room ranked below it, no modules import
each other round a circle, none imports one of ours inside a function to dodge one, and docs/code.md's picture of
the floors is the one tests/floors.py computes from the imports."""
import pytest

from floors import (LAZY, ORDER, PAGE, Import, back_up, circles, diagram, hidden, imports, page_block, rendered,
                    room_of, stale, unranked)


@pytest.fixture(scope="module")
def found():
    return imports()


def test_the_walk_reads_every_import_of_the_package(found):
    # the imports that hold the floors together are among those read: a walk that reads none passes any check
    pairs = {(i.source, i.target) for i in found}
    assert {("lipsformer.engine.train", "lipsformer.build"), ("lipsformer.models._base", "lipsformer.weights"),
            ("train", "lipsformer.cli"), ("lipsformer.config", "lipsformer.weights")} <= pairs
    assert len({i.source for i in found}) > 60
    assert [i for i in found if i.function] == [i for i in found if (i.source, i.target) in LAZY]


def test_every_room_is_ranked_and_every_rank_is_a_room(found):
    assert not unranked(found), f"rank these rooms in ORDER of tests/floors.py: {unranked(found)}"
    assert not stale(found), "\n".join(stale(found))


def test_no_import_runs_back_up(found):
    assert not back_up(found), ("imports that run from a room to one ranked above it (move the name to the floor "
                                "of its users, or the importer up):\n" + "\n".join(back_up(found)))


def test_no_modules_import_each_other_round_a_circle(found):
    assert not circles(found), "\n".join(circles(found))


def test_no_import_of_ours_hides_inside_a_function(found):
    assert not hidden(found), ("imports of our modules inside a function (import them at the top; an optional "
                               "extra's goes in LAZY with its reason):\n" + "\n".join(hidden(found)))


def test_the_docs_draw_the_floors_the_imports_make():
    text = PAGE.read_text()
    start, end = page_block(text)
    assert text[start:end] == rendered(), (
        "docs/code.md's floor diagram is generated from the imports: python tests/floors.py --write")


def test_the_checks_name_both_modules_of_a_planted_import(found):
    up = Import("lipsformer.weights", "lipsformer.engine.train", 7, None)
    assert back_up([*found, up]) == ["lipsformer/weights.py:7 imports lipsformer/engine/train.py: engine/ stands "
                                     "above weights.py"]
    back = Import("lipsformer.layers.norm", "lipsformer.layers.block", 9, None)  # block imports norm
    assert ("lipsformer.layers.block", "lipsformer.layers.norm") in {(i.source, i.target) for i in found}
    said = circles([*found, back])
    assert len(said) == 1 and said[0].startswith("lipsformer/layers/norm.py:9 imports lipsformer/layers/block.py, "
                                                 "which imports it back: lipsformer/layers/block.py -> ")
    assert said[0].endswith(" -> lipsformer/layers/norm.py -> lipsformer/layers/block.py")
    lazy = Import("lipsformer.data.datasets", "lipsformer.models._base", 3, "eval_data_config")
    assert hidden([*found, lazy]) == ["lipsformer/data/datasets.py:3 imports lipsformer/models/_base.py inside "
                                      "eval_data_config()"]


def test_the_walk_resolves_relative_and_function_level_imports(tmp_path):
    package = tmp_path / "lipsformer"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import sub\n")
    (package / "errors.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .a import x\n")
    (package / "sub" / "a.py").write_text("from ..errors import E\nimport lipsformer.sub.b\nx = 1\n")
    (package / "sub" / "b.py").write_text("def f():\n    from . import a\n    from lipsformer import errors\n")
    (tmp_path / "train.py").write_text("import os\nfrom lipsformer.sub.a import x\n")
    assert sorted(imports(tmp_path)) == sorted([
        Import("lipsformer", "lipsformer.sub", 1, None),
        Import("lipsformer.sub", "lipsformer.sub.a", 1, None),
        Import("lipsformer.sub.a", "lipsformer.errors", 1, None),
        Import("lipsformer.sub.a", "lipsformer.sub.b", 2, None),
        Import("lipsformer.sub.b", "lipsformer.sub.a", 2, "f"),
        Import("lipsformer.sub.b", "lipsformer.errors", 3, "f"),
        Import("train", "lipsformer.sub.a", 2, None)])


def test_the_diagram_stands_each_room_above_what_it_imports(found):
    lines = diagram(found).splitlines()
    heads = [line.split()[:2] for line in lines if not line.startswith(" " * 18)]
    assert sorted(room for _, room in heads) == sorted(name for name, _ in ORDER)
    floor = {room: int(level) for level, room in heads}
    assert all(floor[room_of(i.source)] > floor[room_of(i.target)] for i in found
               if room_of(i.source) != room_of(i.target))
    assert floor["ground"] == 0 and floor["commands"] == max(floor.values())
