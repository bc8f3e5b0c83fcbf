"""AttLip: attention as the proximal step of a convex potential (AttLip paper, Proposition 1, Theorem 4).

For tokens ``x`` (N, C) and per-head projections ``W^h`` (d_h, C) the potential is

.. math:: f(x) = \\sum_h \\tfrac12 \\sum_i \\mathrm{LSE}_j(S^h_{ij}),\\quad
          S^h_{ij} = \\|W^h (x_i + x_j)\\|^2 / \\sqrt{d_h}

(the score of Algorithm 4), and the block's output is :math:`\\mathrm{prox}_{\\eta f}(x) =
\\arg\\min_y f(y) + \\|y - x\\|^2 / 2\\eta`, which is firmly non-expansive, hence 1-Lipschitz for any eta and any
weights. The proximal problem is solved by gradient descent: in training with a few Armijo steps (Algorithms 1
and 2, unrolled: the paper trains with 1-3), at evaluation with Barzilai-Borwein steps until each window's residual
is at most ``tol`` (:func:`attlip_solve`; the paper evaluates with 20 Armijo steps), and in certified inference
with the same steps, verified, to a tolerance the certificate charges (:func:`attlip_prox_certified`).

Two forms of the weight W (``attlip_form``): ``general`` (:class:`AttLip`), any matrix, as the paper has it; and
``orthogonal`` (:class:`OrthogonalAttLip`), ``W = diag(s_h) Q`` with Q orthogonal, the same block (Theorem 4 holds for
any W) in which, after one rotation, every head of every window is a problem of its own with a scalar Gram product:
no ``N C^2`` product per gradient evaluation, a closed-form start (the prox at uniform attention) and a first step
from the conditioning that start's linear problem has, and a float32 residual check with a proven rounding bound
(:func:`~lipsformer.layers.attlip_solver.prox_residual32`) in place of most of the float64 one.

Here: the blocks (:class:`AttLip`, :class:`OrthogonalAttLip`), the token mixer (:class:`AttLipMixer`) and certified
inference's switch (:func:`solve_to_tolerance`); the potential, its gradient and the weight forms in
:mod:`~lipsformer.layers.attlip_potential`, the solvers and their tolerances in :mod:`~lipsformer.layers.attlip_solver`.
"""
import contextlib
import math
from typing import Iterator, Optional, Tuple

import torch
from timm.layers import register_notrace_module
from torch import nn

from .attlip_potential import DiagonalWeight, Weight
from .attlip_solver import DEFAULT_TOL, GRAD_STEPS, SolveStats, attlip_prox, attlip_prox_certified, attlip_solve
from .normalized import fingerprint
from .spectral import orthogonality_defect
from .windows import pad_to_multiple, window_partition, window_reverse


class AttLip(nn.Module):
    """The AttLip block on token groups (B, N, C): returns prox_{eta f}(x), 1-Lipschitz by construction; its weight
    W (C, C) any matrix (the paper's block, ``attlip_form="general"``; :class:`OrthogonalAttLip` is the cheaper
    form).

    Args:
        dim: channels C. heads: number of heads H (C divisible by H).
        eta: proximal step (any eta > 0 keeps the block 1-Lipschitz; the paper uses 1).
        train_steps / eval_steps: descent steps while training (Armijo, :func:`attlip_prox`) / gradient evaluations
            at most at evaluation (:func:`attlip_solve`) (paper: 1-3 / 20).
        tol: stop when the subproblem's gradient norm is below this.

    Certified inference (:func:`solve_to_tolerance`) solves to ``tol`` with a hard cap and verifies
    (:func:`attlip_prox_certified`); plain evaluation takes the same first pass without the check, so its outputs
    are the certified forward's wherever ``eval_steps`` suffice and no window needs a float64 finish.
    """

    form = "general"

    def __init__(self, dim: int, heads: int = 1, eta: float = 1.0, train_steps: int = 2, eval_steps: int = 20,
                 tol: float = DEFAULT_TOL):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        if eta <= 0:
            raise ValueError(f"eta must be positive, got {eta}")
        self.heads, self.eta, self.tol = heads, eta, tol
        self.train_steps, self.eval_steps = train_steps, eval_steps
        self.solve_cap: Optional[int] = None  # set by solve_to_tolerance: strict solving with this hard cap
        self.last_solve: Optional[SolveStats] = None  # what the last certified solve took
        self._build(dim)

    def _build(self, dim: int) -> None:
        self.weight = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))  # rows: the heads' W^h stacked

    def _problems(self, x: torch.Tensor) -> Tuple[torch.Tensor, Weight, int, float, Optional[torch.Tensor]]:
        """The proximal problems the solvers take for tokens ``x`` (..., N, C): ``(tokens, weight, heads, tol,
        rotation)``; here ``x`` itself, each group one problem with all heads, and no rotation."""
        return x, self.weight, self.heads, self.tol, None

    def _output(self, y: torch.Tensor, x: torch.Tensor, rotation: Optional[torch.Tensor]) -> torch.Tensor:
        """The block's output from the solution ``y`` of :meth:`_problems` for input ``x``."""
        return y

    def _window_stats(self, stats: SolveStats, x: torch.Tensor) -> SolveStats:
        return stats

    def rotation_defect(self) -> float:
        """A certified upper bound on ``||Q^T Q - I||_2`` of the rotation the forward multiplies by: 0 (none)."""
        return 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, w, heads, tol, q = self._problems(x)
        if self.solve_cap is not None and not self.training:
            y, stats = attlip_prox_certified(a, w, heads, self.eta, tol, self.solve_cap,
                                             min(self.eval_steps, GRAD_STEPS))
            self.last_solve = self._window_stats(stats, x)
        elif self.training:
            y = attlip_prox(a, w, heads, self.eta, self.train_steps, tol)
        else:
            y = attlip_solve(a, w, heads, self.eta, tol, self.eval_steps)
        return self._output(y, x, q)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, eta={self.eta}, steps={self.train_steps}/{self.eval_steps}"


