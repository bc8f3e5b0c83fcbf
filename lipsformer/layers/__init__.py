"""Lipschitz building blocks. Layers know nothing of models."""
from .attention import ATTENTIONS, AttentionKernel, dot_attention, l2_attention, scsa
from .attlip import AttLip, AttLipMixer
from .block import LipsBlock
from .conv_blocks import ACTS, CONV_BLOCKS, ConvBlocks, create_act
from .fused import l2_normalize, use_fused_ops
from .groupsort import GroupSort, group_sort
from .init import INITS, init_weights
from .norm import NORMS, CenterNorm, create_norm
from .normalized import LINEARS, NormalizedConv2d, NormalizedLinear, normalize_linear_maps
from .options import STAGE_ACTS, LipschitzOptions
from .patch_embed import PatchEmbed
from .residual import RESIDUALS, ConvexResidual, WeightedResidual, create_residual
from .spectral import largest_singular_value
from .windows import pad_to_multiple, window_partition, window_reverse

__all__ = [
    "ATTENTIONS", "AttentionKernel", "AttLip", "AttLipMixer", "dot_attention", "l2_attention", "l2_normalize", "scsa",
    "LipsBlock", "CONV_BLOCKS", "ConvBlocks", "INITS", "init_weights", "largest_singular_value", "LipschitzOptions",
    "NORMS", "CenterNorm",
    "STAGE_ACTS",
    "create_norm", "PatchEmbed", "WeightedResidual", "pad_to_multiple", "window_partition", "window_reverse",
    "ACTS", "create_act", "GroupSort", "group_sort", "RESIDUALS", "ConvexResidual", "create_residual",
    "LINEARS", "NormalizedLinear", "NormalizedConv2d", "normalize_linear_maps", "use_fused_ops",
]
