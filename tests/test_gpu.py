"""The GPU path (``pytest -m gpu``; every test here is skipped where CUDA is not available).

- CUDA against CPU: outputs and gradients of both families and every attention kind, fp32 (TF32 off) and bf16
  autocast;
- the fused GELU autograd functions (layers/gelu.py) under bf16 and fp16 autocast, fp16 with a GradScaler;
- the fused ops' Triton kernels (layers/fused.py) in a training step of both families, against the plain ops;
- which ``scaled_dot_product_attention`` kernel runs for each attention kind: only fused kernels are allowed
  (``sdpa_kernel`` restricted to flash / memory-efficient / cuDNN raises where only the math kernel applies),
  and the profiler names the one that ran (recorded as a junit property, see benchmarks/gpu.sh);
- ``torch.compile`` forward and backward with ``fullgraph=True`` (a graph break is an error);
- a training step without host synchronisation (CUDA's sync debug mode);
- ``accelerate launch`` training on one GPU in bf16 and fp16 with a mid-epoch resume, and FSDP2 with the EMA.

Models are tiny but keep every head 16 or 32 wide: the fused kernels need head sizes that are multiples of 8.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from helpers import TINY_RUN, make_folder

from lipsformer.layers import fused as fused_ops
from lipsformer.layers.fused import gelu_residual, use_fused_ops
from lipsformer.layers.gelu import gelu_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"
GPU_TINY = {  # head sizes 32 (Swin) and 16-32 (CSwin: each stripe branch has half the heads on half the channels)
    "lipsformer_swin_t": dict(img_size=64, embed_dim=32, depths=(1, 1, 2, 1), num_heads=(1, 2, 4, 8), window_size=4),
    "lipsformer_cswin_t": dict(img_size=64, embed_dim=32, depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 8),
                               split_size=(1, 2, 2, 2)),
}
# attention kinds (model kwargs); attlip is an optimisation layer of its own, without SDPA
KINDS = {"scsa": {}, "dot": dict(attn="dot"), "l2": dict(attn="l2"), "kim": dict(attn="l2", tied_qk=True),
         "attlip": dict(attn="attlip")}
SDPA_KINDS = [k for k in KINDS if k != "attlip"]
FUSED_OPS = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention")
MATH_OP = "aten::_scaled_dot_product_attention_math"


# First in the file, so that workers sharing the tests out (benchmarks/gpu.sh: pytest-xdist) start the longest,
# which launch training runs of their own, at once.
def _launch(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
                           "--num_processes", "1", "--dynamo_backend", "no", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _gpu_config(tmp_path: Path, **overrides) -> Path:
    model_kwargs = {k: v for k, v in GPU_TINY["lipsformer_swin_t"].items() if k != "img_size"}
    cfg = dict(TINY_RUN, img_size=64, model_kwargs=model_kwargs, data_dir=str(make_folder(tmp_path / "data")),
               epochs=2, checkpoint_every_steps=2, keep_last=20)
    cfg.update(overrides)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _assert_close_weights(a_path: Path, b_path: Path, atol: float):
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < atol, worst


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_launch_trains_on_one_gpu_and_resumes_mid_epoch(tmp_path, precision):
    """Two epochs of 6 steps; a second run resumed from step 8 (mid-epoch 2) ends where the first did. CUDA's
    backward kernels add in a varying order (the bias table's scatter, the attention bias), so the weights
    agree to rounding, not bit for bit."""
    config = _gpu_config(tmp_path, mixed_precision=precision)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _launch("--mixed_precision", precision, "train.py", "--config", str(config), "--output-dir", str(full))
    checkpoint = full / "checkpoints" / "step_000000008"
    assert checkpoint.is_dir()
    proc = _launch("--mixed_precision", precision, "train.py", "--config", str(config), "--output-dir",
                   str(resumed), "--resume", str(checkpoint))
    assert "(step 8: epoch 2, 2 of its batches done)" in proc.stdout
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "epoch"] == [6, 12]
    assert all(r["skipped_steps"] == 0 for r in rows if r["kind"] == "epoch")
    for name in ("last.safetensors", "last_ema.safetensors"):
        _assert_close_weights(full / name, resumed / name, atol=1e-4)


def test_fsdp2_with_ema_on_one_gpu_matches_the_plain_run(tmp_path):
    """FSDP2 (one shard: the whole model) with the EMA over its DTensor parameters, fp32, against the same run
    without FSDP; then resumed from its sharded checkpoint."""
    config = _gpu_config(tmp_path, mixed_precision="no", ema_decay=0.9)
    plain, fsdp, resumed = tmp_path / "plain", tmp_path / "fsdp", tmp_path / "fsdp_resumed"
    _launch("--mixed_precision", "no", "train.py", "--config", str(config), "--output-dir", str(plain))
    fsdp_args = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
                 "--fsdp_cpu_ram_efficient_loading", "false", "--mixed_precision", "no", "train.py",
                 "--config", str(config)]
    _launch(*fsdp_args, "--output-dir", str(fsdp))
    _launch(*fsdp_args, "--output-dir", str(resumed), "--resume", str(fsdp / "checkpoints" / "step_000000008"))
    for name in ("last.safetensors", "last_ema.safetensors"):
        _assert_close_weights(plain / name, fsdp / name, atol=1e-4)
        _assert_close_weights(fsdp / name, resumed / name, atol=1e-4)
    ema, last = load_file(str(fsdp / "last_ema.safetensors")), load_file(str(fsdp / "last.safetensors"))
    assert not torch.equal(ema["head.fc.weight"], last["head.fc.weight"])  # the average, not the last weights


@pytest.fixture(autouse=True)
def _exact_fp32():
    """fp32 comparisons need full fp32 products: cuDNN convolutions use TF32 unless told otherwise."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _model(name: str, kind: str = "scsa", **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=10, drop_path_rate=0.0, init="xavier",
                             **GPU_TINY[name], **KINDS[kind], **kwargs)


