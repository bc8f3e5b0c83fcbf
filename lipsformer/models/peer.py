"""A peer 1-Lipschitz CNN built from deel-torchlip's layers: the baseline no one here tuned.

    timm.create_model("torchlip_cnn", in_chans=1, img_size=32, num_classes=10)   # pip install "lipsformer[torchlip]"

The network is deel-torchlip's own recipe for 28x28 grey images (its documentation's multiclass example on
Fashion-MNIST): ``SpectralConv2d(16, 3x3, same)``, GroupSort2, ``ScaledL2NormPool2d(2)``, ``SpectralConv2d(32, 3x3,
same)``, GroupSort2, ``ScaledL2NormPool2d(2)``, flatten, ``SpectralLinear(64)``, GroupSort2, ``SpectralLinear(classes,
bias=False)``, in one ``torchlip.Sequential(k_coef_lip=1)``; only the flattened width follows ``img_size`` (the
recipes feed 32x32 padded digits: 2048 instead of 1568). Its layers keep each weight near norm 1 by power iteration
and Bjorck orthonormalisation inside the forward, and scale the padded convolutions by their coefficient.

Certified like every model here, from the weights the forward uses, not from the library's promise: its report
(:func:`lipsformer.lipschitz.bounds.torchlip_cnn_report`, the toolkit's, as every bound is) bounds each
convolution as the operator it is at its input size (padding included,
:func:`~lipsformer.lipschitz.layer_bounds.conv_bound`), each Linear by its largest singular value, GroupSort
and flatten by 1, each non-overlapping l2-norm pooling by its coefficient; the last Linear is the head of the
pairwise rule. deel-torchlip ships no certificate helper (its
documentation computes ``(top1 - top2) / sqrt(2)`` by hand, the global rule at L = 1); its
``evaluate_lip_const`` is an empirical lower estimate, which the tests hold below our bound.

Registered with timm whether or not deel-torchlip is installed; building it without it is one line naming the extra.
"""
from typing import Tuple

from timm.models import register_model
from torch import nn

from ..extras import require


class TorchlipCNN(nn.Module):
    """deel-torchlip's 1-Lipschitz CNN for MNIST-sized images (module docstring) as a timm-style model."""

    def __init__(self, num_classes: int = 10, in_chans: int = 1, img_size: int = 32, widths: Tuple[int, int] = (16, 32),
                 hidden: int = 64):
        super().__init__()
        checks = [("num_classes", num_classes, 1), ("in_chans", in_chans, 1), ("img_size", img_size, 4),
                  ("hidden", hidden, 1), *((f"widths[{i}]", w, 1) for i, w in enumerate(widths))]
        for name, value, least in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if img_size % 4:
            raise ValueError(f"img_size {img_size} must be divisible by 4 (two 2x2 poolings)")
        torchlip = require("deel.torchlip", "torchlip", "the peer CNN (torchlip_cnn)")
        side = img_size // 4
        self.num_classes, self.img_size = num_classes, img_size
        self.pretrained_cfg = dict(input_size=(in_chans, img_size, img_size), mean=(0.5,) * in_chans,
                                   std=(1.0,) * in_chans, crop_pct=1.0, interpolation="bicubic",
                                   num_classes=num_classes, architecture="torchlip_cnn")
        self.net = torchlip.Sequential(
            torchlip.SpectralConv2d(in_chans, widths[0], kernel_size=(3, 3), padding="same"),
            torchlip.GroupSort2(),
            torchlip.ScaledL2NormPool2d(kernel_size=(2, 2)),
            torchlip.SpectralConv2d(widths[0], widths[1], kernel_size=(3, 3), padding="same"),
            torchlip.GroupSort2(),
            torchlip.ScaledL2NormPool2d(kernel_size=(2, 2)),
            nn.Flatten(),
            torchlip.SpectralLinear(widths[1] * side * side, hidden),
            torchlip.GroupSort2(),
            torchlip.SpectralLinear(hidden, num_classes, bias=False),
            k_coef_lip=1.0,
        )

    def forward(self, x):
        return self.net(x)


@register_model
def torchlip_cnn(pretrained: bool = False, **kwargs) -> TorchlipCNN:
    """deel-torchlip's 1-Lipschitz CNN for 28-32 px grey images (needs ``pip install "lipsformer[torchlip]"``)."""
    if pretrained:
        raise ValueError("torchlip_cnn has no published weights")
    overlay = kwargs.pop("pretrained_cfg_overlay", None) or {}
    for key in ("pretrained_cfg", "cache_dir", "drop_path_rate", "drop_rate"):  # timm's, or training's
        kwargs.pop(key, None)
    model = TorchlipCNN(**kwargs)
    model.pretrained_cfg.update(overlay)
    return model

