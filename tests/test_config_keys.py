"""Every TrainConfig key is live: set to a non-default value, it changes something a user can observe.

``KEYS`` maps every field of TrainConfig to ``Case(value, check)``. All values are set at once in one
configuration, which is built (``_start``: accelerator, model, loaders, optimizer, schedule, EMA, criterion,
bound keeping), trained one epoch by hand, and also trained in full by ``train()`` (two epochs of three
updates on a tiny model); each ``check(probe)`` asserts what its key changed. A key whose value cannot share
that configuration (``dataset``: streamed data) is ``alone``: its check builds what it needs from the probe.
``test_the_table_covers_every_key`` fails when a key is added to TrainConfig without a case here, so a dead
or untested key fails the suite.

A key is declared once, in its field (``key(default, help, ...)``):
``test_a_key_is_declared_in_its_field_and_nowhere_else`` fails on a table of key names anywhere else,
``test_every_key_has_its_key_metadata_and_help`` on a field without help; docs/keys.md is generated from
the fields. To add a key (lipsformer/config.py says how): here, one ``Case`` in ``KEYS`` with a
value other than the default and a check against the probe.
"""
import ast
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
import yaml
from safetensors.torch import load_file
from timm.data.transforms import RandomResizedCropAndInterpolation
from timm.layers import DropPath
from torchvision import transforms as T

from lipsformer.config import ConfigError, Key, TrainConfig, key_table, load_config
from lipsformer.run_folder import RunFolder

from conftest import config_model, reset_accelerate
from helpers import make_folder, make_wds, read_metrics

LR, MIN_LR, UPDATES_PER_EPOCH = 1e-3, 1e-4, 3  # 24 images, batch 4, accumulation 2


@dataclass
class Probe:
    cfg: TrainConfig
    tmp: Path
    run: Any  # lipsformer.engine.train._Run built by _start (output_dir: tmp/objects), then trained one epoch
    # (its accelerator's state is reset before train() runs: read accelerator settings from ``initial``)
    initial: Dict[str, Any]  # what the run held right after _start, before any update
    keep_calls: int  # keep_bound calls during the hand-run epoch (after the one at start)
    clip_max_norms: List[float]  # max_norm of every gradient clip during that epoch
    nan_step: Any  # the updates skipped, as the next read step counts them, after an update of NaN images
    summary: Dict[str, Any]  # train(cfg) in full
    rows: List[dict] = field(default_factory=list)  # its metrics.jsonl

    def epochs(self):
        return [r for r in self.rows if r["kind"] == "epoch"]

    def train_rows(self):
        return [r for r in self.rows if r["kind"] == "train"]


@dataclass
class Case:
    value: Any
    check: Callable[[Probe], Any]
    alone: bool = False  # set only in its own check, not in the shared configuration


def _transforms(loader) -> list:
    return list(loader.dataset.transform.transforms)


def _of_type(loader, kind) -> list:
    return [t for t in _transforms(loader) if isinstance(t, kind)]


def _lr_ramp(p: Probe):
    """Warmup: linear from min_lr to lr over the first epoch's updates (timm's warmup_t), logged per step."""
    lrs = [r["lr"] for r in p.train_rows()]
    expected = [MIN_LR + t * (LR - MIN_LR) / UPDATES_PER_EPOCH for t in range(1, UPDATES_PER_EPOCH)] + [LR]
    assert lrs[:UPDATES_PER_EPOCH] == pytest.approx(expected, rel=1e-12)


def _dataset_is_streamed_and_seeded(p: Probe):
    from lipsformer.engine.train import build_loaders, create_accelerator
    shards = make_wds(make_folder(p.tmp / "wds_folder"), p.tmp / "shards")
    cfg = dataclasses.replace(p.cfg, dataset="wds/tiny", data_dir=str(shards), train_split="train",
                              val_split="val")
    try:
        train_loader, _, _ = build_loaders(cfg, p.run.model, create_accelerator(cfg))
    finally:
        reset_accelerate()
    assert isinstance(train_loader.dataset, torch.utils.data.IterableDataset)
    assert train_loader.dataset.reader.common_seed == p.cfg.seed


