"""How a fused op (:mod:`lipsformer.layers.fused`) is registered and called: a ``torch.library`` custom op, and in
eager mode a direct call of the same implementation.

The custom op is what the dispatcher sees: ``torch.compile`` and export (one node, ``register_fake``) and dispatch
modes (fake tensors, the step-cost tool's count, ``FlopCounterMode``). Calling it costs the host the dispatcher twice
and torch.library's Python wrappers (its ``autograd.Function`` around a redispatch, the schema's defaults filled in,
the outputs checked for aliases), forward and again backward: more than twice what a direct call of the
implementation costs (``benchmarks/host_cost.py``, docs/speed.md). So where no dispatch mode is on,
:class:`FusedOp` calls the implementation itself, through a plain ``autograd.Function`` with the same setup and
backward as the op's ``register_autograd``: one implementation, two entries. The profiler sees each direct call as a
range named as the op (``lipsformer::name``), at the host cost eager mode pays.
"""
import collections.abc
import inspect
import types
import typing
from typing import Callable

import torch
from torch import Tensor


def dispatched() -> bool:
    """Whether fused ops go through the dispatcher: a ``TorchDispatchMode`` is on, which should see each as one op,
    or a ``torch.func`` transform, which an ``autograd.Function`` without ``setup_context`` does not take."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._are_functorch_transforms_active()


_UNIONS = (typing.Union, types.UnionType)  # Optional[T], T | None


def _holds_tensors(annotation) -> bool:
    """Whether an argument's annotation is a list or sequence of tensors (optional ones included), or optionally
    one: tensors an ``autograd.Function`` does not see."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, collections.abc.Sequence):
        return any(a is Tensor or typing.get_origin(a) in _UNIONS and Tensor in typing.get_args(a) for a in args)
    return origin in _UNIONS and any(_holds_tensors(a) for a in args)


class FusedOp:
    """A fused op: ``op``, the ``torch.library`` custom op of ``fn`` (``register_fake`` and ``register_autograd`` as
    the custom op's), called where :func:`dispatched`; elsewhere ``fn`` itself, differentiable through ``entry``, an
    ``autograd.Function`` of the registered setup and backward (so a differentiable op takes no list of tensors,
    whose tensors an ``autograd.Function`` does not see), in a profiler range named ``qualname`` where the profiler
    records. Called with its arguments by position."""

    def __init__(self, name: str, fn: Callable):
        self.qualname, self.name = name, name.replace("::", "_")  # the entry's autograd node: lipsformer_<op>Backward
        self.fn, self.op = fn, torch.library.custom_op(name, fn, mutates_args=())
        params = list(inspect.signature(fn).parameters.values())
        self.arity = len(params)
        self.defaults = tuple(p.default for p in params if p.default is not p.empty)
        self.entry = None  # the autograd.Function of register_autograd

    def register_fake(self, fn: Callable) -> Callable:
        return self.op.register_fake(fn)

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        if any(_holds_tensors(p.annotation) for p in inspect.signature(self.fn).parameters.values()):
            raise TypeError(f"{self.name}: an autograd.Function does not see the tensors in a list; give a "
                            "differentiable fused op its tensors one by one")
        self.op.register_autograd(backward, setup_context=setup_context)
        fn = self.fn

        def forward(ctx, *inputs):
            output = fn(*inputs)
            setup_context(ctx, inputs, output)
            return output
        self.entry = type(self.name, (torch.autograd.Function,),
                          {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args):
        if dispatched():
            return self.op(*args)
        if len(args) < self.arity:  # the defaults, which setup_context reads
            args += self.defaults[len(self.defaults) - (self.arity - len(args)):]
        call = self.entry.apply if self.entry is not None and torch.is_grad_enabled() else self.fn
        if not torch._C._autograd._profiler_enabled():
            return call(*args)
        with torch.profiler.record_function(self.qualname):
            return call(*args)


def fused_op(name: str) -> Callable[[Callable], FusedOp]:
    """``@fused_op("lipsformer::name")`` over the implementation: a :class:`FusedOp` (no input mutated)."""
    return lambda fn: FusedOp(name, fn)
