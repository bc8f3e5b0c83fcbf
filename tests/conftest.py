import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

import lipsformer  # noqa: F401  (registers the models)

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """A script of the repository (``eval.py``, ``benchmarks/throughput.py``), loaded as a module in this process
    (no interpreter start per call), under its file's stem."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A tiny, fast configuration of each family (init 'xavier' skips the SVDs where init is not the point).
TINY = {
    "swin": dict(img_size=32, embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 4, 8), window_size=2),
    "cswin": dict(img_size=32, embed_dim=16, depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 8), split_size=(1, 2, 2, 2)),
}


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide state (AcceleratorState, GradientState), so the next Accelerator in this
    process starts from its own arguments."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    """Reset Accelerate's state after the test (modules that train in-process use it for every test)."""
    yield
    reset_accelerate()


def config_model(cfg) -> torch.nn.Module:
    """A run's model as its config builds it, without weights (train.py's start from scratch)."""
    from lipsformer.build import build_model
    return build_model(cfg.model, **cfg.model_args()).model


def start_model(cfg):
    """A run's model and its :class:`~lipsformer.build.ModelStart` as train.py's ``_start`` makes them: the weights
    its config names (``pretrained`` / ``init_checkpoint``), then the modules it freezes."""
    from lipsformer.build import build_model
    from lipsformer.engine.finetune import freeze, starting_weights
    with starting_weights(cfg, resumed=False) as source:
        model, start = build_model(**source, **cfg.model_args())
    start.frozen = freeze(model, cfg)
    return model, start


def family(name: str) -> str:
    return "cswin" if "cswin" in name else "swin"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _stop_signals():
    """The stop signals' handlers as the test found them: a run preempted in this process holds them ignored for
    its shutdown (lipsformer.errors.hold_stop_signals), as the program does until it exits."""
    yield
    from lipsformer.errors import release_stop_signals
    release_stop_signals()


@pytest.fixture(autouse=True)
def _threads():
    """Torch's thread count as the test found it: a benchmark's ``--threads 1`` run in this process would otherwise
    leave every later test on one thread."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- what the mistake tests run against (test_mistakes.py, test_door_writes.py) -----------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny image folder (4 classes, 16 train and 4 val images), its config, a finished one-epoch run of it (4
    steps, checkpoints at 2 and 4), and a file where a folder belongs."""
    from helpers import RUN, make_folder
    from lipsformer.config import load_config
    from lipsformer.engine.train import train
    root = tmp_path_factory.mktemp("mistakes")
    make_folder(root / "data", train_per_class=(4, 4, 4, 4), val_per_class=(1, 1, 1, 1))
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(dict(RUN, data_dir=str(root / "data"), output_dir=str(root / "out"))))
    train(load_config(cfg, [f"output_dir={root / 'run'}"]))
    reset_accelerate()
    (root / "a_file").write_text("not a folder")
    (root / "bad.yaml").write_text("model: [lipsformer_swin_t\nlr: 1\n")
    return root


class OpNames(TorchDispatchMode):
    """Counts the ops run inside it by name (``names``: ``addmm``, ``add``, ...)."""

    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))