def _spectral_norms(model) -> List[float]:
    return [torch.linalg.matrix_norm(m.weight.detach(), 2).item() for m in model.modules()
            if isinstance(m, torch.nn.Linear)]


def _finetune(p: Probe, **keys):
    """The probe's configuration with fine-tuning keys set, started from the probe's finished run folder."""
    from conftest import start_model
    init = {} if "pretrained" in keys else dict(init_checkpoint=p.cfg.output_dir)
    if keys.get("freeze") or keys.get("freeze_stages"):  # bound keeping and a frozen backbone are refused together
        init.update(lipschitz_target=None, lipschitz_conv_max=None)
    return start_model(dataclasses.replace(p.cfg, **dict(init, **keys)))


def _same_weights(model, path, but=()) -> bool:
    weights = load_file(str(path))
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items() if not k.startswith(but))


def _published_tag_loads(p: Probe):
    """timm's pretrained path, offline: the probe's last weights, in the released layout, planted in timm's cache."""
    import os
    from lipsformer.models.lipsformer_swin import released_state_dict
    model, _ = _finetune(p, init_checkpoint=p.cfg.output_dir)
    cache = p.tmp / "torch_home"
    (cache / "hub" / "checkpoints").mkdir(parents=True, exist_ok=True)
    torch.save(released_state_dict(model), cache / "hub" / "checkpoints" / "lipsformer-swin-tiny.pth")
    saved = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(cache)
    try:
        loaded, start = _finetune(p, pretrained="lipsformer_swin_t.official_in1k")
    finally:
        os.environ.pop("TORCH_HOME") if saved is None else os.environ.__setitem__("TORCH_HOME", saved)
    assert start.source == "lipsformer_swin_t.official_in1k"
    weights = load_file(str(RunFolder(p.cfg.output_dir).weights()))  # the released layout has no learnable tau
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items() if not k.endswith(".tau"))


def _layer_decay_scales(p: Probe):
    from lipsformer.engine.train import build_optimizer
    model, _ = _finetune(p)
    scales = sorted({g["lr_scale"] for g in build_optimizer(dataclasses.replace(p.cfg, layer_decay=0.5),
                                                            model).param_groups})
    assert scales[-1] == 1.0 and scales[0] == 0.5 ** (len(scales) - 1)

def _decayed_lrs(p: Probe, **keys) -> List[float]:
    """The lr after each update of the probe's two epochs, with the schedule keys given (no warmup)."""
    from lipsformer.engine.train import build_scheduler
    cfg = dataclasses.replace(p.cfg, warmup_epochs=0, **keys)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = build_scheduler(cfg, opt, UPDATES_PER_EPOCH)
    out = []
    for t in range(1, 2 * UPDATES_PER_EPOCH + 1):
        sched.step_update(t)
        out.append(opt.param_groups[0]["lr"])
    return out


def _attlip_steps(p: Probe, schedule) -> list:
    """Every AttLip module's training steps in each of the probe's two epochs, as the loop sets them (the probe's
    model has no AttLip: a tiny one with it; tests/test_certified.py trains and resumes with the key)."""
    from lipsformer.engine.train import set_attlip_steps
    from lipsformer.layers.attlip import AttLip
    cfg = dataclasses.replace(p.cfg, attlip_train_steps=schedule, model_kwargs=dict(p.cfg.model_kwargs, attn="attlip"))
    model = config_model(cfg)
    out = []
    for epoch in range(cfg.epochs):
        set_attlip_steps(model, cfg, epoch)
        out.append({m.train_steps for m in model.modules() if isinstance(m, AttLip)})
    return out


def _mlflow(p: Probe, override: str) -> dict:
    """The MLflow run (a local file store) of a run folder whose trackers start with ``override`` set."""
    from helpers import start_mlflow
    return start_mlflow(p.tmp, p.tmp / override.split("=")[0], [override])