def _forward_backward(model, x, dtype):
    """Logits (fp32) and every parameter's gradient of a fixed random projection of them."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x).float()
    weights = torch.linspace(-1, 1, logits.numel(), device=x.device).reshape(logits.shape)
    (logits * weights).sum().backward()
    return logits.detach().cpu(), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(GPU_TINY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_cpu_outputs_and_gradients(name, kind, dtype):
    if kind == "attlip" and dtype == torch.bfloat16:
        pytest.skip("AttLip's solver accepts or rejects each descent step (Armijo test): bf16 rounding can flip a "
                    "decision, so its bf16 outputs are not comparable step for step; fp32 is checked")
    cpu = _model(name, kind).train()
    gpu = copy.deepcopy(cpu).to(DEVICE)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _forward_backward(cpu, x, torch.float32)
    logits, grads = _forward_backward(gpu, x.to(DEVICE), dtype)
    # bf16 keeps 8 bits of mantissa (relative rounding 4e-3) through every block; a defect errs by O(1)
    tol = dict(logits=1e-4, grads=1e-3) if dtype == torch.float32 else dict(logits=5e-2, grads=1e-1)
    assert _rel(logits, ref_logits) < tol["logits"]
    assert grads.keys() == ref_grads.keys()
    flat, ref_flat = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, ref_grads))
    assert _rel(flat, ref_flat) < tol["grads"]  # all gradients together
    worst = {k: _rel(grads[k], ref_grads[k]) for k in ref_grads if ref_grads[k].norm() > 1e-3 * ref_flat.norm()}
    assert max(worst.values()) < 4 * tol["grads"], sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_gelu_functions_match_the_plain_ops_under_autocast(dtype):
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(32, 128).to(DEVICE), torch.nn.Linear(128, 32).to(DEVICE)
    scale = torch.full((32,), 0.3, device=DEVICE, requires_grad=True)
    x = torch.randn(8, 49, 32, device=DEVICE, requires_grad=True)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0 ** 12) if dtype == torch.float16 else None

    def run(fused: bool):
        for t in (x, scale, *fc1.parameters(), *fc2.parameters()):
            t.grad = None
        with torch.autocast(DEVICE, dtype=dtype):
            u = fc1(x)
            h = gelu_linear(u, fc2.weight, fc2.bias) if fused else fc2(F.gelu(u))
            v = fc1(h)[..., :32]
            out = gelu_residual(h, v, scale) if fused else torch.addcmul(h, F.gelu(v), scale)
        loss = out.float().square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        grads = [t.grad for t in (x, scale, *fc1.parameters(), *fc2.parameters())]
        assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        return out.detach().float(), [g.clone() for g in grads]

    plain_out, plain_grads = run(False)
    fused_out, fused_grads = run(True)
    assert _rel(fused_out, plain_out) < 1e-2  # the kernel's GELU in float32, the plain one in the autocast dtype
    for fused, plain in zip(fused_grads, plain_grads):
        assert _rel(fused, plain) < 2e-2
    if scaler is not None:  # a scaled fp16 step unscales to the same finite gradients and is taken
        opt = torch.optim.SGD([scale, *fc1.parameters(), *fc2.parameters()], lr=0.1)
        before = scale.detach().clone()
        scaler.unscale_(opt)
        assert _rel(scale.grad * scaler.get_scale(), fused_grads[1]) < 1e-6
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 12 and not torch.equal(scale.detach(), before)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_ops_run_their_triton_kernels_and_train_like_the_plain_ops(name, dtype, monkeypatch):
    """A training step (DropPath on, the same draws) with every fused op on its Triton kernel, against the same step
    with the fused ops off: outputs and gradients to the dtype's rounding."""
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.3, init="xavier", **GPU_TINY[name]).to(DEVICE)
    x = torch.randn(4, 3, 64, 64, device=DEVICE)
    kernels, calls = fused_ops._kernels, []
    monkeypatch.setattr(fused_ops, "_kernels", lambda t: calls.append(1) or kernels(t))

    def step():
        model.train().zero_grad()
        torch.manual_seed(3)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        return [out.detach().float()] + [p.grad.clone() for p in model.parameters()]

    with use_fused_ops(False):
        plain = step()
    assert not calls
    through_kernels = step()
    assert calls and kernels(x) is not None  # Triton's kernels ran
    for a, b in zip(through_kernels, plain):
        assert _rel(a, b) < (1e-4 if dtype == torch.float32 else 3e-2)


