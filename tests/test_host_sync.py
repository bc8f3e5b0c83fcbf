"""A training step of either family makes no host synchronisation: nothing in a forward or backward reads a tensor's
value on the host (``.item()``, ``bool(tensor)``, ``nonzero``), which on a GPU would stall the CPU until the device
catches up, between every such op. Counted under the profiler on the CPU; ``pytest -m gpu`` runs the same step
under CUDA's sync debug mode (tests/test_gpu.py)."""
import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from torch.profiler import ProfilerActivity, profile

from conftest import TINY, family
from helpers import ROOT, TINY_RUN, make_folder, read_metrics, torchrun, write_config

# the ATen ops that read a tensor's value on the host (``aten::all`` / ``aten::any`` do so only through a following
# ``bool()``, counted as ``aten::is_nonzero``; along a dimension they are device reductions)
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal")


def host_syncs(step) -> list:
    """The synchronising ops ``step()`` runs, in order."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return [e.name for e in prof.events() if e.name in SYNC_OPS]


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_a_training_step_makes_no_host_synchronisation(name):
    """Forward, loss, backward and an SGD step of each family in training mode (drop path on): no synchronising op.
    (torch's AdamW reads its step counters with ``.item()``; they live on the CPU, also next to a GPU model, so they
    are no device synchronisation; SGD keeps the count to the model's own ops.) The count itself is checked on the
    same step with a ``bool(tensor)`` hooked into a forward."""
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.2, **TINY[family(name)]).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def step():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    assert host_syncs(step) == []
    def check(module, args, out):  # what a finiteness guard in a forward would do
        if not bool(out.isfinite().all()):
            raise FloatingPointError

    hook = model.stages[0].blocks[0].register_forward_hook(check)
    try:
        assert "aten::is_nonzero" in host_syncs(step)
    finally:
        hook.remove()


# -- the training loop: the update skipped on the device, and what a step reads ---------------------------------------
def _state(model, optimizer) -> list:
    """Every parameter, and every value of the optimizer's state and groups, in order."""
    state = optimizer.state_dict()
    return [*model.parameters(), *[v for s in state["state"].values() for v in s.values()],
            *[v for g in state["param_groups"] for k, v in g.items() if k != "params"]]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("opt", ["adamw", "sgd", "momentum", "lamb", "lookahead_adamw"])
def test_a_skipped_update_leaves_the_weights_and_the_optimizer_state_as_they_were(opt):
    """train.py's optimizer (torch's fused Adam / AdamW / SGD skip on the device; timm's own and lookahead_ read the
    flag on the host): an update skipped by ``step_unless`` (NaN gradients) leaves every weight, moment and step count
    bit for bit, and the updates after it run as in a run that never had it, a skipped first update included."""
    from lipsformer.config import TrainConfig
    from lipsformer.engine.step import step_unless
    from lipsformer.engine.train import build_optimizer
    def built():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, build_optimizer(TrainConfig(opt=opt, lr=0.1, weight_decay=0.05), model)

    skipping, plain = built(), built()

    def update(model, optimizer, grad: float, skip: bool):
        for p in model.parameters():
            p.grad = torch.full_like(p, grad) * torch.arange(1, p.numel() + 1).view_as(p)
        step_unless(optimizer, torch.tensor(skip))

    update(*skipping, math.nan, True)  # the first update: the state it starts is what no update leaves
    assert all(torch.equal(p, q) for p, q in zip(skipping[0].parameters(), plain[0].parameters()))
    for grad in (0.5, -0.25):
        update(*skipping, grad, False)
        update(*plain, grad, False)
        before = copy.deepcopy(_state(*skipping))
        update(*skipping, math.nan, True)
        assert _same(_state(*skipping), before)
    assert _same(_state(*skipping), _state(*plain))


# -- the training loop ---------------------------------------------------------------------------------------------
# A run of 2 epochs of 6 optimizer steps whose bookkeeping reads the host at log steps (every 5), bound keeping (every
# 4) and the checkpoint (every 7); the epochs end at steps 6 and 12 (those reads come after the step, outside it).
LOOP = dict(epochs=2, global_batch=8, batch_size=2, workers=1, log_every_steps=5, lipschitz_every_steps=4,
            checkpoint_every_steps=7, lipschitz_target=100.0, ema_decay=0.9, mixup=0.8, cutmix=1.0,
            model="lipsformer_cswin_t",  # Kim's l2 attention: a finite bound to keep, and no host read in it
            model_kwargs=dict(attn="l2", tied_qk=True, **{k: v for k, v in TINY["cswin"].items() if k != "img_size"}))
READ_STEPS = {4, 5, 7, 8, 10, 12}


def test_the_training_loop_reads_the_host_and_calls_collectives_only_at_read_steps(tmp_path):
    """train.py's loop on 2 CPU processes (gloo), 2 batches accumulated per optimizer step on each, mixup and cutmix,
    the EMA, bound keeping every 4 steps, and process 1's loss made NaN at step 2. Per optimizer step, the host reads of
    tensors and the collective calls of each process (tests/sync_probe.py) are none on every step that is not a read
    step (log, checkpoint, bound keeping): with ``on_nonfinite`` skip (step 2 skipped and counted once), with stop
    (the run stops at the next read step, naming step 2), and for LipsFormer-Swin in bf16 without bound keeping (its
    constant buffers are not broadcast by DDP every step). The read steps read: the counter is live."""
    config = write_config(tmp_path, **LOOP)
    data = Path(yaml.safe_load(config.read_text())["data_dir"])
    shutil.rmtree(data)
    make_folder(data, train_per_class=(12,) * 4)  # 48 images: 6 steps of 8
    swin = ["model=lipsformer_swin_t", "model_kwargs=" + json.dumps(TINY_RUN["model_kwargs"]), "lipschitz_target=null",
            "mixed_precision=bf16", "epochs=1"]
    said = torchrun(ROOT / "tests" / "sync_probe.py", tmp_path, "--nan-at", 2, "--nan-rank", 1,
                    "--", "--config", config, "--set", "on_nonfinite=skip",
                    "--", "--config", config, "--set", "on_nonfinite=stop", "--output-dir", tmp_path / "stopped",
                    "--", "--config", config, "--set", "on_nonfinite=skip", *swin, "--output-dir", tmp_path / "swin")
    for rank in range(2):
        skip, stop, bf16 = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        for run, reads in ((skip, READ_STEPS), (stop, {4}), (bf16, {5})):  # bf16: log steps only
            steps = {int(s): c for s, c in run["steps"].items()}
            assert {s: c for s, c in steps.items() if s not in reads} == {}, steps
            assert all(steps[s]["reads"] for s in reads)
        assert (skip["exit"], stop["exit"], bf16["exit"]) == (0, 3, 0)
    assert "non-finite loss at step 2 (epoch 1; stopped at step 4)" in said
    for run, steps in (("run", 12), ("swin", 6)):
        epochs = [r for r in read_metrics(tmp_path / run) if r["kind"] == "epoch"]
        assert [r["skipped_steps"] for r in epochs] == [1] * len(epochs) and epochs[-1]["step"] == steps
