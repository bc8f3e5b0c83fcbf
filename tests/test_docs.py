"""The documentation cannot drift: every relative link in README.md and docs/*.md resolves (the file
exists; an ``#anchor`` is the GitHub slug of a heading of its target), and every command shown in their code
blocks is parsed by the tool it names: train.py's argv by ``train.build_parser()`` with its config loaded through
``load_config`` and the overrides (nothing trains), eval.py's by its own parser, ``python -m lipsformer.X`` and
``python benchmarks/X.py`` by theirs (parsed, then stopped before any work), ``make`` targets found in the
Makefile, ``pip`` extras in pyproject.toml, the SLURM scripts' arguments by train.py's parser. Every repository
file a command names exists. Python blocks compile, and run unless listed in NOT_RUN, on tiny models (TINY_MODEL,
the one substitution). A launch of train.py (torchrun, accelerate launch) also splits its global batch over the
processes it starts, as the run does first; the README's torchrun line runs as written. A command no rule handles
fails the test unless ALLOWED lists it with a reason."""
import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Shell commands no rule below handles, each with the reason it is shown anyway (exact text after joining lines).
ALLOWED = {
    "torchrun --nproc_per_node 2": "the launcher's options, in a sentence that names what it launches",
    "torchrun --nnodes 2 --node_rank {0,1}": "two launches in one: node rank 0 and 1",
    "torchrun --nproc_per_node 2 eval.py": "names the launch, in a sentence on what it gives (the test runs it)",
    "python -m lipsformer.<module>": "a pattern: every module of lipsformer that has a command line",
}

# Python blocks that are compiled but not run: (page, a line of the block) -> why.
NOT_RUN = {
    ("docs/lipschitz.md", "@register_bound(MyActivation)"):
        "a template: MyActivation is the reader's type, and registering it would change the process-wide registry",
}

# The one substitution for running Python blocks: a zoo model built by a snippet at the paper's size is built at
# this width and depth instead (at the snippet's input size); a keyword the snippet gives wins.
TINY_MODEL = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 8))

# Repository files a command may name; each must exist (generated outputs such as output/ are not checked).
REPO_FILE = re.compile(r"(?:^|[=\s'\"])((?:configs|examples|benchmarks|tests)/[\w./-]+\.(?:ya?ml|py|sh|sbatch))")


# ---------------------------------------------------------------------------------------------------- markdown


def fences(text: str):
    """(language, body, line number of the body's first line) of every fenced code block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if m:
            start = i + 1
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                i += 1
            out.append((m.group(2), "\n".join(lines[start:i]), start + 1))
        i += 1
    return out


def unfenced(text: str) -> str:
    """The text with fenced blocks blanked (same line numbers)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
            out.append("")
        else:
            out.append("" if inside else line)
    return "\n".join(out)


