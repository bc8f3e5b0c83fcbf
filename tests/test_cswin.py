"""CSwin cross-shaped attention against a direct, token-by-token computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from lipsformer.layers import AttentionKernel
from lipsformer.models.lipsformer_cswin import CrossShapedAttention


def _direct(attn: CrossShapedAttention, x: torch.Tensor, stripes) -> torch.Tensor:
    """Each token attends to exactly the tokens of its stripe; LePE is a 3x3 conv zero-padded at the stripe edge."""
    _, H, W, C = x.shape
    qkv = F.linear(x[0], attn.qkv.weight, attn.qkv.bias)
    q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    nb, nh = len(stripes), attn.branch_heads
    cb, hd = C // nb, C // nb // nh
    out = torch.zeros(H, W, C, dtype=x.dtype)
    for h in range(H):
        for w in range(W):
            for b, same_stripe in enumerate(stripes):
                members = [(i, j) for i in range(H) for j in range(W) if same_stripe((h, w), (i, j))]
                for head in range(nh):
                    c = slice(b * cb + head * hd, b * cb + (head + 1) * hd)
                    qi = F.normalize(q[h, w, c], dim=0)
                    logits = torch.stack([12.0 * qi @ F.normalize(k[i, j, c], dim=0) for i, j in members])
                    p = logits.softmax(0)
                    out[h, w, c] = sum(p[t] * v[i, j, c] for t, (i, j) in enumerate(members))
                conv = attn.lepe[b]
                for ch in range(cb):
                    acc = conv.bias[ch].clone()
                    for dh in (-1, 0, 1):
                        for dw in (-1, 0, 1):
                            if (h + dh, w + dw) in members:
                                acc = acc + conv.weight[ch, 0, dh + 1, dw + 1] * v[h + dh, w + dw, b * cb + ch]
                    out[h, w, b * cb + ch] += acc
                out[h, w, b * cb:(b + 1) * cb] /= math.sqrt(nh)
    return F.linear(out, attn.proj.weight, attn.proj.bias)[None]


def test_stripe_attention_equals_direct_computation():
    torch.manual_seed(0)
    attn = CrossShapedAttention(8, 4, (4, 6), split_size=2, kernel=AttentionKernel("scsa", tau=12.0)).double()
    x = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    vertical = lambda a, b: a[1] // 2 == b[1] // 2  # noqa: E731  (H x 2 stripes, first half of the heads)
    horizontal = lambda a, b: a[0] // 2 == b[0] // 2  # noqa: E731  (2 x W stripes, second half)
    torch.testing.assert_close(attn(x), _direct(attn, x, [vertical, horizontal]))


def test_full_attention_branch_equals_direct_computation():
    torch.manual_seed(0)
    attn = CrossShapedAttention(8, 2, (3, 3), split_size=3, full=True,
                                kernel=AttentionKernel("scsa", tau=12.0)).double()
    x = torch.randn(1, 3, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _direct(attn, x, [lambda a, b: True]))


def test_token_outside_both_stripes_has_no_influence():
    torch.manual_seed(0)
    attn = CrossShapedAttention(8, 2, (4, 4), split_size=1, kernel=AttentionKernel("scsa", tau=12.0))
    x = torch.randn(1, 4, 4, 8, requires_grad=True)
    attn(x)[0, 1, 2].sum().backward()
    influence = x.grad[0].abs().sum(-1) > 0
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[1, :] = True  # its row (horizontal stripe)
    expected[:, 2] = True  # its column (vertical stripe)
    assert torch.equal(influence, expected)


def test_odd_head_count_cannot_split_into_two_branches():
    with pytest.raises(ValueError, match="must be even"):
        CrossShapedAttention(6, 3, (4, 4), split_size=2, kernel=AttentionKernel())
