"""The training step's device-side bookkeeping: which losses and gradients were not finite, which optimizer updates
were skipped for it, and the epoch's loss sums, kept as tensors on the device and read on the host only at read steps
(log steps, checkpoints, bound keeping, epoch ends: train.py's ``_after_update``), so that a step between them never
waits for the device and makes no collective call beyond the gradient all-reduce.

How a non-finite value skips an update on every process alike, with no collective of its own:

- a non-finite loss poisons its own backward (``loss * where(isfinite(loss), 1, nan)``), so this process's gradients
  are NaN; they stay NaN through gradient accumulation (``no_sync``), and the gradient all-reduce (DDP) or
  reduce-scatter (FSDP2) carries the NaN to every process;
- every process then finds the same non-finite gradient norm (under FSDP2 the norm of the shards is all-reduced, as
  clipping does) and masks the update on the device: torch's fused optimizers take the flag as GradScaler's
  ``found_inf``, which leaves parameters, moments and step counts as they were (:func:`step_unless`);
- under fp16's GradScaler the scaler's own ``found_inf``, which the poisoned gradients set, skips the update (and
  lowers the scale, as an overflow does); a skipped step there is one with a non-finite loss on some process, and
  those per-update flags are reduced over the processes at the next read.
"""
import math
import weakref
from typing import List, NamedTuple

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

# torch's optimizers whose fused form takes GradScaler's ``found_inf``, built so by train.py (:func:`fused`); the
# value: whether that form also runs on FSDP2's DTensor shards (torch registers no sharding for fused SGD)
FOUND_INF_OPTIMIZERS = {torch.optim.Adam: True, torch.optim.AdamW: True, torch.optim.SGD: False}
_momentum_started = weakref.WeakSet()  # fused SGD optimizers whose every momentum buffer exists


def fused(optimizer_class, sharded: bool = False) -> dict:
    """Keyword arguments that build ``optimizer_class`` in the form that skips an update on the device, for
    parameters that are FSDP2 shards (``sharded``) or whole."""
    if optimizer_class not in FOUND_INF_OPTIMIZERS or (sharded and not FOUND_INF_OPTIMIZERS[optimizer_class]):
        return {}
    return dict(fused=True)


class Read(NamedTuple):
    """What one read of a :class:`StepTally` gives."""

    loss_sum: float  # every process's finite batch losses of the epoch so far (this run's part of it)
    loss_n: int
    updates: int  # optimizer updates since the previous read
    skipped: List[int]  # which of them were skipped (0: the first since the previous read)
    what: str  # the first skipped update's cause, when asked: "loss" (some process's) or "gradient"


