"""The settings door: what a user writes by hand, read one way for every command.

* :func:`read_yaml` / :func:`load_yaml`: YAML (config files, ``--set`` values, a run folder's ``config.yaml`` read back)
  through one strict loader, which refuses a key given twice in one mapping, naming the key and both lines: a
  duplicate that silently wins is a setting the user believes in and the run ignores. :func:`unique_pairs` does the
  same for JSON (``--model-args``), and :func:`read_json` / :func:`read_json_lines` read a JSON file a run wrote
  (``trackers.json``, ``metrics.jsonl``), which a user may have edited, refusing what is not JSON in one line
  naming the file and line.
* :func:`expand_path`: ``~`` and environment variables (``$DATA``, ``${DATA}``) expanded in a path, from a config key
  or a flag alike; an unset variable is a mistake naming it, never a folder literally called ``$DATA``.

No imports beyond PyYAML and the standard library: the config, the weights and the command lines all use it.
"""
import json
import os
import re
from pathlib import Path
from typing import Any, List, Tuple

import yaml

from .errors import Mistake

# os.path.expandvars' own pattern: $NAME or ${NAME}
_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)


class SettingError(Mistake, ValueError):
    """A setting that cannot be read as written: a key given twice, a path naming an unset variable."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives one key twice (YAML 1.2 requires unique keys; PyYAML keeps
    the last). Keys brought in by a merge (``<<: *base``) may be overridden, as YAML's merge key allows."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
                if seen is not key_node.start_mark:
                    mark = key_node.start_mark
                    raise SettingError(f"{mark.name}: duplicate key {key!r} at line {mark.line + 1} (first given at "
                                       f"line {seen.line + 1}); a mapping takes each key once: keep the one you mean")
        return super().construct_mapping(node, deep)


def load_yaml(stream) -> Any:
    """YAML from text or an open file (its ``name`` is what an error names), read strictly."""
    return yaml.load(stream, Loader=_StrictLoader)


def read_yaml(path) -> Any:
    """The YAML file at ``path``, read strictly (as bytes: PyYAML decodes them and names the file in any error)."""
    with open(path, "rb") as f:
        return load_yaml(f)


def unique_pairs(pairs: List[Tuple[str, Any]]) -> dict:
    """``json.loads``' ``object_pairs_hook``: a JSON object, refusing a key given twice."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise SettingError(f"duplicate key {key!r} in a JSON object; give each key once")
        out[key] = value
    return out


def _json(text: str, where: str, one_line: bool = False) -> Any:
    try:
        return json.loads(text, object_pairs_hook=unique_pairs)
    except json.JSONDecodeError as e:
        at, it = (f"column {e.colno}", "the line") if one_line else (f"line {e.lineno} column {e.colno}", "it")
        raise SettingError(f"{where}: not JSON at {at} ({e.msg}); restore {it} as the run wrote it, or remove {it}"
                           ) from None
    except SettingError as e:
        raise SettingError(f"{where}: {e}") from None


def _text(path) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SettingError(f"{path}: not UTF-8 text (byte {e.start}); restore it as the run wrote it, or remove it"
                           ) from None


def read_json(path) -> Any:
    """The JSON file at ``path``, read strictly (a key given twice is refused); one that is not JSON is a
    :class:`SettingError` naming the file, line and column."""
    return _json(_text(path), str(path))


def read_json_lines(path) -> List[Tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of a file of one JSON value per line, each read as
    :func:`read_json` reads a file (the error names the file and line). A last line without its newline, cut short
    by a machine that went down in the middle of an append, is left out."""
    lines = _text(path).split("\n")[:-1]  # the text after the last newline: empty, or a line cut short
    return [(n, _json(line, f"{path} line {n}", one_line=True)) for n, line in enumerate(lines, 1) if line.strip()]


def expand_path(value: str, what: str) -> str:
    """``value`` with ``~`` / ``~user`` and ``$NAME`` / ``${NAME}`` expanded; ``what`` (a key or a flag) names it in
    the :class:`SettingError` for a variable that is not set or a user that does not exist."""
    unset = [m.group(1).strip("{}") for m in _VARIABLE.finditer(value) if m.group(1).strip("{}") not in os.environ]
    if unset:
        raise SettingError(f"{what} {value}: the environment variable {unset[0]} is not set; set it, or write the "
                           f"path out")
    expanded = os.path.expanduser(os.path.expandvars(value))
    if expanded.startswith("~"):
        raise SettingError(f"{what} {value}: no user {expanded.split('/', 1)[0][1:]!r} to expand "
                           f"{expanded.split('/', 1)[0]} for")
    return expanded
