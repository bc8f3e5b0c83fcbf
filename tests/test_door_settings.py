"""The settings door, generated from what it guards: every key of every shipped config given twice; ``~`` and
``$VARIABLES`` in every path key (fields with path=True) and every path flag of every command (found from the
parsers); each row of each command's table of flags a mode ignores; every constructor argument of both families
with the values it refuses (from the models' ARGUMENTS table), through timm.create_model and through train.py; a
bound no projection can keep; a mistake under torchrun with two processes. Each refused case asserts exit code 2,
one line, no traceback and nothing written (tests/helpers.py's ``refused``)."""
import argparse
import importlib
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import timm
import torch
import yaml

from conftest import ROOT, TINY, family, load_script
from helpers import PY, TINY_RUN, call, make_folder, refused
from lipsformer import cli
from lipsformer.writer import output_figure, output_file, output_folder
from lipsformer.config import CHOICES, MODEL_ARGS, load_config, path_keys
from lipsformer.models._base import ARGUMENTS

pytestmark = pytest.mark.usefixtures("fresh_accelerate")

TRAIN, EVAL = load_script("train.py"), load_script("eval.py")
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MODELS = {"swin": "lipsformer_swin_t", "cswin": "lipsformer_cswin_t"}
RUN = dict(TINY_RUN, epochs=1, ema_decay=None, mixup=0.0, cutmix=0.0, drop_path=0.0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny image folder and a config training on it (nothing trained)."""
    root = tmp_path_factory.mktemp("settings")
    make_folder(root / "data", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    (root / "cfg.yaml").write_text(yaml.safe_dump(dict(RUN, data_dir=str(root / "data"),
                                                       output_dir=str(root / "out"))))
    return root


# -- commands and their parsers, found from the code ----------------------------------------------------------
def commands() -> dict:
    """``name -> (main, parser)`` of train.py, eval.py and every ``python -m`` module whose main is a ``@command``
    (found by reading lipsformer's sources, so a new command is walked too)."""
    found = {"train.py": (TRAIN.main, TRAIN.build_parser()), "eval.py": (EVAL.main, EVAL.build_parser())}
    for source in sorted((ROOT / "lipsformer").rglob("*.py")):
        if re.search(r"^@command\s*\ndef main", source.read_text(), re.M):
            name = ".".join(source.relative_to(ROOT).with_suffix("").parts)
            module = importlib.import_module(name)
            assert hasattr(module, "build_parser"), f"{name}: a command's parser is built by build_parser()"
            found[name.removesuffix(".__main__")] = (module.main, module.build_parser())
    return found


COMMANDS = commands()
# The argparse types of options naming a file or folder: each expands ~ and $VARIABLES.
PATH_TYPES = (cli.path, cli.data_path, output_file, output_figure, output_folder)
# String options that are not paths, each with what it holds; every other string option must have a PATH_TYPES type.
NOT_PATHS = {
    "--model": "a model name", "--models": "model names", "--set": "KEY=VALUE items", "--tag": "a pretrained tag",
    "--measure": "module names", "--certify-eps": "radii (parsed by lipschitz.certify.parse_eps)",
    "--attack-eps": "radii (parsed by lipschitz.certify.parse_eps)",
}


def options(parser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction))]


def test_every_string_option_of_every_command_is_a_path_or_named_otherwise():
    assert {"train.py", "eval.py", "lipsformer.lipschitz", "lipsformer.convert", "lipsformer.flops",
            "lipsformer.data.digits", "lipsformer.data.mnist"} <= set(COMMANDS)
    loose = [f"{name} {a.option_strings or a.dest}" for name, (_, parser) in COMMANDS.items() for a in options(parser)
             if a.type is None and not a.choices and not set(a.option_strings) & set(NOT_PATHS)]
    assert not loose, f"string options that are neither a PATH_TYPES type nor in NOT_PATHS: {loose}"


# -- 1. a key given twice ------------------------------------------------------------------------------------------
def _entry(key, value) -> str:
    return f"{key}: {yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix('...').strip()}"


