"""timm's model face, shared by the LipsFormer families.

Both families are a ``patch_embed`` producing (B, H, W, C), a sequence of ``stages`` (each an
optional ``downsample``, an optional ``act``, then ``blocks``), a final ``norm`` and a pooled ``head``.
The family files build those pieces; this class gives them the methods timm and its tools expect.
"""
import os
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead
from timm.models import PretrainedCfg, build_model_with_cfg, checkpoint_seq
from timm.models._features import feature_take_indices
from torch import nn

from ..layers import LipschitzOptions, init_weights
from ..layers.normalized import LINEARS, normalize_linear_maps
from ..weights import Adapter, CheckpointError, fit_state_dict, read_checkpoint, unwrap_state_dict, verify_sha256


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The scalar constructor arguments both families share: argument -> (test, what the error says it must be).
ARGUMENTS = {
    "in_chans": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "num_classes": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: no classifier, the pooled features out)"),
    "embed_dim": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "patch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "mlp_ratio": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "drop_rate": (lambda v: _is_number(v) and 0 <= v < 1, "in [0, 1)"),
    "proj_drop_rate": (lambda v: _is_number(v) and 0 <= v < 1, "in [0, 1)"),
    "drop_path_rate": (lambda v: _is_number(v) and 0 <= v < 1, "in [0, 1)"),
}


def check_arguments(depths, num_heads, *, stage_lists: Optional[dict] = None, **scalars) -> None:
    """A ``ValueError`` naming the argument unless the constructor's arguments can build a model: each scalar of
    :data:`ARGUMENTS` in its range; ``depths`` a list of at least one stage, each of at least one block;
    ``num_heads`` (and each of ``stage_lists``, e.g. CSwin's ``split_size``) one positive integer per stage, each
    stage's width (``embed_dim * 2**i``) divisible by its heads; an MLP of at least one hidden unit. Sizes that
    must fit ``img_size`` (windows, stripes) are checked where each stage is built."""
    for name, value in scalars.items():
        test, says = ARGUMENTS[name]
        if not test(value):
            raise ValueError(f"{name} must be {says}, got {value!r}")
    lists = dict(depths=depths, num_heads=num_heads, **(stage_lists or {}))
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) and v >= 1 for v in value):
            raise ValueError(f"{name} must be a list of integers >= 1, one per stage, got {value!r}")
    if not depths:
        raise ValueError("depths must name at least one stage (of at least one block), got an empty list")
    if len({len(v) for v in lists.values()}) > 1:
        named = [f"{k} {tuple(v)}" for k, v in lists.items()]
        raise ValueError(f"{', '.join(named[:-1])} and {named[-1]} must have the same length (one value per stage)")
    embed_dim = scalars["embed_dim"]
    for i, heads in enumerate(num_heads):
        if embed_dim * 2 ** i % heads:
            raise ValueError(f"num_heads[{i}] = {heads} does not divide stage {i}'s width {embed_dim * 2 ** i} "
                             f"(embed_dim {embed_dim} x 2^{i}); choose embed_dim and num_heads so that each divides")
    if int(embed_dim * scalars["mlp_ratio"]) < 1:
        raise ValueError(f"mlp_ratio {scalars['mlp_ratio']} gives the MLP no hidden unit at embed_dim {embed_dim}")


# True while timm builds a model whose weights it loads next (``pretrained=True``): the costly spectral init is left
# out.
_WEIGHTS_WILL_LOAD: ContextVar[bool] = ContextVar("lipsformer_weights_will_load", default=False)


class LipsStage(nn.Module):
    """``downsample`` (identity in the first stage), ``act`` (``LipschitzOptions.stage_act``; identity by default,
    no parameters) then ``blocks``, optionally checkpointed."""

    def __init__(self, downsample: nn.Module, blocks: List[nn.Module], act: Optional[nn.Module] = None):
        super().__init__()
        self.downsample = downsample
        self.act = nn.Identity() if act is None else act
        self.blocks = nn.Sequential(*blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.downsample(x))
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


