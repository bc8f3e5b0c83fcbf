"""A training step of either family makes no host synchronisation: nothing in a forward or backward reads a tensor's
value on the host (``.item()``, ``bool(tensor)``, ``nonzero``), which on a GPU would stall the CPU until the device
catches up, between every such op. Counted under the profiler on the CPU; ``pytest -m gpu`` runs the same step
under CUDA's sync debug mode (tests/test_gpu.py)."""
import pytest
import timm
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from conftest import TINY, family

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
