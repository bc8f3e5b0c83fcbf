"""A certifiable LipsFormer: 1-Lipschitz layers, bound keeping, the Lipschitz-margin loss (issue 17)."""
import math

import pytest
import timm
import torch

from conftest import TINY, family
from lipsformer.layers import ConvexResidual, GroupSort, create_residual


def test_groupsort_is_a_permutation_per_pair():
    x = torch.tensor([[1.0, 3.0, -2.0, -5.0, 0.5, 0.5]])
    assert GroupSort(2)(x).tolist() == [[3.0, 1.0, -2.0, -5.0, 0.5, 0.5]]
    assert GroupSort(3)(x).tolist() == [[3.0, 1.0, -2.0, 0.5, 0.5, -5.0]]
    with pytest.raises(ValueError, match="divisible by group_size 4"):
        GroupSort(4)(x)
    # norm-preserving, hence 1-Lipschitz: no pair of inputs moves further apart
    a, b = torch.randn(2, 1000, 8).unbind(0)
    ga, gb = GroupSort(2)(a), GroupSort(2)(b)
    assert torch.allclose(ga.norm(dim=-1), a.norm(dim=-1))
    assert ((ga - gb).norm(dim=-1) <= (a - b).norm(dim=-1) + 1e-6).all()


def test_convex_residual_is_a_convex_combination():
    res = ConvexResidual(4, alpha_init=0.25)
    assert res.alpha.shape == (1,)  # one scalar: per-channel weights would break the bound
    x, fx = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(res(x, fx), 0.75 * x + 0.25 * fx)
    with pytest.raises(ValueError, match=r"alpha_init in \[0, 1\]"):
        ConvexResidual(4, alpha_init=1.5)
    with pytest.raises(ValueError, match="residual must be one of"):
        create_residual("sum", 4, 0.1)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_certifiable_options_build_and_run(name):
    kw = dict(TINY[family(name)], init="xavier")
    model = timm.create_model(name, num_classes=3, residual="convex", act="groupsort", norm="none",
                              alpha_init=0.5, **kw)
    assert model.lipschitz.residual == "convex" and model.lipschitz.act == "groupsort"
    assert all(isinstance(m, ConvexResidual) for n, m in model.named_modules() if n.endswith(("res1", "res2",
                                                                                              "res_attn", "res_mlp")))
    assert any(isinstance(m, GroupSort) for m in model.modules())
    assert not any(isinstance(m, torch.nn.GELU) for m in model.modules())
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3) and torch.isfinite(out).all()