def duplicated(path: Path):
    """``(text, key, line, first line)`` for every top-level key of the config at ``path`` given again at its end,
    and every key of its model_kwargs given twice inside it (the config's other keys one a line before it)."""
    text = path.read_text()
    lines, loaded = text.splitlines(), yaml.safe_load(text)
    for key, value in loaded.items():
        first = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:")) + 1
        yield f"{text.rstrip()}\n{_entry(key, value)}\n", key, len(lines) + 1, first
    others = [_entry(k, v) for k, v in loaded.items() if k != "model_kwargs"]
    for key, value in (loaded.get("model_kwargs") or {}).items():
        kwargs = ", ".join(_entry(k, v) for k, v in [(key, value), *loaded["model_kwargs"].items()])
        yield "\n".join(others + [f"model_kwargs: {{{kwargs}}}"]) + "\n", key, len(others) + 1, len(others) + 1


def test_every_key_of_every_shipped_config_given_twice_is_refused_naming_it_and_its_lines(base, capsys):
    cases = 0
    for config in CONFIGS:
        for text, key, line, first in duplicated(config):
            bad = base / "dup.yaml"
            bad.write_text(text)
            refused(capsys, TRAIN.main, ["--config", bad], base,
                    f"{bad}: duplicate key {key!r} at line {line} (first given at line {first})")
            cases += 1
    assert cases > 400, cases


def test_set_values_a_key_set_twice_and_json_with_a_key_twice_are_refused(base, capsys):
    cfg = ["--config", base / "cfg.yaml"]
    refused(capsys, TRAIN.main, cfg + ["--set", "model_kwargs={depths: [1], depths: [2]}"], base,
            "--set model_kwargs={depths: [1], depths: [2]}: duplicate key 'depths'")
    refused(capsys, TRAIN.main, cfg + ["--set", "lr=1e-3", "lr=2e-3"], base,
            "lr is set twice on the command line (--set lr=1e-3, then --set lr=2e-3)")
    refused(capsys, TRAIN.main, cfg + ["--data-dir", base / "data", "--set", f"data_dir={base}"], base,
            "data_dir is set twice", "--data-dir")
    refused(capsys, EVAL.main, ["--checkpoint", base / "x", "--data-dir", base / "data", "--model-args",
                                '{"img_size": 32, "img_size": 64}'], base, "--model-args", "duplicate key 'img_size'")


def test_a_run_folders_config_with_a_key_twice_is_refused_where_it_is_read_back(base, capsys):
    """eval.py, the Lipschitz command and a resume read a run's config.yaml: it holds what the run was."""
    from lipsformer.lipschitz.__main__ import main as lipschitz
    run = base / "dup_run"
    (run / "checkpoints" / "step_000000002").mkdir(parents=True)
    (run / "last.safetensors").write_bytes(b"x")
    (run / "config.yaml").write_text(yaml.safe_dump(dict(RUN, data_dir=str(base / "data"), output_dir=str(run)))
                                     + "lr: 5.0\n")
    said = f"{run / 'config.yaml'}: duplicate key 'lr'"
    refused(capsys, EVAL.main, ["--checkpoint", run, "--data-dir", base / "data"], base, said)
    refused(capsys, lipschitz, ["--checkpoint", run], base, said)
    refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--output-dir", run, "--resume", run], base, said)


def test_a_run_folders_config_edited_by_hand_is_one_line_naming_the_file_and_the_key(base, capsys):
    """A run's config.yaml is read back as strictly as a user's config: each key that says what the weights are
    (config.WEIGHTS_KEYS) removed, and a key of the wrong type, are one line naming the file and the key in
    eval.py, the Lipschitz command and convert; exit 2, nothing written."""
    from lipsformer import convert
    from lipsformer.config import WEIGHTS_KEYS
    from lipsformer.lipschitz.__main__ import main as lipschitz
    from safetensors.torch import save_file
    from lipsformer.config import TrainConfig
    run = base / "edited_run"
    run.mkdir()
    TrainConfig(**dict(RUN, data_dir=str(base / "data"), output_dir=str(run))).save(run / "config.yaml")
    model = timm.create_model(RUN["model"], num_classes=RUN["num_classes"], img_size=RUN["img_size"],
                              **RUN["model_kwargs"])
    save_file(model.state_dict(), str(run / "last.safetensors"))
    written = yaml.safe_load((run / "config.yaml").read_text())
    cases = [({k: v for k, v in written.items() if k != key}, [f"{run / 'config.yaml'} has no {key}"])
             for key in WEIGHTS_KEYS]
    cases.append((dict(written, img_size="big"), [f"{run / 'config.yaml'}: ", "img_size"]))
    for config, said in cases:
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        refused(capsys, EVAL.main, ["--checkpoint", run, "--data-dir", base / "data", "--workers", 0], base, *said)
        refused(capsys, lipschitz, ["--checkpoint", run], base, *said)
        refused(capsys, convert.main, [run, "--out", base / "converted"], base, *said)
    shutil.rmtree(run)