class LipsFormerBase(nn.Module):
    """Subclasses set ``patch_embed``, build their stages (:class:`LipsStage`) and pass them to :meth:`_set_stages`,
    set ``norm``, then call :meth:`_build_head`."""

    patch_embed: nn.Module
    stages: nn.Sequential
    norm: nn.Module
    num_features: int
    feature_info: List[dict]
    lipschitz: LipschitzOptions
    output_fmt = "NHWC"  # forward_features' layout, as timm's Swin declares it

    def _set_stages(self, stages: List[LipsStage], embed_dim: int, lipschitz: LipschitzOptions) -> None:
        """Keep the family's stages (stage ``i`` of width ``embed_dim * 2**i`` at 1 / (patch * 2**i) of the input) and
        its resolved Lipschitz choices as ``self.lipschitz``; sets ``stages``, ``feature_info`` and ``num_features``."""
        self.lipschitz = lipschitz
        patch = self.patch_embed.patch_size[0]
        self.stages = nn.Sequential(*stages)
        self.feature_info = [dict(num_chs=embed_dim * 2 ** i, reduction=patch * 2 ** i, module=f"stages.{i}")
                             for i in range(len(stages))]
        self.num_features = embed_dim * 2 ** (len(stages) - 1)

    def _stage_resolutions(self, num_stages: Optional[int] = None) -> List[Tuple[int, int]]:
        """Each stage's (H, W) at the size ``patch_embed`` is built for; an odd size to halve is an error."""
        num_stages = len(self.stages) if num_stages is None else num_stages
        patch = self.patch_embed.patch_size[0]
        res = [self.patch_embed.grid_size]
        for i in range(1, num_stages):
            h, w = res[-1]
            if h % 2 or w % 2:
                raise ValueError(f"stage {i} cannot halve an odd resolution {(h, w)}; "
                                 f"use an img_size divisible by {patch * 2 ** (num_stages - 1)}")
            res.append((h // 2, w // 2))
        return res

    def _build_head(self, num_classes: int, global_pool: str, drop_rate: float) -> None:
        """timm's ClassifierHead: ``num_classes`` 0 gives none (the pooled features come out, as timm's models),
        1 a single logit (a score; training needs two classes or more)."""
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.head_hidden_size = self.num_features
        try:
            self.head = ClassifierHead(self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate,
                                       input_fmt="NHWC")
        except AssertionError as e:  # timm's pooling factory asserts on an unknown type
            raise ValueError(f"global_pool {global_pool!r}: {e} (timm's: avg, max, avgmax, catavgmax, '')") from None

    def _init_weights(self, mode: str) -> None:
        """:func:`lipsformer.layers.init_weights` over the model. When the weights are about to be loaded
        (timm's ``pretrained=True``, :func:`lipsformer.build.build_model` with a source) the spectral division is
        left out except for the classifier, the one layer a load re-creates (another class count)."""
        loading = _WEIGHTS_WILL_LOAD.get()
        init_weights(self, mode, normalize=not loading)
        if loading:
            init_weights(self.head, mode)
        self._apply_linear_option(self)

    def _apply_linear_option(self, module: nn.Module) -> None:
        """``lipschitz.linear``: ``normalized`` / ``normalized_power`` turn ``module``'s Linear and non-overlapping
        Conv2d layers into their spectrally normalised forms
        (:func:`lipsformer.layers.normalized.normalize_linear_maps`)."""
        power_iteration = LINEARS[self.lipschitz.linear]
        if power_iteration is not None:
            normalize_linear_maps(module, power_iteration)

    # -- timm face ---------------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self):
        """Matrix-shaped parameters that must not decay (timm already skips every 1-d one)."""
        return {"*relative_position_bias_table"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        return dict(
            stem=r"^patch_embed",
            blocks=r"^stages\.(\d+)" if coarse else [
                (r"^stages\.(\d+)\.downsample", (0,)),
                (r"^stages\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ],
        )

    def load_pretrained(self, path: str) -> None:
        """timm's ``custom_load`` hook for url and file weights; each family passes its ``checkpoint_filter_fn``
        to :meth:`load_pretrained_file`."""
        raise NotImplementedError(f"{type(self).__name__} must define load_pretrained")

    def load_pretrained_file(self, path: str, filter_fn: Callable[[dict, nn.Module], dict]) -> None:
        """Load weights at ``path`` converted by ``filter_fn``: a download must match the config's sha256
        (a mismatching one is removed from the cache), and the file is read without running pickled code.
        ``filter_fn`` ends in :func:`lipsformer.weights.fit_state_dict`, whose state dict fits the model exactly."""
        cfg = dict(self.pretrained_cfg)
        if not cfg.get("file") and cfg.get("sha256"):
            try:
                verify_sha256(path, cfg["sha256"], cfg.get("url"))
            except CheckpointError as e:
                os.remove(path)
                raise CheckpointError(f"{e}; the cached copy was removed") from None
        cfg["file"] = str(path)
        self.pretrained_cfg = cfg
        self.load_state_dict(filter_fn(read_checkpoint(path), self))

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head.reset(num_classes, pool_type=global_pool)
        self._apply_linear_option(self.head)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, H/32, W/32, num_features), channels last."""
        return self.norm(self.stages(self.patch_embed(x)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Stage outputs as NCHW maps (``indices``: last n stages if int, all if None)."""
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        last = len(self.stages) - 1
        stages = self.stages if not stop_early else self.stages[:max_index + 1]
        intermediates = []
        x = self.patch_embed(x)
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                y = self.norm(x) if norm and i == last else x
                intermediates.append(y.permute(0, 3, 1, 2) if output_fmt == "NCHW" else y)
        if intermediates_only:
            return intermediates
        if len(stages) == len(self.stages):
            x = self.norm(x)
        return x, intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices


# -- released-code layout ----------------------------------------------------------------------
# Inside a block, both released families name the conv blocks and residual weights alike.
RELEASED_BLOCK_RENAMES = (
    ("dwconv_layers.0.", "convs.dw1."),
    ("dwconv_layers.1.", "convs.dw2."),
    ("nin.", "convs.pw."),
    ("scale_layers.0.scale", "convs.res1.alpha"),
    ("scale_layers.1.scale", "convs.res2.alpha"),
    ("alpha1.scale", "res_attn.alpha"),
    ("alpha2.scale", "res_mlp.alpha"),
)


def rename_prefix(key: str, renames, inverse: bool = False) -> str:
    """Replace the first matching prefix of ``key`` using (released, ours) pairs."""
    for released, ours in renames:
        src, dst = (ours, released) if inverse else (released, ours)
        if key.startswith(src):
            return dst + key[len(src):]
    return key


def convert_released(state_dict: dict, model: nn.Module, released_marker: str,
                     rename: Callable[[str], Optional[str]], adapt: Optional[Adapter] = None) -> dict:
    """Our state dict from a released-layout one (raw or wrapped); one already in our layout passes through.
    Either way it then passes the fit check (:func:`lipsformer.weights.fit_state_dict`), which returns what to load.

    ``released_marker`` is a key prefix only the released layout has; ``rename`` maps a released key to ours,
    or to ``None`` for buffers we rebuild and modules the released code builds but never uses. The released
    code builds its 1x1 conv (``nin``) even without conv blocks: it is dropped when the model has none. Released
    checkpoints fix tau; a model built with ``learn_tau=True`` starts from its own tau. ``adapt(state_dict, model)``
    fits tensors to the model's configuration (e.g. bias tables to its window size) inside the fit check.
    """
    state_dict = unwrap_state_dict(state_dict)
    if any(k.startswith(released_marker) for k in state_dict):
        ours = model.state_dict()
        has_pw = any(k.endswith("convs.pw.weight") for k in ours)
        converted = {}
        for key, value in state_dict.items():
            new = rename(key)
            if new is None or (".convs.pw." in new and not has_pw):
                continue
            converted[new] = value
        for name, value in ours.items():
            if name.endswith(".tau") and name not in converted:
                converted[name] = value.detach().clone()
        state_dict = converted
    return fit_state_dict(state_dict, model, weights_source(model.pretrained_cfg), adapt)


def build_with_cfg(model_cls, variant: str, pretrained: bool, checkpoint_filter_fn: Callable[[dict, nn.Module], dict],
                   **kwargs):
    """timm's ``build_model_with_cfg`` as both families' ``_create_*`` call it (what ``timm.create_model`` runs; a model
    with weights from a source is :func:`lipsformer.build.build_model`'s): the family's checkpoint conversion, and
    ``features_only`` through forward_intermediates.

    timm applies ``checkpoint_filter_fn`` to state dicts it reads itself; files and urls go through the
    family's ``load_pretrained`` (``custom_load``), which applies the same function."""
    out_indices = kwargs.pop("out_indices", (0, 1, 2, 3))
    overlay = kwargs.get("pretrained_cfg_overlay")
    if overlay and (overlay.get("file") or overlay.get("url")):
        # timm resets custom_load for a new source; ours reads every layout safely, so keep it
        kwargs["pretrained_cfg_overlay"] = dict(overlay, custom_load=overlay.get("custom_load", True))
    token = _WEIGHTS_WILL_LOAD.set(bool(pretrained))
    try:
        return build_model_with_cfg(
            model_cls, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(feature_cls="getter", out_indices=out_indices),
            **kwargs)
    finally:
        _WEIGHTS_WILL_LOAD.reset(token)


@dataclass
class LipsPretrainedCfg(PretrainedCfg):
    """timm's pretrained config plus ``sha256``: the hash of the file at ``url``, checked after download."""

    sha256: Optional[str] = None


def pretrained_cfg(url: str = "", **kwargs) -> LipsPretrainedCfg:
    """ImageNet preprocessing of both families: 224x224, bicubic, crop 0.9, ImageNet mean/std.

    ``custom_load`` routes url and file weights through :meth:`LipsFormerBase.load_pretrained` (sha256, safe read).
    """
    return LipsPretrainedCfg(**{
        "url": url, "custom_load": True,
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (7, 7), "fixed_input_size": True,
        "crop_pct": 0.9, "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head.fc",
        **kwargs,
    })


def certified_cfg(**kwargs) -> LipsPretrainedCfg:
    """:func:`pretrained_cfg` of the certifiable (``*_cert``) models: mean 0.5, std 1, no weights.

    A certificate is a radius in pixel space ([0, 1] images), and the input normalisation ``(x - mean) / std`` is
    ``1 / min(std)``-Lipschitz: with ImageNet's std (0.225) every certified radius would shrink 4.4 times for a
    network bound of 1 (``lipschitz.certify.pixel_lipschitz``). With std 1 the network's bound is the pixel-space
    bound; the mean only shifts the input (no effect on the bound) and 0.5 centres [0, 1]."""
    return pretrained_cfg(**{"mean": (0.5, 0.5, 0.5), "std": (1.0, 1.0, 1.0), **kwargs})


def weights_source(cfg: Optional[dict]) -> str:
    """Where a pretrained config's weights come from, for error messages."""
    cfg = cfg or {}
    return str(cfg.get("file") or cfg.get("url") or cfg.get("hf_hub_id") or "the state dict")


def drop_path_rates(rate: float, n: int) -> List[float]:
    """Stochastic depth rising linearly from 0 to ``rate`` over ``n`` blocks (plain floats: meta-device safe)."""
    return [rate * i / (n - 1) if n > 1 else 0.0 for i in range(n)]
