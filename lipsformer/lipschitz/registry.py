"""The registry of certified Lipschitz bounds: which function bounds each module type.

**A bound is a property of a module type.** One table, :data:`BOUNDS`, maps each module type the report knows to
the function that bounds it; :func:`~lipsformer.lipschitz.bounds.lipschitz_report` walks the model through
that table and raises :class:`NoBoundError`, naming the module and its type, for any module it meets that has no
entry. Types match exactly (a subclass may compute something else in ``forward``, so it must register too).
Attention kernels are dispatched the same way on their ``kind`` (:data:`KERNEL_BOUNDS`), and weighted residuals,
whose bound depends on their branch's, on their type (:data:`RESIDUAL_BOUNDS`). A new module registers its bound
next to its math::

    from lipsformer.lipschitz import Bound, register_bound

    @register_bound(GroupSort)
    def groupsort_bound(module: GroupSort, hw) -> Bound:
        return Bound(1.0, "GroupSort is a permutation on each group: 1-Lipschitz (Anil et al. 2019)")

``hw`` is the (H, W) token grid the module sees (a convolution's bound depends on it). A composite module
whose parts the report should list one by one registers rows instead (:func:`register_rows`, see
:func:`~lipsformer.lipschitz.bounds.block_rows`); a residual form registers with :func:`register_residual_bound`; an
attention kernel kind with :func:`register_kernel_bound`. The bounds themselves are in
:mod:`~lipsformer.lipschitz.layer_bounds` (layers) and :mod:`~lipsformer.lipschitz.bounds` (blocks, the network).
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..errors import Mistake
from ..layers import AttentionKernel

HW = Tuple[int, int]
INF = math.inf


# -- the registry ---------------------------------------------------------------------------------------
class NoBoundError(Mistake, TypeError, ValueError):
    """A module or attention kind with no registered bound: no certificate is computed for what is not known."""


class Bound(NamedTuple):
    """A map's certified Lipschitz bound and where it comes from (unpacks as ``lip, note``)."""

    lip: float
    note: str = ""


@dataclass
class Row:
    """One residual branch (or a non-residual layer) of the network."""

    name: str
    lip: float  # the layer's bound; for a residual, 1 + max|alpha| Lip(f)
    branch: Optional[float] = None  # Lip(f) of a residual branch
    alpha: Optional[float] = None  # max|alpha|
    drop_path: float = 0.0
    scale_by_keep: bool = True
    note: str = ""
    #: per image, a bound on ``||computed - exact||_2`` of this layer's output when its approximate parts meet
    #: their tolerances (AttLip under :func:`~lipsformer.layers.attlip.solve_to_tolerance`); 0 for exact layers
    defect: float = 0.0


RowsFn = Callable[[nn.Module, str, HW], List[Row]]
#: module type -> ``fn(module, name, hw) -> rows``; :func:`register_bound` entries give one row.
BOUNDS: Dict[type, RowsFn] = {}
#: attention kernel kind -> ``fn(kernel, w, n, position_bias) -> Bound`` for the concatenated heads of one token
#: group of ``n`` tokens; ``w`` is the projection weight viewed as (kernel.num_proj, heads, head_dim, dim).
KERNEL_BOUNDS: Dict[str, Callable[[AttentionKernel, torch.Tensor, int, bool], Bound]] = {}
#: residual type -> ``fn(residual, name, branch, note) -> Row``, its bound given its branch's bound ``branch``.
RESIDUAL_BOUNDS: Dict[type, Callable[[nn.Module, str, float, str], Row]] = {}


def register_in(table: dict, keys, fn):
    """``table[key] = fn`` for each of ``keys`` (module types, kernel kinds); a key already there is a ValueError: one
    bound per key (the registries here, :data:`lipsformer.lipschitz.bounds.NETWORKS`)."""
    for key in keys:
        if key in table:
            raise ValueError(f"a Lipschitz bound for {getattr(key, '__qualname__', key)!r} is already registered "
                             f"({table[key].__qualname__})")
        table[key] = fn
    return fn


def register_rows(*types: type):
    """Decorator: ``fn(module, name, hw) -> List[Row]`` bounds modules of ``types`` part by part."""
    return lambda fn: register_in(BOUNDS, types, fn)


def register_bound(*types: type):
    """Decorator: ``fn(module, hw) -> Bound`` (or a float) bounds modules of ``types`` as one map (one row)."""
    def wrap(fn):
        def rows(module: nn.Module, name: str, hw: HW) -> List[Row]:
            b = fn(module, hw)
            b = Bound(*b) if isinstance(b, tuple) else Bound(float(b))
            return [Row(name, b.lip, note=b.note)]
        rows.__qualname__ = fn.__qualname__
        register_in(BOUNDS, types, rows)
        return fn
    return wrap


def register_kernel_bound(*kinds: str):
    """Decorator: ``fn(kernel, w, n, position_bias) -> Bound`` bounds attention kernels of ``kinds``."""
    return lambda fn: register_in(KERNEL_BOUNDS, kinds, fn)


def register_residual_bound(*types: type):
    """Decorator: ``fn(residual, name, branch, note) -> Row`` bounds residual maps of ``types`` around a branch."""
    return lambda fn: register_in(RESIDUAL_BOUNDS, types, fn)


def _lookup(table: dict, module: nn.Module, name: str):
    fn = table.get(type(module))
    if fn is None:
        cls = type(module)
        where = f"module {name!r}" if name else "a module"
        raise NoBoundError(f"no Lipschitz bound is registered for {where} of type {cls.__module__}.{cls.__qualname__}; "
                           f"register one (lipsformer.lipschitz.register_bound({cls.__qualname__})) before certifying")
    return fn


def kernel_bound_fn(kind: str) -> Callable[[AttentionKernel, torch.Tensor, int, bool], Bound]:
    """The bound registered for attention kernels of ``kind`` (:data:`KERNEL_BOUNDS`); an unknown kind raises."""
    fn = KERNEL_BOUNDS.get(kind)
    if fn is None:
        raise NoBoundError(f"no Lipschitz bound is registered for attention kind {kind!r}; register one "
                           f"(lipsformer.lipschitz.register_kernel_bound({kind!r})) before certifying")
    return fn


def module_rows(module: nn.Module, name: str, hw: HW) -> List[Row]:
    """The rows of ``module`` (named ``name``, on an (H, W) token grid) from the registry; unknown types raise."""
    return _lookup(BOUNDS, module, name)(module, name, hw)


def module_bound(module: nn.Module, hw: HW = (1, 1), name: str = "") -> Bound:
    """``module``'s bound as one map: the product of its rows (their notes joined)."""
    rows = module_rows(module, name, hw)
    notes = "; ".join(dict.fromkeys(r.note for r in rows if r.note))
    return Bound(math.prod(r.lip for r in rows), notes)


def residual_row(name: str, residual: nn.Module, branch: float, note: str = "") -> Row:
    """The row of a residual map around a branch of bound ``branch``, from :data:`RESIDUAL_BOUNDS`."""
    return _lookup(RESIDUAL_BOUNDS, residual, name)(residual, name, branch, note)