def prose(text: str) -> str:
    """The text outside fenced blocks, inline code removed (a link written in code is not a link)."""
    return re.sub(r"`[^`]*`", "", unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    seen: dict = {}
    for line in unfenced(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            yield base if n == 0 else f"{base}-{n}"


def link_problems(page: Path) -> list:
    problems = []
    text = page.read_text()
    body = prose(text)
    targets = [(m.group(1), body.count("\n", 0, m.start()) + 1)
               for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", body)]
    targets += [(m.group(1), body.count("\n", 0, m.start()) + 1)
                for m in re.finditer(r"^\s*\[[^\]]+\]:\s*(\S+)", body, re.M)]
    for target, line in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading with this anchor")
    return problems


# ---------------------------------------------------------------------------------------------------- commands


def shell_commands(body: str):
    """(command line, offset in lines) of a shell block: continuations (a trailing backslash, an open quote)
    joined, comments kept for shlex to drop."""
    out, pending, first = [], "", None
    for k, line in enumerate(body.splitlines()):
        if first is None:
            first = k
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        try:
            shlex.split(pending + line, comments=True)
        except ValueError:  # a quote spans lines, as bash allows
            pending += line + "\n"
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            out.append((command, first))
        first = None
    return out


class Parsed(SystemExit):
    """Raised by argparse once a command's arguments parsed: the command stops before doing any work."""


@contextlib.contextmanager
def parse_only(argv0: str, argv: list):
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    saved_argv, saved_env, threads = sys.argv, dict(os.environ), __import__("torch").get_num_threads()
    argparse.ArgumentParser.parse_args = parse_args
    sys.argv = [argv0, *argv]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        __import__("torch").set_num_threads(threads)


def run_parser(run, argv0: str, argv: list):
    """Run ``run()`` (a module or script as __main__) until its parser has read ``argv``; None when it parsed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), parse_only(argv0, argv):
            run()
    except Parsed:
        return None
    except SystemExit as e:
        return f"exit {e.code}: {err.getvalue().strip().splitlines()[-1:] or ''}"
    except Exception as e:  # noqa: BLE001 - reported as the command's problem
        return f"{type(e).__name__}: {e}"
    return "ran to the end without parsing its arguments (no argparse parser?)"


def load_script(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_train(argv: list, processes: int = 1):
    """train.py's ``argv`` parsed and its config loaded, and its global batch split over the ``processes`` the
    launch starts, as the run does before its first step (None, or what is wrong)."""
    try:
        _, cfg = train_config(argv)
        if cfg is not None:
            cfg.accumulation_steps(processes)
    except Exception as e:  # noqa: BLE001 - the doc's problem, one line
        return f"train.py: {type(e).__name__}: {e}"
    return None


def launched(nnodes: str, nproc_per_node: str) -> int:
    """The processes a torchrun line starts (nodes x processes per node), where the line says it (else 1)."""
    nodes = nnodes.split(":")[-1]
    return int(nodes) * int(nproc_per_node) if nodes.isdigit() and str(nproc_per_node).isdigit() else 1


def train_config(argv: list):
    """``(args, TrainConfig)`` of train.py's ``argv``, as train.py builds them (nothing trains); the config is None
    with --list-keys."""
    script = load_script("train.py")
    args = script.build_parser().parse_args(argv)
    return args, None if args.list_keys else script.config_from_args(args)


def check_script(script: str, argv: list, processes: int = 1):
    if script == "train.py":
        return check_train(argv, processes)
    if script == "eval.py":
        try:
            load_script("eval.py").build_parser().parse_args(argv)
        except Exception as e:  # noqa: BLE001
            return f"eval.py: {type(e).__name__}: {e}"
        return None
    if script.startswith("benchmarks/") and script.endswith(".py"):
        if not (ROOT / script).is_file():
            return f"{script}: no such file"
        def run():
            sys.path.insert(0, str((ROOT / script).parent))  # as python does for a script: its siblings import
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            finally:
                sys.path.remove(str((ROOT / script).parent))
        return run_parser(run, script, argv)
    return f"no rule for the script {script!r}"


def makefile_targets() -> set:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def extras() -> set:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def check_command(command: str, inline: bool = False):
    """None when the command is parsed by the tool it names, else what is wrong. ``inline``: a command quoted in
    prose, where naming a tool without arguments (`python -m lipsformer.convert`) is checked for existence only."""
    if command in ALLOWED:
        return None
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as e:
        return f"shlex: {e}"
    problems = [f"{path}: no such file" for path in REPO_FILE.findall(" " + " ".join(tokens))
                if not (ROOT / path).exists()]
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):  # environment assignments
        tokens = tokens[1:]
    if not tokens:
        return "; ".join(problems) or None
    head, rest = tokens[0], tokens[1:]
    if head in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
        problem = None  # the test files it names are checked above
    elif head in ("python", "python3") and rest[:1] == ["-m"]:
        module = rest[1]
        if not module.startswith("lipsformer.") or importlib.util.find_spec(module) is None:
            problem = f"python -m {module}: no such lipsformer module"
        elif inline and len(rest) == 2:
            problem = None
        else:
            problem = run_parser(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), module,
                                 rest[2:])
    elif head in ("python", "python3") and rest:
        if inline and len(rest) == 1 and rest[0] in ("train.py", "eval.py"):
            problem = None
        else:
            problem = check_script(rest[0], rest[1:])
    elif head == "accelerate" and rest[:1] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = launch_command_parser().parse_args(rest[1:])
            problem = check_script(args.training_script, args.training_script_args, args.num_processes or 1)
        except SystemExit:
            problem = "accelerate launch: its parser refused the options"
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = get_args_parser().parse_args(rest)
            problem = check_script(args.training_script, args.training_script_args,
                                   launched(args.nnodes, args.nproc_per_node))
        except SystemExit:
            problem = "torchrun: its parser refused the options"
    elif head == "make":
        missing = [t for t in rest if "=" not in t and not t.startswith("-") and t not in makefile_targets()]
        problem = f"make: no target {missing} in the Makefile" if missing else None
    elif head == "sbatch" and rest and rest[0].startswith("examples/slurm/"):
        # every argument after the script goes to train.py (see the script's header)
        problem = check_script("train.py", rest[1:]) if (ROOT / rest[0]).is_file() else f"{rest[0]}: no such file"
    elif head in (".", "source") and rest == [".venv/bin/activate"]:
        problem = None if "VENV := .venv" in (ROOT / "Makefile").read_text() else "the Makefile makes no .venv"
    elif head == "bash" and rest and (ROOT / rest[0]).is_file():
        problem = None  # a script of the repository; its own arguments are documented in its header
    elif head == "pip" and rest[:1] == ["install"]:
        wanted = [x for t in rest for m in re.findall(r"^\.\[([\w,-]+)\]$", t) for x in m.split(",")]
        unknown = sorted(set(wanted) - extras())
        problem = f"pip: no extra {unknown} in pyproject.toml" if unknown else None
    else:
        problem = f"no rule for {head!r} (add one to tests/test_docs.py, or list it in ALLOWED with a reason)"
    return "; ".join(dict.fromkeys(problems + ([problem] if problem else []))) or None


def doc_commands():
    for page in PAGES:
        for lang, body, line in fences(page.read_text()):
            if lang in ("bash", "sh", "shell", "console"):
                for command, offset in shell_commands(body):
                    yield f"{page.relative_to(ROOT)}:{line + offset}", command


INLINE_COMMAND = re.compile(r"^([A-Z_]+=\S+ )*"
                            r"(python3? |make |torchrun |accelerate launch |sbatch |bash |pip install )")


def inline_commands():
    """Commands quoted in prose (`python benchmarks/x.py --flag` inside a sentence, possibly across lines)."""
    for page in PAGES:
        text = unfenced(page.read_text())
        for m in re.finditer(r"`([^`]+)`", text):
            command = " ".join(m.group(1).split())
            if INLINE_COMMAND.match(command):
                yield f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", command


def python_blocks():
    for page in PAGES:
        for lang, body, line in fences(page.read_text()):
            if lang == "python":
                yield page, body, line


def named_paths(page: Path):
    """Repository paths a page names in prose (`lipsformer/run_folder.py`, configs/x.yaml, tests/y.py)."""
    text = unfenced(page.read_text())
    quoted = re.compile(r"`((?:lipsformer|configs|benchmarks|tests|examples|\.ci)/[\w./-]*)`")
    bare = re.compile(r"(?<![\w/`.])((?:lipsformer|configs|benchmarks|tests|examples)/[\w/-]+\.(?:py|ya?ml|sh|sbatch))")
    for pattern in (quoted, bare):
        for m in pattern.finditer(text):
            yield text.count("\n", 0, m.start()) + 1, m.group(1)


# ---------------------------------------------------------------------------------------------------- tests


def test_every_relative_link_and_anchor_resolves():
    problems = [p for page in PAGES for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_every_repository_path_the_docs_name_exists():
    named = [(page, line, path) for page in PAGES for line, path in named_paths(page)]
    assert len(named) >= 40
    missing = [f"{page.relative_to(ROOT)}:{line}: {path}" for page, line, path in named if not (ROOT / path).exists()]
    assert not missing, "no such file or folder:\n" + "\n".join(missing)


def test_every_shell_command_in_the_docs_is_parsed_by_its_tool():
    commands = list(doc_commands())
    assert len(commands) >= 20  # the pages show commands; an empty harvest is a broken harvester
    problems = [f"{where}: {command}\n    {problem}" for where, command in commands
                if (problem := check_command(command))]
    assert not problems, "\n".join(problems)


def test_every_command_quoted_in_prose_is_parsed_by_its_tool():
    # the measured figures cite their commands in the sentence that gives them: those drift as easily
    commands = list(inline_commands())
    assert len(commands) >= 40
    problems = [f"{where}: {command}\n    {problem}" for where, command in commands
                if (problem := check_command(command, inline=True))]
    assert not problems, "\n".join(problems)


def test_every_python_block_compiles_and_the_cheap_ones_run(monkeypatch, tmp_path):
    import timm
    create = timm.create_model

    def tiny(name, *args, **kwargs):
        if name.startswith("lipsformer_"):
            for key, value in TINY_MODEL.items():
                kwargs.setdefault(key, value)
        return create(name, *args, **kwargs)

    monkeypatch.setattr(timm, "create_model", tiny)
    monkeypatch.chdir(tmp_path)
    ran, done, blocks = 0, set(), list(python_blocks())
    assert len(blocks) >= 3
    listed = {key for key in NOT_RUN}
    for page, body, line in blocks:
        where = f"{page.relative_to(ROOT)}:{line}"
        code = compile(body, where, "exec")
        skip = [key for key in listed if key[0] == str(page.relative_to(ROOT)) and key[1] in body]
        if skip:
            listed -= set(skip)
            continue
        if body in done:  # the same snippet on two pages (README and its docs page) runs once
            continue
        exec(code, {"__name__": "doc_block"})
        done.add(body)
        ran += 1
    assert not listed, f"NOT_RUN names blocks that are no longer in the docs: {listed}"
    assert ran >= 2


# ---------------------------------------------------------------------------------------------------- a fresh shell

# What a README command may read without a command above it making it: the reader's own data and files, each
# introduced in the README's text.
USER_SUPPLIED = {
    "/data/": "the reader's ImageNet-style folders (the Install section names /data/imagenet and /data/mine)",
    "real.json": "the ReaL labels file, whose source the Evaluate section links",
}


def make_recipe(target: str) -> list:
    """The command lines of a Makefile target, ``$(PY)`` read as the venv's ``python``."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:(?!=)", line))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().replace("$(PY)", "python"))
    return recipe


def parsed(run, argv0: str, argv: list) -> argparse.Namespace:
    """The namespace the parser of ``run()`` (a module or script as __main__) makes of ``argv``."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), parse_only(argv0, argv):
            run()
    except Parsed as e:
        return e.code
    raise AssertionError(f"{argv0} did not parse its arguments")


def command_module(name: str):
    """The module ``python -m name`` runs (a package's ``__main__``)."""
    module = importlib.import_module(name)
    return importlib.import_module(f"{name}.__main__") if hasattr(module, "__path__") else module


def effects(command: str) -> tuple:
    """``(reads, makes)``: the folders and files a command reads that must exist before it, and the folders it
    makes, as the tools' own parsers and train.py's config read them."""
    tokens = shlex.split(command, comments=True)
    head, rest = tokens[0], tokens[1:]
    if head == "make":
        reads, makes = [], []
        for target in rest:
            for line in make_recipe(target):
                if not line.startswith("rm "):
                    r, m = effects(line)
                    reads += [p for p in r if p not in makes]
                    makes += m
        return reads, makes
    if head == "accelerate":
        from accelerate.commands.launch import launch_command_parser
        args = launch_command_parser().parse_args(rest[1:])
        head, rest = "python", [args.training_script, *args.training_script_args]
    if head == "torchrun":
        from torch.distributed.run import get_args_parser
        args = get_args_parser().parse_args(rest)
        head, rest = "python", [args.training_script, *args.training_script_args]
    if head == "sbatch":
        head, rest = "python", ["train.py", *rest[1:]]
    if head not in ("python", "python3") or not rest:
        return [], []
    if rest[0] == "train.py":
        args, cfg = train_config(rest[1:])
        if cfg is None:
            return [], []
        resume = [args.resume] if args.resume not in (None, "auto") else []
        return [p for p in (cfg.data_dir, cfg.init_checkpoint, *resume) if p], [cfg.output_dir]
    if rest[0] == "eval.py":
        args = load_script("eval.py").build_parser().parse_args(rest[1:])
        return [p for p in (*(args.checkpoint or []), args.data_dir, args.real_labels) if p], []
    if rest[0] == "-m" and rest[1] in ("lipsformer.data.digits", "lipsformer.data.mnist"):
        return [], [command_module(rest[1]).build_parser().parse_args(rest[2:]).root]
    if rest[0] == "-m" and rest[1] == "lipsformer.lipschitz":
        args = command_module(rest[1]).build_parser().parse_args(rest[2:])
        return [args.checkpoint] if args.checkpoint else [], []
    if rest[0] == "-m" and rest[1] == "lipsformer.convert":
        args = command_module(rest[1]).build_parser().parse_args(rest[2:])
        return [args.source], [args.out or "checkpoints"]
    if rest[0].startswith("benchmarks/"):
        def run():
            sys.path.insert(0, str((ROOT / rest[0]).parent))
            try:
                runpy.run_path(str(ROOT / rest[0]), run_name="__main__")
            finally:
                sys.path.remove(str((ROOT / rest[0]).parent))
        args = parsed(run, rest[0], rest[1:])
        return [], [args.out] if getattr(args, "out", None) else []
    return [], []


def readme_problems(text: str) -> list:
    """What would fail running the README's shell blocks top to bottom in a fresh clone and a fresh shell: a
    command before the venv is activated, or one that reads a folder or file no command above it makes."""
    problems, made, active = [], [], False
    for lang, body, line in fences(text):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for command, offset in shell_commands(body):
            where = f"README.md:{line + offset}: {command}"
            if command in ALLOWED:
                continue
            head = shlex.split(command, comments=True)[0]
            if head in (".", "source"):
                active = True
                continue
            if head in ("python", "python3", "pip", "accelerate", "torchrun", "sbatch") and not active:
                problems.append(f"{where}\n    runs before '. .venv/bin/activate' (a fresh shell has no lipsformer)")
            reads, makes = effects(command)
            for path in reads:
                norm = os.path.normpath(path)
                if not any(norm == m or norm.startswith(m + os.sep) for m in made) and \
                        not any(norm.startswith(u) if u.endswith("/") else norm == u for u in USER_SUPPLIED):
                    problems.append(f"{where}\n    reads {path}, which no command above it makes")
            made += [os.path.normpath(m) for m in makes]
    return problems


def test_the_readme_runs_top_to_bottom_in_a_fresh_clone_and_shell():
    """Every command the README shows runs as written after `make install` in a new shell: the venv is activated
    before the first command that needs it, and every checkpoint, run or data folder a command reads is made by a
    command above it (or is the reader's own data, USER_SUPPLIED)."""
    problems = readme_problems((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


def test_the_fresh_shell_check_catches_what_a_new_user_would_hit():
    good = "```bash\nmake install\n. .venv/bin/activate\npython -m lipsformer.data.digits output/digits\n" \
           "python train.py --config configs/demo_digits.yaml --output-dir output/run\n" \
           "python eval.py --checkpoint output/run --data-dir output/digits\n```\n"
    assert readme_problems(good) == []
    no_venv = good.replace(". .venv/bin/activate\n", "")
    assert any("before '. .venv/bin/activate'" in p for p in readme_problems(no_venv))
    no_run = good.replace("--checkpoint output/run", "--checkpoint output/other")
    assert [p.splitlines()[1].strip() for p in readme_problems(no_run)] == \
        ["reads output/other, which no command above it makes"]
    swapped = good.replace("python -m lipsformer.data.digits output/digits\n", "") + \
        "```bash\npython -m lipsformer.data.digits output/digits\n```\n"
    assert any("reads output/digits" in p for p in readme_problems(swapped))


# The checker itself: each kind of drift it exists for is caught (a missing file, a bad flag, a dead anchor, a
# config key that does not exist, a make target that does not exist).
@pytest.mark.parametrize("command, says", [
    ("python train.py --config configs/no_such_recipe.yaml", "no such file"),
    ("python train.py --config configs/demo_digits.yaml --no-such-flag 1", "no-such-flag"),
    ("python train.py --config configs/demo_digits.yaml --set lrr=1e-3", "lrr"),
    ("accelerate launch train.py --config configs/demo_digits.yaml --set epochs=zero", "epochs"),
    ("torchrun --nproc_per_node 2 eval.py --checkpoint x --data-dir y --no-such-flag", "no-such-flag"),
    ("torchrun --nproc_per_node 2 train.py --config configs/demo_digits.yaml",  # 64 over 2 processes of 64
     "global_batch 64 is not a multiple of batch_size 64 x 2 processes"),
    ("accelerate launch --num_processes 4 train.py --config configs/demo_digits.yaml --set batch_size=32",
     "global_batch 64 is not a multiple of batch_size 32 x 4 processes"),
    ("python eval.py --checkpoint x --data-dir y --dataset imagenet_v3", "imagenet_v3"),
    ("python -m lipsformer.lipschitz --model lipsformer_swin_t --no-such-flag", "exit 2"),
    ("python -m lipsformer.no_such_module", "no such lipsformer module"),
    ("python benchmarks/no_such_benchmark.py", "no such file"),
    ("python benchmarks/throughput.py --no-such-flag", "exit 2"),
    ("make no-such-target", "no target"),
    ("pip install -e \".[no-such-extra]\"", "no extra"),
    ("sbatch examples/slurm/train.sbatch --config configs/demo_digits.yaml --set nope=1", "nope"),
    ("curl https://example.com", "no rule"),
])
def test_the_checker_catches_a_broken_command(command, says):
    problem = check_command(command)
    assert problem and says in problem, problem


def test_the_checker_passes_good_commands_and_catches_dead_links(tmp_path):
    assert check_command("python train.py --config configs/demo_digits.yaml --set epochs=2 lr=1e-3") is None
    assert check_command("python -m lipsformer.flops --models lipsformer_swin_t --no-flops") is None
    assert check_command("make test") is None
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A title\n\n## Some `code`: here (in brief)\n")
    page.write_text("[a](other.md#some-code-here-in-brief) [b](other.md#gone) [c](missing.md) [d](#local)\n\n"
                    "## Local\n\n```bash\n[not a link](nowhere.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = link_problems(page)
    finally:
        ROOT = saved
    assert len(problems) == 2 and "other.md#gone" in problems[0] and "missing.md" in problems[1], problems


@pytest.mark.slow
def test_the_readme_torchrun_line_trains_as_written(tmp_path):
    """The README's torchrun line (docs/cluster.md shows the same), run as written in a fresh folder holding the
    digits the README's command above it writes: two processes train. SIGUSR1 to both (as SLURM's --signal does)
    once training has started: they go on to the first log step (10), checkpoint it and exit 75."""
    import signal
    import subprocess

    import psutil

    from lipsformer.data.digits import write_digits_folder
    readme = [c for where, c in doc_commands() if where.startswith("README.md") and c.startswith("torchrun ")]
    assert len(readme) == 1 and readme[0] in [c for where, c in doc_commands() if where.startswith("docs/cluster.md")]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "train.py").symlink_to(ROOT / "train.py")
    write_digits_folder(tmp_path / "output" / "digits")  # python -m lipsformer.data.digits output/digits
    tokens = shlex.split(readme[0], comments=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    proc = subprocess.Popen([str(Path(sys.executable).with_name("torchrun")), *tokens[1:]], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    try:  # a run that never says it (a hang) is stopped by pytest-timeout
        for line in proc.stdout:
            said.append(line)
            if line.startswith("weights: "):  # said once both processes are in the loop (and watch for signals)
                for worker in psutil.Process(proc.pid).children(recursive=True):
                    worker.send_signal(signal.SIGUSR1)
                break
        said += proc.stdout.readlines()
        proc.wait(timeout=600)
    finally:
        proc.kill()
    text = "".join(said)
    assert proc.returncode != 0 and "exitcode  : 75" in text and "preempted: SIGUSR1 received" in text, text[-3000:]
    assert "global_batch" not in text and sorted(p.name for p in (tmp_path / "output" / "ddp" / "checkpoints")
                                                 .iterdir()) == ["step_000000010"], text[-3000:]