class StepTally:
    """One epoch's record of the training steps, on the device.

    ``window``: the most optimizer updates between two reads (``log_every_steps``: every log step is a read);
    ``scaled``: a GradScaler skips the updates (fp16).
    """

    def __init__(self, device, window: int, scaled: bool = False):
        self.scaled = scaled
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_n = torch.zeros((), dtype=torch.int64, device=device)
        # per update since the last read: a non-finite loss on this process; the update skipped for a non-finite
        # gradient (the same on every process: the gradients are reduced)
        self.loss_bad = torch.zeros(window, dtype=torch.bool, device=device)
        self.grad_bad = torch.zeros(window, dtype=torch.bool, device=device)
        self.updates = 0  # since the last read: the index of the update in progress

    def checked(self, loss: torch.Tensor) -> torch.Tensor:
        """Record a batch's loss; returns what to backward: ``loss`` itself (times 1), or, when it is not finite,
        NaN times it, whose gradients are NaN wherever they reach."""
        value = loss.detach()
        finite = torch.isfinite(value)
        self.loss_sum += torch.where(finite, value.double(), 0.0)
        self.loss_n += finite
        self.loss_bad[self.updates].logical_or_(~finite)
        return loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)

    def update(self, accelerator, optimizer, parameters, clip_grad) -> None:
        """The optimizer update at the end of an accumulation window, skipped on the device when a gradient is not
        finite; gradients clipped to norm ``clip_grad`` (None: not clipped)."""
        if accelerator.scaler is not None:
            if clip_grad:
                accelerator.clip_grad_norm_(parameters, clip_grad)
            optimizer.step()  # GradScaler.step: its found_inf (an overflow, or a poisoned loss) skips the update
        else:
            if clip_grad or accelerator.distributed_type == DistributedType.FSDP:
                norm = accelerator.clip_grad_norm_(parameters, clip_grad or math.inf)  # FSDP2: shards' norms reduced
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
            skip = ~torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.grad_bad[self.updates] = skip
            step_unless(optimizer, skip)
        self.updates += 1

    def read(self, accelerator, cause: bool = False) -> Read:
        """The record on the host, the loss sums over every process: one transfer, and on several processes one
        reduction (the sums, with fp16's loss flags), as timm's train.py reduces its loss at log steps.
        ``cause``: name the first skipped update's cause (one more reduction, of this process's loss flags, when an
        update was skipped). Every process must call it at the same step, alike. The flags start again afterwards."""
        n = self.updates
        loss_bad = self.loss_bad[:n]
        sums = torch.stack([self.loss_sum, self.loss_n.double()])
        if accelerator.num_processes > 1:  # one collective: the sums, and fp16's flags (a sum > 0: some process's)
            reduced = accelerator.reduce(torch.cat([sums, loss_bad.double()]) if self.scaled else sums, "sum")
            sums = reduced[:2]
            if self.scaled:
                loss_bad = reduced[2:] > 0
        skipped = loss_bad if self.scaled else self.grad_bad[:n]
        values = torch.cat([sums, skipped.double()]).tolist()
        skipped = [i for i, bad in enumerate(values[2:]) if bad]
        what = ""
        if skipped and cause:
            if not self.scaled and accelerator.num_processes > 1:  # every process skipped alike: all call it
                loss_bad = accelerator.reduce(loss_bad.float(), "max") > 0
            what = "loss" if loss_bad[skipped[0]].item() else "gradient"
        self.loss_bad.zero_()
        self.grad_bad.zero_()
        self.updates = 0
        return Read(values[0], int(values[1]), n, skipped, what)


def quiet_buffers(model: torch.nn.Module) -> None:
    """DDP broadcasts the model's buffers from process 0 before each synchronised forward pass: a collective of its
    own at every optimizer step. A model whose buffers are all integer (LipsFormer-Swin's relative position index:
    constants) skips it; floating-point buffers (BatchNorm statistics, power-iteration vectors) keep it."""
    if isinstance(model, DistributedDataParallel) and not any(b.is_floating_point() for b in model.module.buffers()):
        model.broadcast_buffers = False


def _inner(optimizer):
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _momentum_ready(optimizer) -> bool:
    """Give a fused SGD's missing momentum buffers zeros, with which its first update is torch's (``buf = grad``
    when dampening is 0): torch's fused SGD starts them uninitialised and keeps them so when found_inf skips that
    update. False where that cannot be done (dampening > 0)."""
    if not isinstance(optimizer, torch.optim.SGD) or optimizer in _momentum_started:
        return True
    ready = True
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            if "momentum_buffer" not in optimizer.state[p]:
                if group["dampening"] != 0:
                    return False
                if p.grad is None:
                    ready = False
                else:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    if ready:
        _momentum_started.add(optimizer)
    return True


def complete_window(parameters, batch: int, accumulation: int) -> None:
    """At an update that ends on the epoch's ``batch`` (0-based; windows start at multiples of ``accumulation``):
    Accelerate divides each batch's loss by the accumulation steps, so an epoch whose batches they do not divide ends
    in a shorter window, whose gradients are scaled here to its batches' mean, as timm's train.py divides that
    window's losses by its own length. A full window is left as it is."""
    batches = batch % accumulation + 1
    if batches < accumulation:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(accumulation / batches)


def step_unless(optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``skip`` (a bool on the device) is true, leaving the parameters and the
    optimizer's state exactly as they were. Optimizers that take GradScaler's ``found_inf`` (torch's fused ones:
    :data:`FOUND_INF_OPTIMIZERS`) decide on the device; any other reads ``skip`` on the host, one wait per update."""
    inner = _inner(optimizer)
    if getattr(inner, "_step_supports_amp_scaling", False) and _momentum_ready(inner):
        inner.found_inf = skip.float()
        try:
            optimizer.step()
        finally:
            del inner.found_inf
    elif not skip.item():
        optimizer.step()