def test_a_run_folders_rows_and_tracker_runs_edited_by_hand_are_one_line_naming_the_file(base, capsys, tmp_path):
    """A resume continues a run's metrics.jsonl and trackers.json, read before anything is written: a row that is
    not JSON, a row of another shape and a trackers.json of another shape are one line naming the file (and the
    line), exit 2, nothing written. A last row cut short (a crash in the middle of an append) is not a mistake."""
    run = tmp_path / "run"
    argv = ["--config", base / "cfg.yaml", "--output-dir", run, "--set", "log_with=[tensorboard]"]
    assert call(capsys, TRAIN.main, argv)[0] == 0
    metrics, trackers = run / "metrics.jsonl", run / "trackers.json"
    rows = metrics.read_text()
    first, rest = rows.split("\n", 1)
    for line, said, fix in (("{not json", "line 2: not JSON at column 2", "restore the line"),
                            ("[1, 2]", "line 2: list where a row is an object", "restore the line"),
                            ('{"kind": "epoch", "step": 2}', "line 2: an epoch row's epoch None is not a whole number",
                             "restore the line"),
                            ('{"kind": "train", "step": 1, "step": 2}', "line 2: duplicate key 'step'", "once")):
        metrics.write_text(f"{first}\n{line}\n{rest}")
        refused(capsys, TRAIN.main, [*argv, "--resume", "auto"], tmp_path, f"{metrics} {said}", fix)
    metrics.write_text(rows)
    for record, said in (("[]", "not a record of tracker runs"), ('{"wandb": "x"}', "not a record of tracker runs"),
                         ("{", "not JSON at line 1 column 2")):
        trackers.write_text(record)
        refused(capsys, TRAIN.main, [*argv, "--resume", "auto"], tmp_path, f"{trackers}: {said}")
    trackers.unlink()
    metrics.write_text(rows + '{"kind": "tr')  # cut short: left out, the run resumes (here: it had finished)
    code, out, err = call(capsys, TRAIN.main, [*argv, "--resume", "auto"])
    assert code == 0 and "error" not in err, err


def test_a_choice_yaml_reads_as_a_boolean_is_the_word_in_a_file_as_in_set(tmp_path):
    words = {key: "no" for key, choices in CHOICES.items() if "no" in choices}  # YAML 1.1: no is false
    assert "mixed_precision" in words
    config = tmp_path / "hand.yaml"
    config.write_text("".join(f"{key}: no\n" for key in words))
    for cfg in (load_config(config), load_config(None, [f"{key}=no" for key in words])):
        assert {key: getattr(cfg, key) for key in words} == words


# -- 2. ~ and $VARIABLES --------------------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LIPS_SETTINGS_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("LIPS_UNSET", raising=False)
    return tmp_path


def test_every_path_key_expands_home_and_variables_from_a_file_and_from_set(home, base, capsys):
    keys = path_keys()
    assert {"data_dir", "output_dir", "init_checkpoint"} <= set(keys)
    config = home / "paths.yaml"
    config.write_text("".join(f"{k}: ~/{k}\n" for k in keys))
    cfg = load_config(config)
    assert all(getattr(cfg, k) == str(home / k) for k in keys)
    cfg = load_config(None, [f"{k}=${{LIPS_SETTINGS_DIR}}/{k}" for k in keys])
    assert all(getattr(cfg, k) == str(home / "var" / k) for k in keys)
    for key in keys:
        refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--set", f"{key}=$LIPS_UNSET/x"], base,
                f"{key} $LIPS_UNSET/x: the environment variable LIPS_UNSET is not set")


