"""The AttLip proximal problem (see :mod:`lipsformer.layers.attlip`): the potential of Theorem 4, its gradient in
closed form (Proposition 1), and the two forms of its weight the solvers iterate with, :class:`DenseWeight` (any
W: the general form) and :class:`DiagonalWeight` (``W = s I`` per head: the orthogonal form after its rotation).
The solvers are in :mod:`lipsformer.layers.attlip_solver`.
"""
from typing import Optional, Tuple, Union

import torch


def _heads(v: torch.Tensor, heads: int) -> torch.Tensor:
    """Projected tokens (..., N, D) as per-head groups (..., H, N, D / H)."""
    return v.unflatten(-1, (heads, v.shape[-1] // heads)).transpose(-3, -2)


def _logits(v: torch.Tensor, heads: int):
    """From projected tokens ``v = x W^T`` (..., N, D): the per-head tokens ``vh`` (L * H, N, d_h) (L the leading
    indices flattened), ``|w_i|^2`` and the logits ``2 w_i.w_j + |w_j|^2`` (L * H, N, N) with ``w = vh / d_h^(1/4)``:
    the score ``S_ij = ||v_i + v_j||^2 / sqrt(d_h)`` less its row term ``|w_i|^2``, one batched product."""
    n, d = v.shape[-2:]
    d_h = d // heads
    vh = _heads(v, heads).reshape(-1, n, d_h)
    w = vh * d_h ** -0.25
    sq = w.pow(2).sum(-1)
    return vh, sq, torch.baddbmm(sq.unsqueeze(-2), w, w.transpose(-1, -2), alpha=2.0)


def _lse_potential(logits: torch.Tensor, sq: torch.Tensor, lead: torch.Size, heads: int) -> torch.Tensor:
    """f = sum_h 1/2 sum_i LSE_j(S_ij) per leading index, from :func:`_logits`' logits and row terms (the
    log-sum-exp shifted by the row maximum, exponentiated in place: half the time of ``torch.logsumexp`` here)."""
    top = logits.detach().amax(-1, keepdim=True)
    lse = (logits - top).exp_().sum(-1).log_() + top.squeeze(-1)
    return 0.5 * (lse + sq).sum(-1).view(*lead, heads).sum(-1)


def projected_potential(v: torch.Tensor, heads: int) -> torch.Tensor:
    """f per leading index from projected tokens ``v = x W^T`` (..., N, D)."""
    _, sq, logits = _logits(v, heads)
    return _lse_potential(logits, sq, v.shape[:-2], heads)


def attlip_potential(x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
    """f(x) of Theorem 4 for tokens ``x`` (..., N, C); one value per leading index."""
    return projected_potential(x @ weight.T, heads)


def grad_coefficients(v: torch.Tensor, heads: int, potential: bool = False):
    """For projected tokens ``v = x W^T`` (..., N, D), the ``Y`` (..., N, D) with ``grad f(x) = Y W``: the gradient
    in the weight's row space, where the solvers iterate. ``potential=True`` also returns f(x) per leading index,
    from the same logits and without gradient tracking (what Armijo's test compares against).

    The row softmax of S drops S's row term ``|v_i|^2 / sqrt(d_h)`` (constant along a row), so with
    ``w = v / d_h^(1/4)`` the logits are ``2 w_i.w_j + |w_j|^2``, one batched product; the mix
    ``(1 + sum_i a_ik) v_k + ((a + a^T) v)_k`` is one more, from ``a + a^T`` and the self term: ``2 N^2 d_h`` a
    head, and few passes over the (N, N) scores, which bound the cost at Swin's small windows."""
    lead, d_h = v.shape[:-2], v.shape[-1] // heads
    vh, sq, logits = _logits(v, heads)
    a = logits.softmax(-1)
    # (1 + sum_i a_ik) v_k + ((a + a^T) v)_k, / sqrt(d_h): one product
    y = torch.baddbmm(vh * a.sum(-2).add_(1.0).unsqueeze(-1), a + a.transpose(-1, -2), vh).mul_(d_h ** -0.5)
    y = y.unflatten(0, (*lead, heads)).transpose(-3, -2).flatten(-2)
    if not potential:
        return y
    with torch.no_grad():
        return y, _lse_potential(logits, sq, lead, heads)


def attlip_grad(x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`attlip_potential` in closed form (Proposition 1, per head, as in Algorithm 4):

    :math:`\\nabla f(x)_k = \\sum_h W^{h\\top}\\big[(1 + \\sum_i \\alpha_{ik}) v_k
    + \\sum_i (\\alpha_{ik} + \\alpha_{ki}) v_i\\big] / \\sqrt{d_h}` with
    :math:`\\alpha = \\mathrm{softmax}_{\\mathrm{row}}(S)` and :math:`v_i = W^h x_i`.
    (Algorithm 4 as printed adds the identity once more and drops the :math:`1/\\sqrt{d_h}`; this is the exact
    gradient, checked against autograd in the tests.)
    """
    return grad_coefficients(x @ weight.T, heads) @ weight


class DenseWeight:
    """The weight W (D, C) of AttLip as the paper has it, any matrix: the solvers iterate in its row space, where
    a step costs one product by the Gram matrix ``W W^T`` (formed once per call, on first use)."""

    dense = True  # its products are matrix products (counted by :func:`solve_multiply_adds`)
    groups = None  # one W for every token group

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._gram = None

    @property
    def dim(self) -> int:
        return self.weight.shape[0]

    @property
    def gram_matrix(self) -> torch.Tensor:
        if self._gram is None:
            self._gram = self.weight @ self.weight.T
        return self._gram

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.weight,)

    def cast(self, dtype: torch.dtype) -> "DenseWeight":
        """Detached, in ``dtype`` (the Gram matrix formed again there)."""
        return DenseWeight(self.weight.detach().to(dtype))

    def regroup(self, groups: Optional[torch.Tensor]) -> "DenseWeight":
        return self

    def project(self, x: torch.Tensor) -> torch.Tensor:  # x W^T
        return x @ self.weight.T

    def back(self, z: torch.Tensor) -> torch.Tensor:  # z W
        return z @ self.weight

    def gram(self, u: torch.Tensor) -> torch.Tensor:  # u W W^T
        return u @ self.gram_matrix

    def gram_norm(self) -> torch.Tensor:  # ||W W^T||_F
        return self.gram_matrix.norm()

    def start(self, x: torch.Tensor, heads: int, eta: float) -> Optional[torch.Tensor]:
        """The solvers' starting ``z`` (``y = x + z W``); None: ``y = x`` (Algorithm 1)."""
        return None

    def first_step(self, heads: int, eta: float) -> Optional[float]:
        """The first step length; None: the solver's own (BB: eta / 2, Armijo: ``step_init``)."""
        return None


class DiagonalWeight:
    """AttLip's weight in the rotated coordinates of :class:`OrthogonalAttLip`, per problem: ``W = s I`` on the
    ``d`` channels of one head of one token group, ``scale`` (G, 1, 1) one ``s`` per group (leading index) of the
    tokens it is applied to, ``heads=1``. ``W W^T = s^2 I``: every product of the solvers is a scaling, and an
    evaluation costs the logits and the mix alone, ``2 N^2 d``.

    A group's potential is ``1/2 sum_i LSE_j(c ||a_i + a_j||^2)`` with ``c = s^2 / sqrt(d)``. Where the scores are
    all equal (small logits, as at initialisation: attention nearly uniform) its gradient is
    ``c (2 a_k + 2 mean(a))`` and the proximal problem is a linear one whose Hessian ``I / eta + c M``,
    ``M = 2 I + 2 11^T / N``, has two eigenvalues, ``1 / eta + 2 c`` and ``1 / eta + 4 c``: condition number
    ``(1 + 4 eta c) / (1 + 2 eta c) < 2`` whatever ``s`` and ``eta``. The solvers start from that linear problem's
    solution (:meth:`start`, closed form) with the step ``1 / (1 / eta + 4 c)``, the inverse of its largest
    eigenvalue (:meth:`first_step`): they are left only the part of the problem the scores' spread adds."""

    dense = False

    def __init__(self, scale: torch.Tensor, dim: int):
        if scale.dim() != 3:
            raise ValueError(f"DiagonalWeight takes one scale per group, (G, 1, 1); got {tuple(scale.shape)}")
        self.scale, self.dim = scale, dim

    @property
    def groups(self) -> torch.Tensor:
        """The per-group scales, split and subset with the groups (:meth:`regroup`)."""
        return self.scale

    def regroup(self, groups: Optional[torch.Tensor]) -> "DiagonalWeight":
        """This weight for a subset of the groups, given as :attr:`groups` subset alike."""
        return self if groups is None else DiagonalWeight(groups, self.dim)

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.scale,)

    def cast(self, dtype: torch.dtype) -> "DiagonalWeight":
        return DiagonalWeight(self.scale.detach().to(dtype), self.dim)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def back(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.scale

    def gram(self, u: torch.Tensor) -> torch.Tensor:
        return u * self.scale.pow(2)

    def gram_norm(self) -> torch.Tensor:  # ||s^2 I||_F per group
        return self.scale.pow(2).flatten() * self.dim ** 0.5

    def _c(self, heads: int, dtype: torch.dtype) -> torch.Tensor:
        return self.scale.to(dtype).pow(2) * (self.dim // heads) ** -0.5

    def start(self, x: torch.Tensor, heads: int, eta: float) -> torch.Tensor:
        """``z`` with ``x + z W = mean / (1 + 4 eta c) + (x - mean) / (1 + 2 eta c)`` (``mean`` over the group's
        tokens): the prox of the potential linearised at uniform attention (class docstring). Written without
        dividing by ``s`` (``y - x = -2 eta c (x - mean) / (1 + 2 eta c) - 4 eta c mean / (1 + 4 eta c)``, and
        ``c / s = s / sqrt(d)``); differentiable in ``x`` and ``s``."""
        c = self._c(heads, x.dtype)
        mean = x.mean(-2, keepdim=True)
        s_over = self.scale.to(x.dtype) * (2 * eta * (self.dim // heads) ** -0.5)  # 2 eta c / s
        return -s_over * ((x - mean) / (1 + 2 * eta * c) + 2 * mean / (1 + 4 * eta * c))

    def first_step(self, heads: int, eta: float) -> torch.Tensor:
        """``1 / (1 / eta + 4 c)`` per group (G,)."""
        return 1.0 / (1.0 / eta + 4.0 * self._c(heads, self.scale.dtype).detach().flatten())


Weight = Union[torch.Tensor, DenseWeight, DiagonalWeight]


def as_weight(weight: Weight):
    """``weight`` as a :class:`DenseWeight` / :class:`DiagonalWeight` (a plain matrix is a dense one)."""
    return weight if isinstance(weight, (DenseWeight, DiagonalWeight)) else DenseWeight(weight)
