"""The settings door: what a user writes by hand, read one way for every command.

* :func:`read_yaml` / :func:`load_yaml`: YAML (config files, ``--set`` values, a run folder's ``config.yaml`` read back)
  through one strict loader, which refuses a key given twice in one mapping, naming the key and both lines: a
  duplicate that silently wins is a setting the user believes in and the run ignores. :func:`unique_pairs` does the
  same for JSON (``--model-args``).
* :func:`expand_path`: ``~`` and environment variables (``$DATA``, ``${DATA}``) expanded in a path, from a config key
  or a flag alike; an unset variable is a mistake naming it, never a folder literally called ``$DATA``.

No imports beyond PyYAML and the standard library: the config, the weights and the command lines all use it.
"""
import os
import re
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