def _sdpa_ops(model, x, dtype) -> set:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _forward_backward(model, x, dtype)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.parametrize("kind", SDPA_KINDS)
@pytest.mark.parametrize("name", list(GPU_TINY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_runs_a_fused_sdpa_kernel(name, kind, dtype, record_property):
    """Swin's relative position bias and l2's key bias are additive float masks: flash attention takes none, the
    memory-efficient kernel (and cuDNN's) does, with a gradient for the bias. CSwin's stripes have no bias, so
    flash applies in bf16. The math kernel must never be the one that runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = _model(name, kind).to(DEVICE).train()
    x = torch.randn(4, 3, 64, 64, device=DEVICE)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        _forward_backward(model, x, dtype)  # raises "No available kernel" if only the math kernel applies
    ops = _sdpa_ops(model, x, dtype)  # the default dispatch, unrestricted
    record_property("sdpa_kernels", " ".join(sorted(op for op in ops if op in FUSED_OPS)))
    assert MATH_OP not in ops and ops & set(FUSED_OPS), ops


@pytest.mark.parametrize("name", list(GPU_TINY))
def test_compiled_forward_and_backward_without_graph_breaks(name):
    torch._dynamo.reset()
    model = _model(name).to(DEVICE).train()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, dynamic=False)  # a graph break raises
    x = torch.randn(4, 3, 64, 64, device=DEVICE)
    eager_logits, eager_grads = _forward_backward(model, x, torch.bfloat16)  # training's precision; one compile
    logits, grads = _forward_backward(compiled, x, torch.bfloat16)
    assert _rel(logits, eager_logits) < 5e-2
    flat, ref = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, eager_grads))
    assert _rel(flat, ref) < 1e-1
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(GPU_TINY))
def test_a_training_step_makes_no_host_synchronisation(name):
    """Forward, loss, backward and an AdamW step (train.py's optimizer) in training mode, fp32 and bf16 autocast,
    under CUDA's sync debug mode: a synchronising call (``.item()``, ``bool(tensor)``, ``nonzero``, a copy to the
    host) raises. The CPU counterpart counts the ops under the profiler (tests/test_host_sync.py)."""
    from timm.optim import create_optimizer_v2
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.2, init="xavier", **GPU_TINY[name])
    model = model.to(DEVICE).train()
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    x, y = torch.randn(4, 3, 64, 64, device=DEVICE), torch.arange(4, device=DEVICE)

    def step(dtype):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for dtype in (torch.float32, torch.bfloat16):
        step(dtype)  # first calls: lazy initialisation, the optimizer's state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(dtype)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def test_the_training_loop_waits_for_the_device_only_at_read_steps(tmp_path, monkeypatch, fresh_accelerate):
    """train.py's loop (in this process) on the GPU, bf16, the EMA, mixup and cutmix, 2 batches accumulated per
    optimizer step, and a NaN loss at step 3 (``on_nonfinite: skip``): every step that is not a read step (log steps,
    every 4th) runs under CUDA's sync debug mode "error", from fetching its batches to the end of its bookkeeping, so a
    host read of a device tensor, a blocking copy or a synchronize there raises (an epoch's first batch is fetched
    with the epoch's set-up, before). The CPU counterpart counts reads and collectives (tests/test_host_sync.py)."""
    import math

    from lipsformer.engine import train as loop
    from lipsformer.config import load_config
    data = make_folder(tmp_path / "data48", train_per_class=(12,) * 4)  # 6 steps of 8 an epoch
    cfg = load_config(_gpu_config(tmp_path, mixed_precision="bf16", ema_decay=0.9, global_batch=8, batch_size=4,
                                  log_every_steps=4, checkpoint_every_steps=100, on_nonfinite="skip",
                                  data_dir=str(data), output_dir=str(tmp_path / "run")))
    read_steps = {4, 8, 12}
    step, after = loop._train_step, loop._after_update

    def train_step(run, meter, images, targets, epoch):
        if run.state.step + 1 not in read_steps:
            torch.cuda.set_sync_debug_mode("error")
        if run.state.step + 1 == 3:
            images = images * math.nan
        return step(run, meter, images, targets, epoch)

    def after_update(run, meter, epoch, bar):
        if run.state.step + 1 in read_steps:
            torch.cuda.set_sync_debug_mode("default")
        after(run, meter, epoch, bar)
        quiet = run.state.batch_in_epoch < len(run.train_loader) and run.state.step + 1 not in read_steps
        torch.cuda.set_sync_debug_mode("error" if quiet else "default")  # from the next step's batches on

    monkeypatch.setattr(loop, "_train_step", train_step)
    monkeypatch.setattr(loop, "_after_update", after_update)
    try:
        summary = loop.train(cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary["step"] == 12 and summary["skipped_steps"] == 1