_SPEED: Dict[str, Any] = {}


def _speed_start(p: Probe) -> Dict[str, Any]:
    """What _start hands the compiler and the process with compile, compile_mode, compile_memory_budget and tf32
    set (compiling is lazy: nothing is compiled until a forward pass, so this costs one build)."""
    if not _SPEED:
        import torch._functorch.config as functorch_config
        from lipsformer.engine.speed import set_tf32
        from lipsformer.engine.train import _start
        cfg = dataclasses.replace(p.cfg, output_dir=str(p.tmp / "speed"), **{k: KEYS[k].value for k in SPEED_KEYS})
        from lipsformer.layers import LipsBlock
        calls, compile_ = [], torch.compile
        budget = functorch_config.activation_memory_budget
        torch.compile = lambda fn, **k: calls.append(k) or compile_(fn, **k)
        try:
            run = _start(cfg, None)
            blocks = [m for m in run.model.modules() if isinstance(m, LipsBlock)]
            _SPEED.update(compile=calls, budget=functorch_config.activation_memory_budget,
                          tf32=(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
                          compiled=bool(blocks) and all(b.compiled_body is not None for b in blocks))
        finally:
            torch.compile = compile_
            functorch_config.activation_memory_budget = budget
            set_tf32(False)
            reset_accelerate()
    return _SPEED


SPEED_KEYS = ("compile", "compile_mode", "compile_memory_budget", "tf32")

KEYS: Dict[str, Case] = {
    # model
    "model": Case("lipsformer_swin_t", lambda p: p.run.model.pretrained_cfg["architecture"] == "lipsformer_swin_t"),
    "model_kwargs": Case(dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=2,
                              v_norm=True, learn_tau=True),
                         lambda p: p.run.model.num_features == 16 * 8 and len(p.run.model.stages[2].blocks) == 1),
    "num_classes": Case(4, lambda p: p.initial["logits"].shape == (4, 4)),
    "drop_path": Case(0.1, lambda p: max(m.drop_prob for m in p.run.model.modules() if isinstance(m, DropPath))
                      == pytest.approx(0.1)),
    "img_size": Case(32, lambda p: p.initial["val_batch"].shape[-2:] == (32, 32)
                     and p.initial["train_batch"].shape[-2:] == (32, 32)),
    "crop_pct": Case(1.0, lambda p: _of_type(p.run.val_loader, T.Resize)[0].size == 32),  # 0.9: 35
    "interpolation": Case("bilinear", lambda p: _of_type(p.run.val_loader, T.Resize)[0].interpolation
                          == T.InterpolationMode.BILINEAR),
    # data
    "data_dir": Case("<tmp>/data", lambda p: Path(p.run.train_loader.dataset.reader.root).parent
                     == Path(p.cfg.data_dir)),
    "dataset": Case("wds/tiny", _dataset_is_streamed_and_seeded, alone=True),
    "train_split": Case("tr", lambda p: Path(p.run.train_loader.dataset.reader.root).name == "tr"),
    "val_split": Case("va", lambda p: Path(p.run.val_loader.dataset.reader.root).name == "va"),
    "workers": Case(0, lambda p: p.run.train_loader.num_workers == 0 and p.run.val_loader.num_workers == 0),
    "max_bad_fraction": Case(0.1, lambda p: [r["bad_samples"] for r in p.epochs()] == [1, 1]),  # 1 of 24: > 1%
    # optimisation
    "epochs": Case(2, lambda p: [r["epoch"] for r in p.epochs()] == [1, 2]),
    "global_batch": Case(8, lambda p: p.initial["accumulation"] == 2
                         and p.summary["step"] == 2 * UPDATES_PER_EPOCH),
    "batch_size": Case(4, lambda p: p.initial["train_batch"].shape[0] == 4),
    "opt": Case("adam", lambda p: type(p.run.optimizer.optimizer) is torch.optim.Adam),
    "lr": Case(LR, lambda p: p.run.scheduler.base_values[0] == LR),
    "betas": Case((0.8, 0.99), lambda p: all(g["betas"] == (0.8, 0.99) for g in p.run.optimizer.param_groups)),
    "eps": Case(1e-6, lambda p: all(g["eps"] == 1e-6 for g in p.run.optimizer.param_groups)),
    "weight_decay": Case(0.02, lambda p: max(g["weight_decay"] for g in p.run.optimizer.param_groups) == 0.02),
    "sched": Case("constant", lambda p: {r["lr"] for r in p.train_rows()[UPDATES_PER_EPOCH:]} == {LR}),  # no decay
    "warmup_epochs": Case(1, _lr_ramp),
    # the decay keys act on the schedules that read them (step / multistep / poly), refused on the others
    "decay_epochs": Case(1.0, lambda p: _decayed_lrs(p, sched="step", decay_epochs=1.0)  # x0.1 every 3 updates
                         == pytest.approx([LR, LR, LR * 0.1, LR * 0.1, LR * 0.1, LR * 0.01]), alone=True),
    "decay_milestones": Case([1], lambda p: _decayed_lrs(p, sched="multistep", decay_milestones=[1])[::5]
                             == pytest.approx([LR, LR * 0.1]), alone=True),  # once (timm: one update early)
    "decay_rate": Case(0.5, lambda p: _decayed_lrs(p, sched="step", decay_epochs=1.0, decay_rate=0.5)[-1]
                       == pytest.approx(LR * 0.25), alone=True),
    "min_lr": Case(MIN_LR, lambda p: p.initial["lr"] == MIN_LR),  # where the warmup starts
    "clip_grad": Case(0.5, lambda p: p.clip_max_norms == [0.5] * UPDATES_PER_EPOCH),
    "label_smoothing": Case(0.2, lambda p: p.run.mixup.label_smoothing == 0.2),
    "aa": Case(None, lambda p: not any("RandAugment" in type(t).__name__ for t in _transforms(p.run.train_loader))),
    "reprob": Case(0.0, lambda p: not any("RandomErasing" in type(t).__name__
                                          for t in _transforms(p.run.train_loader))),
    "hflip": Case(0.0, lambda p: not _of_type(p.run.train_loader, T.RandomHorizontalFlip)),
    "scale": Case((0.5, 1.0), lambda p: _of_type(p.run.train_loader, RandomResizedCropAndInterpolation)[0].scale
                  == (0.5, 1.0)),
    "mixup": Case(0.5, lambda p: p.run.mixup.mixup_alpha == 0.5),
    "cutmix": Case(0.5, lambda p: p.run.mixup.cutmix_alpha == 0.5),
    "ema_decay": Case(0.9, lambda p: p.run.ema.decay == 0.9 and all("ema_top1" in r for r in p.epochs()[1:])),
    "mixed_precision": Case("no", lambda p: p.initial["mixed_precision"] == "no"),
    # run
    # the position table: drawn at build and touched by no bound keeping (lipschitz_conv_max rescales patch_embed)
    "seed": Case(7, lambda p: torch.equal(p.initial["position_table"], p.initial["position_table_seed_7"])),
    "output_dir": Case("<tmp>/run", lambda p: yaml.safe_load(RunFolder(p.cfg.output_dir).config.read_text())
                       ["output_dir"] == p.cfg.output_dir and RunFolder(p.cfg.output_dir).weights().is_file()),
    "checkpoint_every_steps": Case(1, lambda p: [c.name for c in RunFolder(p.cfg.output_dir).finished_checkpoints()]
                                   == [f"step_{s:09d}" for s in (3, 4, 5, 6)]),  # every 1000: epoch ends only
    "keep_last": Case(4, lambda p: len(RunFolder(p.cfg.output_dir).finished_checkpoints()) == 4),
    "on_nonfinite": Case("skip", lambda p: p.nan_step == 1),  # skipped and counted; "stop" raises TrainingDiverged
    "log_every_steps": Case(1, lambda p: [r["step"] for r in p.train_rows()] == list(range(1, 7))),
    "eval_every_epochs": Case(2, lambda p: "top1" not in p.epochs()[0] and "top1" in p.epochs()[1]),
    # best.safetensors still, but no best/ (the default keeps the 10 best epochs' weights there)
    "keep_best": Case(0, lambda p: RunFolder(p.cfg.output_dir).best.is_file()
                      and not (Path(p.cfg.output_dir) / "best").exists()),
    # trackers (tests/test_run_outputs.py reads wandb's and MLflow's runs back): none, so no TensorBoard events
    "log_with": Case([], lambda p: RunFolder(p.cfg.output_dir).weights().is_file()
                     and not list(Path(p.cfg.output_dir).rglob("events.out.tfevents*"))),
    "tracker_project": Case("proj", lambda p: _mlflow(p, "tracker_project=proj")["experiment"] == "proj", alone=True),
    "tracker_run_name": Case("named", lambda p: _mlflow(p, "tracker_run_name=named")["run"].info.run_name == "named",
                             alone=True),
    # bound keeping
    "lipschitz_target": Case(1e20, lambda p: all(0 < r["lipschitz_bound"] <= 1e20 for r in p.epochs())),
    "lipschitz_gamma_max": Case(0.5, lambda p: p.initial["max_gamma"] == 0.5),  # initialised at 1
    "lipschitz_weight_max": Case(0.9, lambda p: max(p.initial["spectral_norms"]) <= 0.9 + 1e-5),
    # after step 2, and at the epoch's end (step 3), so that the weights evaluated and saved are projected
    "lipschitz_every_steps": Case(2, lambda p: p.keep_calls == UPDATES_PER_EPOCH // 2 + 1),
    "lipschitz_conv_max": Case(0.5, lambda p: max(p.initial["conv_bounds"]) <= 0.5 + 1e-6),  # kept at _start
    "margin_eps": Case(0.1, lambda p: p.run.criterion.eps == 0.1 and p.run.criterion.margin > 0),
    "margin_bound": Case(2.0, lambda p: p.run.criterion.bound == 2.0),  # fixed, not the kept bound
    "lipschitz_tau_max": Case(5.0, lambda p: p.initial["taus"] and max(p.initial["taus"]) == 5.0),  # initialised 10
    "attlip_train_steps": Case([1, 3], lambda p: _attlip_steps(p, [1, 3]) == [{1}, {3}], alone=True),
    # speed (lipsformer.engine.speed)
    "compile": Case(True, lambda p: _speed_start(p)["compiled"] and len(_speed_start(p)["compile"]) == 1,
                    alone=True),
    # on the CPU the mode reaches the compiler as its options, with inductor's layout optimisation off
    "compile_mode": Case("max-autotune-no-cudagraphs", lambda p: _speed_start(p)["compile"] == [dict(
        backend="inductor", mode=None, options={**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
                                                "layout_optimization": False}, dynamic=False)], alone=True),
    "compile_memory_budget": Case(0.5, lambda p: _speed_start(p)["budget"] == 0.5, alone=True),
    "tf32": Case(True, lambda p: _speed_start(p)["tf32"] == (True, True), alone=True),
    "channels_last": Case(True, lambda p: p.run.accelerator.unwrap_model(p.run.model).patch_embed.proj.weight
                          .is_contiguous(memory_format=torch.channels_last)),
    "grad_checkpointing": Case(True, lambda p: all(s.grad_checkpointing for s in
                                                    p.run.accelerator.unwrap_model(p.run.model).stages)),
    # fine-tuning (tests/test_finetune.py covers each in depth)
    "pretrained": Case("lipsformer_swin_t.official_in1k", _published_tag_loads, alone=True),
    "init_checkpoint": Case("<tmp>/run", lambda p: _same_weights(_finetune(p)[0], RunFolder(p.cfg.output_dir)
                                                                 .weights()), alone=True),
    "init_use_ema": Case(True, lambda p: _same_weights(_finetune(p, init_use_ema=True)[0],
                                                       RunFolder(p.cfg.output_dir).weights(ema=True)), alone=True),
    "reset_head": Case(True, lambda p: _finetune(p, reset_head=True)[1].reinitialised == ["head.fc.weight",
                                                                                          "head.fc.bias"]
                       and _same_weights(_finetune(p, reset_head=True)[0], RunFolder(p.cfg.output_dir).weights(),
                                         but=("head.fc.",)), alone=True),
    "layer_decay": Case(0.5, _layer_decay_scales, alone=True),
    "freeze": Case("backbone", lambda p: [n for n, q in _finetune(p, freeze="backbone")[0].named_parameters()
                                          if q.requires_grad] == ["head.fc.weight", "head.fc.bias"], alone=True),
    "freeze_stages": Case(1, lambda p: [n for n, q in _finetune(p, freeze_stages=1)[0].named_parameters()
                                        if not q.requires_grad]
                          == [n for n, _ in _finetune(p)[0].named_parameters()
                              if n.startswith(("patch_embed.", "stages.0."))], alone=True),
}


def _position_table(model) -> torch.Tensor:
    return model.stages[0].blocks[0].attn.relative_position_bias_table.detach().clone()


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from accelerate.utils import set_seed
    from lipsformer.engine.metrics import EpochMeter
    from lipsformer.engine.step import StepTally
    from lipsformer.engine.train import _read, _start, _train_step, train, train_one_epoch
    from lipsformer.layers import AttentionKernel, CenterNorm
    from lipsformer.lipschitz import conv_bound
    from lipsformer.lipschitz.constraints import conv_input_sizes
    tmp = tmp_path_factory.mktemp("keys")
    data = make_folder(tmp / "data")
    (data / "train").rename(data / "tr")
    (data / "val").rename(data / "va")
    (data / "tr" / "class_2" / "1.jpg").write_bytes(b"")  # one unreadable training image of 24
    values = {k: c.value for k, c in KEYS.items() if not c.alone}
    values.update(data_dir=str(data), output_dir=str(tmp / "run"))
    cfg = load_config(None, [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                             for k, v in values.items()])

    run = _start(dataclasses.replace(cfg, output_dir=str(tmp / "objects")), None)
    model = run.accelerator.unwrap_model(run.model)
    model.eval()
    train_batch = next(iter(run.train_loader))[0]
    val_batch = next(iter(run.val_loader))[0]
    set_seed(7)
    initial = dict(
        train_batch=train_batch, val_batch=val_batch, lr=run.optimizer.param_groups[0]["lr"],
        accumulation=run.accelerator.gradient_accumulation_steps, mixed_precision=run.accelerator.mixed_precision,
        logits=model(val_batch[:4]).detach(), patch_embed=model.patch_embed.proj.weight.detach().clone(),
        position_table=_position_table(model),
        position_table_seed_7=_position_table(config_model(cfg)),
        max_gamma=max(m.weight.abs().max().item() for m in model.modules() if isinstance(m, CenterNorm)),
        spectral_norms=_spectral_norms(model),
        taus=[float(m.tau.detach()) for m in model.modules() if isinstance(m, AttentionKernel)],
        conv_bounds=[conv_bound(c, hw) for c, hw in conv_input_sizes(model).items()])
    calls, norms = [], []
    keep, clip = run.keep, run.accelerator.clip_grad_norm_
    run.keep = lambda: calls.append(1) or keep()
    run.accelerator.clip_grad_norm_ = lambda params, max_norm, *a, **k: norms.append(max_norm) or clip(
        params, max_norm, *a, **k)
    train_one_epoch(run, 0)
    keep_calls, clip_norms = len(calls), list(norms)
    images, targets, _ = next(iter(run.train_loader))
    meter, skipped = EpochMeter(tally=StepTally(run.accelerator.device, 1)), run.state.skipped_steps
    while not meter.tally.updates:  # the batches of one update, all NaN; then the read step's verdict
        _train_step(run, meter, torch.full_like(images, math.nan), targets, 0)
    _read(run, meter, 0)
    nan_step = run.state.skipped_steps - skipped
    reset_accelerate()

    summary = train(cfg)
    reset_accelerate()
    return Probe(cfg, tmp, run, initial, keep_calls, clip_norms, nan_step, summary,
                 read_metrics(Path(cfg.output_dir)))


def test_the_table_covers_every_key_with_a_non_default_value():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(KEYS) == sorted(names), "every TrainConfig key needs a Case in KEYS (and no other)"
    default = TrainConfig()
    same = [k for k, c in KEYS.items() if c.value == getattr(default, k)]
    assert not same, f"these cases set the default value, so they cannot show the key is live: {same}"


# -- one place for a key: its field ---------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# Module-level tables outside the fields that name keys, each with the reason it is no property of the key.
OTHER_TABLES = {("train.py", "FLAG_KEYS"): "train.py's own options that set a key: the command line's spelling"}


def _strings(node: ast.AST) -> List[str]:
    """The strings a literal table holds at its top level: a dict's keys and values, a list's, tuple's or set's
    elements, ``dict(...)``'s argument names and values."""
    if isinstance(node, ast.Dict):
        items = [*node.keys, *node.values]
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict":
        return [k.arg for k in node.keywords if k.arg] + _strings(ast.Dict([], [k.value for k in node.keywords]))
    else:
        return []
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def key_tables() -> Dict[tuple, List[str]]:
    """``(file, name) -> the keys it names`` for every module-level literal table of lipsformer/, train.py and
    eval.py whose strings are mostly TrainConfig keys (two or more)."""
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    found = {}
    for file in [*sorted((ROOT / "lipsformer").rglob("*.py")), ROOT / "train.py", ROOT / "eval.py"]:
        for node in ast.parse(file.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            strings = _strings(node.value) if targets else []
            named = [s for s in strings if s in keys]
            if len(named) >= 2 and 2 * len(named) >= len(strings):
                found[(str(file.relative_to(ROOT)), getattr(targets[0], "id", "?"))] = named
    return found


def test_a_key_is_declared_in_its_field_and_nowhere_else():
    """Ranges, choices, paths, what a resume keeps, what bound keeping and the margin read, the model arguments:
    each is the field's ``key(...)`` metadata, never a table of key names beside it (config.py included)."""
    tables = key_tables()
    assert set(tables) == set(OTHER_TABLES), (f"declare these keys' properties in their fields "
                                              f"(lipsformer/config.py key(...)): {tables}")
    from conftest import load_script
    assert set(load_script("train.py").FLAG_KEYS.values()) <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_every_key_has_its_key_metadata_and_help():
    """A field added without ``key(default, help, ...)`` fails here (and lists no help in --list-keys)."""
    bare = [f.name for f in dataclasses.fields(TrainConfig)
            if not isinstance(f.metadata.get("key"), Key) or not f.metadata["key"].help.strip()]
    assert not bare, f"declare these fields with key(default, help, ...) (lipsformer/config.py): {bare}"


def test_docs_key_table_is_generated_from_the_fields():
    assert (ROOT / "docs" / "keys.md").read_text() == key_table(), (
        "docs/keys.md is generated: python -c 'from lipsformer.config import key_table; "
        "print(key_table(), end=\"\")' > docs/keys.md")

@pytest.mark.parametrize("key", sorted(KEYS))
def test_key_changes_something_observable(probe, key):
    result = KEYS[key].check(probe)
    assert result is None or result, f"{key}={KEYS[key].value!r} left no trace"


def test_default_schedule_is_todays_cosine_without_warmup_step_for_step():
    from timm.scheduler import CosineLRScheduler
    from lipsformer.engine.train import build_scheduler
    cfg = TrainConfig(epochs=3)

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = make(opt)
        out = []
        for t in range(3 * 5 + 1):
            sched.step_update(t)
            out.append(opt.param_groups[0]["lr"])
        return out

    ours = lrs(lambda opt: build_scheduler(cfg, opt, 5))
    before = lrs(lambda opt: CosineLRScheduler(opt, t_initial=3 * 5, lr_min=cfg.min_lr, warmup_t=0,
                                               warmup_lr_init=cfg.min_lr, t_in_epochs=False))
    assert ours == before  # bit-identical
    assert ours[0] == cfg.lr and ours[-1] == pytest.approx(cfg.min_lr)


def test_warmup_ramps_as_timms_scheduler_does(probe):
    """The run's logged lr per update against timm's own scheduler built independently."""
    from timm.scheduler import StepLRScheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    timm_sched = StepLRScheduler(opt, decay_t=1, decay_rate=1.0, warmup_t=UPDATES_PER_EPOCH,
                                 warmup_lr_init=MIN_LR, t_in_epochs=False)
    expected = []
    for t in range(1, 2 * UPDATES_PER_EPOCH + 1):
        timm_sched.step_update(t)
        expected.append(opt.param_groups[0]["lr"])
    assert [r["lr"] for r in probe.train_rows()] == expected
    assert expected[0] < expected[1] < expected[2] == LR  # it does ramp


@pytest.mark.parametrize("override, message", [
    ("model_kwargs.img_size=64", "model_kwargs.img_size duplicates the top-level key img_size"),
    ("model_kwargs.drop_path_rate=0.3", "model_kwargs.drop_path_rate duplicates the top-level key drop_path"),
    ("model_kwargs.num_classes=10", "model_kwargs.num_classes duplicates the top-level key num_classes"),
    ("sched=plateau", "sched must be one of"),
    ("warmup_epochs=-1", "warmup_epochs must be at least 0"),
    ("lipschitz_tau_max=0", "lipschitz_tau_max must be positive"),
    ("max_bad_fraction=1.5", "max_bad_fraction must be in [0, 1]"),
    ("batch_size=3", "mixup/cutmix need an even batch_size"),
    ("num_classes=-5", "num_classes must be at least 2"),
    ("num_classes=0", "num_classes must be at least 2"),
    ("sched=step", "sched step needs decay_epochs"),
    ("sched=multistep", "sched multistep needs decay_milestones"),
    ("decay_epochs=30", "decay_epochs applies to sched step / wsd / rsqrt, not cosine"),
    ("decay_rate=0.5", "decay_rate applies to sched step / multistep / poly, not cosine"),
    ("freeze=backbone", "neither pretrained nor init_checkpoint is set"),
    ("freeze_stages=2", "neither pretrained nor init_checkpoint is set"),
    ("pretrained=local-dir:checkpoints/x", "for weights in a folder or file set init_checkpoint: checkpoints/x"),
    ("model_kwargs.pretrained_cfg_overlay={file: w.safetensors}", "set init_checkpoint: w.safetensors instead"),
    ("model_kwargs.pretrained=true", "model_kwargs.pretrained: set the top-level key pretrained"),
    # values torch or timm would refuse with a traceback (a ZeroDivisionError among them) after the run wrote its folder
    ("eval_every_epochs=0", "eval_every_epochs must be at least 1"),
    ("log_every_steps=0", "log_every_steps must be at least 1"),
    ("lr=0", "lr must be in (0, inf)"),
    ("weight_decay=-0.1", "weight_decay must be in [0, inf)"),
    ("label_smoothing=1.0", "label_smoothing must be in [0, 1)"),
    ("drop_path=1.5", "drop_path must be in [0, 1)"),
    ("crop_pct=0", "crop_pct must be in (0, 2]"),
    ("reprob=2", "reprob must be in [0, 1]"),
    ("workers=-1", "workers must be 0 or more"),
    ("attlip_train_steps=[]", "attlip_train_steps must be a non-empty list of step counts >= 1"),
    ("attlip_train_steps=[1, 0]", "attlip_train_steps must be a non-empty list of step counts >= 1"),
    ("attlip_train_steps=[1.5]", "attlip_train_steps must be of type int"),
])
def test_bad_values_are_config_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["global_batch=6", override] if "batch_size" in override else [override])
    assert message in str(err.value)