def test_every_path_flag_of_every_command_expands_home_and_variables(home, base, capsys):
    flags = 0
    for name, (main, parser) in COMMANDS.items():
        for action in options(parser):
            if action.type not in PATH_TYPES:
                continue
            flag = max(action.option_strings, key=len, default=action.dest)
            for value, expected in (("~/a", home / "a"), ("$LIPS_SETTINGS_DIR/a", home / "var" / "a")):
                assert action.type(value) == str(expected), (name, flag)
            argv = [flag, "$LIPS_UNSET/a"] if action.option_strings else ["$LIPS_UNSET/a"]
            code, _, err = call(capsys, main, argv)
            assert code == 2 and err.count("\n") == 1 and "the environment variable LIPS_UNSET is not set" in err, \
                (name, flag, err)
            flags += 1
    assert flags >= 17


# -- 3. flags the chosen mode ignores ------------------------------------------------------------------------------
def _value(action, base: Path) -> list:
    if isinstance(action, argparse._StoreTrueAction):
        return []
    if action.dest == "set":
        return ["lr=1"]
    if action.choices:
        return [str(list(action.choices)[0])]
    if action.nargs == "+":
        return ["0.1"]
    if action.type is output_folder:
        return [str(base / "new_folder")]
    if action.type in PATH_TYPES:
        return [str(base / "cfg.yaml")]
    return ["1"]


BASES = {  # argv each row's case starts from: the first under which the row's flag would not act is used
    "train.py": [["--list-keys"]],
    "eval.py": [["--checkpoint", "run", "--data-dir", "data"],
                ["--model", "lipsformer_swin_t", "--pretrained", "--data-dir", "data"],
                ["--checkpoint", "run", "run_2", "--data-dir", "data"]],
}


def test_each_flag_a_mode_ignores_is_refused_naming_both(base, capsys):
    rows = 0
    for name, (main, parser) in COMMANDS.items():
        for row in parser.ignored:
            action = next(a for a in parser._actions if row.flag in a.option_strings)
            start = next(b for b in BASES[name] if not row.acts(parser.parse_args(b)))
            refused(capsys, main, start + [row.flag, *_value(action, base)], base, f"{row.flag} {row.says}")
            rows += 1
    assert rows >= 10
    # each row acts where its mode uses it: no refusal there
    ok = EVAL.build_parser().parse_args(["--checkpoint", "r", "--data-dir", "d", "--dataset", "imagenet_real",
                                         "--real-labels", "x", "--use-ema", "--attack-eps", "0.1",
                                         "--attack-steps", "2", "--attack-restarts", "1"])
    assert ok.attack_steps == 2


# -- 4. before the run folder: a bound no projection can keep -------------------------------------------------------
def test_lipschitz_target_on_a_model_it_cannot_keep_fails_before_anything_is_written(base, capsys, monkeypatch):
    cfg = ["--config", base / "cfg.yaml", "--lipschitz-target", "2"]
    refused(capsys, TRAIN.main, cfg, base, "lipschitz_target: stages.0.blocks.0.res_attn has no finite Lipschitz "
            "bound (SCSA with unnormalised v", "set v_norm=True")
    from lipsformer.layers.norm import CenterNorm
    from lipsformer.lipschitz import registry
    monkeypatch.delitem(registry.BOUNDS, CenterNorm)
    refused(capsys, TRAIN.main, cfg + ["--set", "model_kwargs.v_norm=true"], base,
            "lipschitz_target: no Lipschitz bound is registered for module 'patch_embed.norm' of type "
            "lipsformer.layers.norm.CenterNorm")


# -- 5. model constructors -----------------------------------------------------------------------------------------
POOL = [0, -1, 1.5, 1.0, -0.1, math.nan, True, "x"]  # None: timm.create_model drops it (not given)


def bad_arguments(name: str) -> dict:
    """``argument -> [values its constructor refuses]``: every scalar of the models' ARGUMENTS table with the pool
    values its test rejects, and the stage lists, sizes and splits that cannot build."""
    bad = {arg: [v for v in POOL if not test(v)] for arg, (test, _) in ARGUMENTS.items()}
    bad.update(depths=[(), (0, 1, 2, 1), (1, 1, 2, -1), 3, (1, 1, 2, 1, 1)], num_heads=[(0, 2, 4, 8), (3, 2, 4, 8)],
               img_size=[0, 30], global_pool=["nope"])
    if family(name) == "swin":
        bad.update(window_size=[0, 3])
    else:
        bad.update(split_size=[(0, 2, 2, 2), (1, 2, 3, 2), (1, 2)])
    return bad


