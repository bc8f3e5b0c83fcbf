"""What makes a run fast, in one place: TF32 matmuls, channels-last inputs, gradient checkpointing, torch.compile.

train.py (TrainConfig keys ``tf32``, ``channels_last``, ``grad_checkpointing``, ``compile``, ``compile_mode``,
``compile_memory_budget``), eval.py (``--compile``, ``--channels-last``) and ``benchmarks/throughput.py`` apply
them through these functions:

    set_tf32(cfg.tf32)                                   # process-wide, after the Accelerator is made
    model = prepare_model(model, channels_last=..., grad_checkpointing=...)   # before accelerator.prepare
    model, optimizer = accelerator.prepare(model, optimizer)
    compile_model(model, mode, memory_budget)            # after prepare, in place: the DDP / FSDP2-wrapped module

None of them changes a model's outputs beyond floating-point rounding: channels-last is a memory layout,
checkpointing recomputes the same forward pass, compiling fuses the same operations (a compiled CPU step is
bit-identical from run to run, so a resumed compiled run matches an uninterrupted one; tested: see
:func:`compile_model` for what that takes).
"""
from typing import Optional

import torch
import torch._functorch.config as functorch_config

from ..config import COMPILE_MODES
from ..layers import LipsBlock


def set_tf32(enable: bool) -> None:
    """Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (10-bit mantissa products). Only fp32
    work is affected: under bf16 / fp16 autocast the matmuls already run in the low precision."""
    torch.backends.cuda.matmul.allow_tf32 = enable
    torch.backends.cudnn.allow_tf32 = enable


def prepare_model(model: torch.nn.Module, channels_last: bool = False,
                  grad_checkpointing: bool = False) -> torch.nn.Module:
    """Layout and checkpointing, set on the bare module before Accelerate wraps it.

    ``channels_last`` stores 4-d parameters (the patch embedding, depth-wise and stage convolutions) as NHWC;
    a convolution with NHWC weights runs NHWC whatever the input's layout, and LipsFormer keeps its activations
    (B, H, W, C) between convolutions, so the input batch needs no conversion. ``grad_checkpointing`` keeps
    only each block's input for backward and recomputes the rest (timm's ``set_grad_checkpointing``, which every
    timm model has; what it saves: README Speed).
    """
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def compile_model(model: torch.nn.Module, mode: str = "default",
                  memory_budget: Optional[float] = None, backend: str = "inductor") -> torch.nn.Module:
    """Compile ``model`` in place by region (:func:`compile_regions`: each repeated block's body, or the whole model
    with ``nn.Module.compile``; no ``_orig_mod`` wrapper, so parameter names, ``accelerator.unwrap_model``,
    checkpoints and the EMA see the same module) and return it. ``backend`` is torch.compile's (``inductor``;
    ``eager`` traces without generating code).

    ``torch.compile`` with static shapes, as a fixed-batch training job has (automatic dynamic shapes make
    the batch symbolic once training and evaluation batches have both run, which slows compiled training,
    README Speed).

    ``memory_budget`` in (0, 1] is the partitioner's activation memory budget
    (``torch._functorch.config.activation_memory_budget``, process-wide): the share of the saved activations
    that backward may keep, the rest recomputed. ``None`` keeps the compiler's default (1.0: keep whatever is
    cheaper than recomputing).

    A model on the CPU is compiled with ``torch.use_deterministic_algorithms(True, warn_only=True)``
    (process-wide). Without it, inductor lowers the backward of the relative-position-bias gather
    (``table[index]``, a scatter-add) to a parallel OpenMP loop of atomic adds whose order, and so whose float
    sum, depends on thread timing: a killed and resumed compiled run could end with another bias table than the
    uninterrupted one on two cores (seen with a cold inductor cache). With the flag the scatter-add runs as ATen's
    ``index_put_``, as in eager mode. CUDA models are left as they are (Triton's atomic
    adds keep their speed; bit-exact resume is promised on the CPU only).

    A CPU model is also compiled without inductor's layout optimisation (``layout_optimization: False``, for this
    compilation only). With oneDNN it stores every 4-d tensor of a graph that has a convolution channels-last,
    taking dim 1 for the channels: LipsFormer's (B, H, W, C) activations would then have H innermost, and kernels
    read them element by element and copy them back (a stage-1 MLP's GELU backward several times slower). The
    convolutions already run channels-last on views of those activations. GPUs keep the default until measured.

    AOTAutograd's cache may hold graphs with custom autograd Functions
    (``autograd_cache_allow_custom_autograd_functions``, process-wide; torch's default refuses them). LipsFormer's
    Functions (fused GELU, residual, depth-wise convolution) are traced whole into the graph, forward and backward,
    so a change to their code changes the cache key (checked: a doubled depth-wise weight gradient missed the
    cache). A resumed or repeated run then loads its training graph instead of tracing it again (tested).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {mode!r}")
    if memory_budget is not None:
        if not 0.0 < memory_budget <= 1.0:
            raise ValueError(f"compile_memory_budget must be in (0, 1], got {memory_budget}")
        functorch_config.activation_memory_budget = float(memory_budget)
    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    options = None
    if all(p.device.type == "cpu" for p in model.parameters()):
        torch.use_deterministic_algorithms(True, warn_only=True)
        options = {**torch._inductor.list_mode_options(mode), "layout_optimization": False}
    if backend != "inductor":  # another backend (timm's --torchcompile NAME) takes no inductor options
        options, mode = None, "default"
    kwargs = dict(backend=backend, mode=None if options is not None or mode == "default" else mode, options=options,
                  dynamic=False)
    blocks = compile_regions(model)
    if not blocks:
        model.compile(**kwargs)
        return model
    body = torch.compile(LipsBlock.body, **kwargs)
    dropping = {block.dim for block in blocks if block.drops()}
    for block in blocks:
        block.compiled_body = body
        block.compiled_unit_draws = not block.drops() and block.dim in dropping
    return model


def compile_regions(model: torch.nn.Module) -> list:
    """The regions :func:`compile_model` compiles: every LipsFormer block (``LipsBlock``) of ``model``, whose
    :meth:`~lipsformer.layers.LipsBlock.body` one compiled function runs (the DropPath draws made eagerly, as inputs;
    a block that does not drop takes factors of one where blocks of its width do, ``compiled_unit_draws``),
    so that a model traces one graph per stage shape rather than one for the whole network and the stem,
    downsampling and head run eagerly, with the fused ops. A model without LipsFormer blocks is compiled whole."""
    return [m for m in model.modules() if isinstance(m, LipsBlock)]