# OrthogonalAttLip's per-head scale is s_h = SCALE_MAX * sigmoid(theta_h), 1 at initialisation (theta = 0). The
# bound keeps the scores' scale, hence the conditioning of the proximal problem beyond its linear part, from
# drifting: the general form's weights grew from norm ~2 to ~8 in the certifiable digits runs and their certified
# solves took 40 to 91 gradient evaluations instead of 10 to 24
SCALE_MAX = 2.0


def cayley(raw: torch.Tensor) -> torch.Tensor:
    """``Q = (I + S)^{-1} (I - S)`` with ``S = A - A^T``: orthogonal for any square ``A`` (S is skew, so its
    eigenvalues are imaginary and ``I + S`` is invertible with singular values at least 1: a well-conditioned
    solve), computed in float64 (differentiable) and rounded to ``A``'s dtype."""
    a = raw.to(torch.float64)
    s = a - a.T
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye + s, eye - s).to(raw.dtype)


class OrthogonalAttLip(AttLip):
    """AttLip with a scaled-orthogonal weight, ``W = diag(s_h) Q`` (``attlip_form="orthogonal"``, the certifiable
    models' default): Q (C, C) orthogonal (:func:`cayley` of the parameter ``rotation``) and one scale per head,
    ``s_h = SCALE_MAX * sigmoid(scale_h)``, so ``W W^T = diag(s_h^2)``.

    It is AttLip (Theorem 4's potential with that W: convex for any weights, Lemma 1, so its prox is firmly
    non-expansive). With ``a = x Q^T`` the potential is ``f_W(x) = g(a)``, ``g`` the potential of
    ``diag(s_h)`` (each head its own ``d_h`` rotated channels), and ``|y - x| = |b - a|`` for ``b = y Q^T``, so
    ``prox_{eta f_W}(x) = prox_{eta g}(x Q^T) Q``: the block rotates, solves per head with a scalar Gram product
    (:class:`DiagonalWeight`, which also gives the solvers their start and first step), and rotates back. An
    evaluation of the solvers costs ``2 N^2 C`` (the general form: ``2 N^2 C + N C^2``), and the rotations
    ``2 N C^2`` per group, one product each.

    The Q the forward multiplies by is Q rounded to float32 (call it Q'), not exactly orthogonal: the block
    computes ``prox_{eta g}(x Q'^T) Q'``, whose Lipschitz constant is at most ``||Q'||^2 <= 1 + delta`` with
    ``delta`` a certified upper bound on ``||Q'^T Q' - I||_2`` (:meth:`rotation_defect`, about 1e-6), and whose
    solver defect is ``||Q'|| eta tol`` per group (Proposition 3 (1) for g, then the rotation back); the
    certified bounds charge both (``lipsformer.lipschitz.bounds``). At evaluation Q' and delta are computed once
    per change of ``rotation`` (cached, keyed as the normalised layers' divisors are).
    """

    form = "orthogonal"
    _cache = None  # (fingerprint of rotation, Q', delta or None)

    def _build(self, dim: int) -> None:
        self.rotation = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))  # Q = cayley(rotation)
        self.scale = nn.Parameter(torch.zeros(self.heads))  # s_h = SCALE_MAX * sigmoid(scale_h): 1 at init

    def head_scales(self) -> torch.Tensor:
        """``s_h`` (H,), in (0, SCALE_MAX)."""
        return SCALE_MAX * torch.sigmoid(self.scale)

    def _problems(self, x: torch.Tensor) -> Tuple[torch.Tensor, DiagonalWeight, int, float, torch.Tensor]:
        """Each head of each group its own problem: ``x Q'^T`` split by head, (groups * H, N, d_h), with its scale
        (:class:`DiagonalWeight`, per problem) and tolerance ``tol / sqrt(H)``, so that every group of H heads
        meets ``tol`` (its heads are disjoint coordinates: their squared residuals add)."""
        h, (n, c), q = self.heads, x.shape[-2:], self._rotation()
        a = (x @ q.T).unflatten(-1, (h, c // h)).transpose(-3, -2).reshape(-1, n, c // h)
        s = self.head_scales().to(x.dtype).expand(a.shape[0] // h, h).reshape(-1, 1, 1)
        return a, DiagonalWeight(s, c // h), 1, self.tol / math.sqrt(h) * (1 - 1e-15), q  # (rounded down)

    def _output(self, y: torch.Tensor, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        y = y.reshape(*x.shape[:-2], self.heads, *y.shape[-2:]).transpose(-3, -2).flatten(-2)
        return y @ rotation

    def _window_stats(self, stats: SolveStats, x: torch.Tensor) -> SolveStats:
        """The solve's stats are per head: its tolerance and largest residual are given per group of H heads
        (``sqrt(H)`` times the largest head's: a bound on every group's), and the two rotations, each
        (tokens, C) x (C, C), are added to its multiply-adds."""
        root, c = math.sqrt(self.heads), x.shape[-1]
        return stats._replace(residual=stats.residual * root, tol=self.tol,
                              multiply_adds=stats.multiply_adds + 2 * (x.numel() // c) * c * c)

    def _rotation(self) -> torch.Tensor:
        """Q' (C, C): ``cayley(rotation)`` in the parameter's dtype; at evaluation (and wherever no gradient is
        taken) computed once per change of ``rotation``."""
        raw = self.rotation
        if torch.is_grad_enabled() and raw.requires_grad:  # training: through the Cayley map
            return cayley(raw)
        key = fingerprint(raw)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self.__dict__["_cache"] = (key, cayley(raw), None)
        return self._cache[1]

    def rotation_defect(self) -> float:
        """A certified upper bound on ``||Q'^T Q' - I||_2`` for the Q' this block multiplies by
        (:func:`~lipsformer.layers.spectral.orthogonality_defect`), computed once per change of ``rotation``."""
        with torch.no_grad():
            q = self._rotation()
        if self._cache[2] is None:
            self.__dict__["_cache"] = (*self._cache[:2], orthogonality_defect(q))
        return self._cache[2]

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_cache", None)  # .to() / .half(): new storage, possibly at a freed address
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:
        """``W = diag(s) Q'`` (C, C): the AttLip weight whose potential this block's prox takes (for the functions
        of the general form: :func:`~lipsformer.layers.attlip_potential.attlip_potential`,
        :func:`~lipsformer.layers.attlip_potential.attlip_grad`,
        :func:`~lipsformer.layers.attlip_solver.prox_residual64`)."""
        q = self._rotation()
        return self.head_scales().repeat_interleave(q.shape[0] // self.heads)[:, None] * q


#: ``attlip_form`` -> the AttLip block built in each branch of :class:`AttLipMixer`
FORMS = {"general": AttLip, "orthogonal": OrthogonalAttLip}
#: the names each form's weights have in a state dict (under ``...attn.branches.<i>.``)
FORM_KEYS = {"general": ("weight",), "orthogonal": ("rotation", "scale")}


def state_dict_form(keys) -> Optional[str]:
    """The ``attlip_form`` whose AttLip weights a state dict's ``keys`` hold (None: no AttLip mixer weights)."""
    for key in keys:
        parts = key.split(".")
        if len(parts) >= 4 and parts[-4:-2] == ["attn", "branches"] and parts[-2].isdigit():
            for form, names in FORM_KEYS.items():
                if parts[-1] in names:
                    return form
    return None


def form_mismatch(file_keys, model_keys) -> Optional[str]:
    """A sentence naming the change when a state dict holds AttLip weights of another form than a model's, else
    None (the two forms' weights differ in name, so such a file cannot load)."""
    theirs, ours = state_dict_form(file_keys), state_dict_form(model_keys)
    if theirs is None or ours is None or theirs == ours:
        return None
    return (f"its AttLip blocks are attlip_form {theirs!r} (weights {', '.join(FORM_KEYS[theirs])}), the model's "
            f"{ours!r} (weights {', '.join(FORM_KEYS[ours])}; the certifiable *_cert models default to "
            f"'orthogonal'): build the model with attlip_form={theirs!r} (model_kwargs: {{attlip_form: {theirs}}}) "
            f"to load it")


@register_notrace_module  # reason: windows, padding and the descent's stopping test read shapes and values
class AttLipMixer(nn.Module):
    """AttLip as a LipsBlock token mixer on (B, H, W, C), the ``attn="attlip"`` choice of both families.

    The channels are split evenly over ``windows`` (Swin: one window shape; CSwin: vertical then horizontal
    stripes, or the whole map); each group of tokens goes through its branch's AttLip block (``form``: a key of
    :data:`FORMS`). The mixer returns ``prox(x) - x``, so the block's weighted residual
    ``x + alpha * (prox(x) - x)`` moves from ``x`` toward ``prox(x)``. ``I - prox`` is firmly non-expansive like
    ``prox``, so the mixer is 1-Lipschitz. ``delta=False`` returns ``prox(x)`` itself (for a convex residual
    ``(1 - a) x + a prox(x)``; also 1-Lipschitz); ``reflect=True`` returns the reflected resolvent ``2 prox(x) - x``,
    non-expansive as ``prox`` is firmly so (an isometry where ``prox`` is a linear projection), so
    ``(1 - a) x + a (2 prox(x) - x)`` need not contract. (With the orthogonal form, up to its rotation's rounding:
    :class:`OrthogonalAttLip`.)
    """

    def __init__(self, dim: int, heads: int, windows, eta: float = 1.0, train_steps: int = 2, eval_steps: int = 20,
                 tol: float = DEFAULT_TOL, delta: bool = True, reflect: bool = False, form: str = "general"):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"attlip_form must be one of {tuple(FORMS)}, got {form!r}")
        self.delta, self.reflect = delta, reflect
        nb = len(windows)
        if dim % nb or heads % nb:
            raise ValueError(f"dim {dim} and heads {heads} must divide over {nb} window shapes")
        self.windows = [tuple(w) for w in windows]
        self.branches = nn.ModuleList(
            FORMS[form](dim // nb, heads // nb, eta, train_steps, eval_steps, tol) for _ in self.windows)

    def set_windows(self, windows) -> None:
        """Other window shapes, one per branch (the weights do not depend on them)."""
        if len(windows) != len(self.windows):
            raise ValueError(f"{len(self.windows)} window shapes are built, got {len(windows)}")
        self.windows = [tuple(w) for w in windows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A size a window does not divide is padded with zeros and cropped back (``strict_img_size=False``)."""
        B, H, W, C = x.shape
        parts = x.chunk(len(self.windows), dim=-1)
        outs = []
        for part, window, layer in zip(parts, self.windows, self.branches):
            part = pad_to_multiple(part, window)
            tokens = window_partition(part, window)
            out = layer(tokens)
            out = 2 * out - tokens if self.reflect else out - tokens if self.delta else out
            out = window_reverse(out, window, *part.shape[1:3])
            outs.append(out[:, :H, :W] if out.shape[1:3] != (H, W) else out)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def solver_defect(self, hw) -> float:
        """Per image, a bound on ``||computed - exact||_2`` of this mixer's output on an ``hw`` token grid when every
        window is solved to its branch's ``tol`` (:func:`solve_to_tolerance`): AttLip Proposition 3 (1) gives
        ``eta * tol`` per window, times ``||Q'|| <= sqrt(1 + delta)`` for a rotated branch
        (:meth:`OrthogonalAttLip.rotation_defect`); windows and branches are disjoint blocks of the output, so
        their squares add. ``I - prox`` deviates by as much as ``prox``, ``2 prox - I`` by twice as much; zero
        padding and cropping do not increase it."""
        H, W = hw
        sq = 0.0
        for window, layer in zip(self.windows, self.branches):
            n = math.ceil(H / window[0]) * math.ceil(W / window[1])
            sq += n * (layer.eta * layer.tol) ** 2 * (1.0 + layer.rotation_defect())
        return (2.0 if self.reflect else 1.0) * math.nextafter(math.sqrt(sq), math.inf)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, delta={self.delta}, reflect={self.reflect}"


@contextlib.contextmanager
def solve_to_tolerance(model: nn.Module, max_steps: int = 1000) -> Iterator[nn.Module]:
    """Certified inference: inside, every :class:`AttLip` of ``model`` in eval mode solves its proximal problem
    until each window's residual (float64) is at most its ``tol``, raising :class:`SolverToleranceError` past
    ``max_steps`` rather than stopping early; that tolerance is what the certificate's defect charges."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    layers = [m for m in model.modules() if isinstance(m, AttLip)]
    saved = [m.solve_cap for m in layers]
    for m in layers:
        m.solve_cap = max_steps
    try:
        yield model
    finally:
        for m, cap in zip(layers, saved):
            m.solve_cap = cap
