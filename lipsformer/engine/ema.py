"""An exponential moving average of the weights that works on whatever each process holds.

timm's ModelEmaV3 deep-copies the module. Under FSDP the module holds parameter shards (DTensors) behind
sharding hooks, so its copy can neither run a forward pass nor be saved whole. ``ShardEma`` keeps one tensor per
parameter, whole or shard, and updates it locally, with no communication. Evaluating or saving the average
swaps it into the live model (``with ema.applied(model):``), so the model's own forward and
``accelerator.get_state_dict`` do the gathering. The update follows ModelEmaV3 without warmup: the first
update copies, later ones keep ``decay`` of the average.

Floating-point buffers (BatchNorm statistics, for timm models trained with train.py) are averaged alongside the
parameters, as ModelEmaV3 does; integer buffers are left to the model.
"""
import contextlib
from typing import Dict, List

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: the shard of a DTensor (sharing its storage), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _reshard(model: torch.nn.Module) -> None:
    """Put FSDP2 modules back to their sharded parameters. The root module keeps the gathered ones after a
    forward pass without backward (evaluation), and writing to those would not reach the shards."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensor_of(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a shard (a collective under FSDP: every process must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _averaged(model: torch.nn.Module) -> List[torch.Tensor]:
    """The tensors the EMA follows: parameters (sharded ones as shards), then floating-point buffers."""
    _reshard(model)
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return [p.detach() for p in model.parameters()] + [b.detach() for b in buffers]


class ShardEma:
    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.average: List[torch.Tensor] = [t.clone() for t in _averaged(model)]

    def _local_tracked(self, model) -> List[torch.Tensor]:
        """This process's part of each tensor the EMA follows, checked against the ones it was made from."""
        params = _averaged(model)
        if len(params) != len(self.average) or any(p.shape != a.shape for p, a in zip(params, self.average)):
            raise ValueError("the model's parameters no longer match the ones this EMA was made from")
        return [_local(p) for p in params]

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        """Fold in the weights after optimizer step ``step`` (1-based)."""
        average = [_local(a) for a in self.average]
        torch._foreach_lerp_(average, self._local_tracked(model), 1.0 if step <= 1 else 1.0 - self.decay)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module):
        """Within the block ``model`` holds the averaged weights; its own are restored afterwards."""
        params = self._local_tracked(model)
        own = [p.clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, [_local(a) for a in self.average])
        try:
            yield model
        finally:
            _reshard(model)
            with torch.no_grad():
                torch._foreach_copy_(params, own)

    def state_dict(self) -> Dict[str, object]:
        """Whole tensors, so a checkpoint written by one process restores every shard."""
        return dict(average=[full_tensor_of(t).cpu() for t in self.average])

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, object]) -> None:
        saved = state["average"]
        if len(saved) != len(self.average) or any(s.shape != a.shape for s, a in zip(saved, self.average)):
            raise ValueError("the checkpoint's EMA does not match this model's parameters")
        for mine, whole in zip(self.average, saved):
            if hasattr(mine, "device_mesh"):  # a shard: take this process's part of the whole tensor
                from torch.distributed.tensor import distribute_tensor
                whole = distribute_tensor(whole.to(mine.device), mine.device_mesh, mine.placements)
            mine.copy_(whole)