@pytest.mark.parametrize("fam", ["swin", "cswin"])
def test_each_constructor_argument_with_a_bad_value_is_a_value_error_naming_it(fam):
    name = MODELS[fam]
    for arg, values in bad_arguments(name).items():
        for value in values:
            with pytest.raises(ValueError) as e:
                timm.create_model(name, **{**TINY[fam], "num_classes": 4, arg: value})
            said = {"num_heads": "num_heads", "depths": "depths"}.get(arg, arg)
            assert said in str(e.value) or (arg == "img_size" and "img_size" in str(e.value)) or \
                (arg in ("window_size", "split_size") and "split size" in str(e.value)), (arg, value, str(e.value))
    model = timm.create_model(name, **dict(TINY[fam], num_classes=4))
    for x in (torch.randn(3, 32, 32), torch.randn(1, 1, 32, 32), torch.randn(1, 3, 64, 64)):
        with pytest.raises(ValueError, match=r"input"):
            model(x)
    features = timm.create_model(name, **dict(TINY[fam], num_classes=0))  # timm's face: no classifier
    assert features(torch.randn(2, 3, 32, 32)).shape == (2, features.num_features)
    assert timm.create_model(name, **dict(TINY[fam], num_classes=1))(torch.randn(2, 3, 32, 32)).shape == (2, 1)


@pytest.mark.parametrize("fam", ["swin", "cswin"])
def test_each_constructor_argument_through_train_py_is_one_line(base, capsys, fam):
    """One refused value per argument (the first), set as train.py users set it: a top-level key where one sets
    that argument (MODEL_ARGS), else model_kwargs."""
    name = MODELS[fam]
    for arg, values in bad_arguments(name).items():
        if arg in MODEL_ARGS or isinstance(values[0], str):
            continue  # TrainConfig's own keys, ranges and types refuse those (tests/test_mistakes.py)
        kwargs = {k: v for k, v in dict(TINY[fam], **{arg: values[0]}).items() if k != "img_size"}
        text = yaml.safe_dump(kwargs, default_flow_style=True, width=10_000).strip()
        refused(capsys, TRAIN.main, ["--config", base / "cfg.yaml", "--set", f"model={name}", f"model_kwargs={text}"],
                base, f"{name}: ", arg)


# -- 6. several processes -------------------------------------------------------------------------------------------
def torchrun(tmp: Path, *args) -> subprocess.Popen:
    """train.py under torchrun on two CPU processes, started (both launches of the test run side by side)."""
    from helpers import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([str(Path(PY).with_name("torchrun")), "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(free_port()), str(ROOT / "train.py"), *map(str, args)],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_mistake_under_torchrun_is_said_once_and_every_process_exits_with_its_code(base, tmp_path):
    """Found by every process (a config key): the main process says it, both exit 2. Found by one process only (a
    data folder that rank 1 cannot see): that process says it naming its rank, and the other, waiting in a
    collective for it, stops too, with the same code, rather than hang."""
    make_folder(tmp_path / "data_0", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    every = torchrun(tmp_path, "--config", base / "cfg.yaml", "--output-dir", tmp_path / "run1", "--set", "lrr=1")
    one = torchrun(tmp_path, "--config", base / "cfg.yaml", "--output-dir", tmp_path / "run2", "--data-dir",
                   tmp_path / "data_$LOCAL_RANK", "--set", "global_batch=8")
    for proc, line in ((every, "error: unknown config key(s): lrr (did you mean lr?); train.py --list-keys lists them"),
                       (one, f"error: rank 1 of 2: data_dir {tmp_path / 'data_1'}: no such folder (it should hold "
                             f"train/ and val/, one sub-folder per class)")):
        said = proc.communicate(timeout=600)[0]
        assert proc.returncode != 0 and [x for x in said.splitlines() if x.startswith("error:")] == [line], said
        assert re.findall(r"exitcode +: (-?\d+)", said) == ["2", "2"], said  # torchrun's table: each rank's code
        assert "bug:" not in said
    assert not (tmp_path / "run1").exists() and not (tmp_path / "run2").exists()
