"""engine/speed.py and its TrainConfig keys (compile, compile_mode, compile_memory_budget, channels_last,
grad_checkpointing, tf32): each reaches the model or the process, and none changes what a run computes."""
import contextlib
import re

import pytest
import torch
import torch._functorch.config as functorch_config
import yaml
from safetensors.torch import load_file
from conftest import reset_accelerate
from helpers import TINY_RUN, assert_killed_run_resumes_exactly, make_folder, write_config

from lipsformer.config import ConfigError, load_config
from lipsformer.engine.speed import compile_model, prepare_model, set_tf32


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


@contextlib.contextmanager
def compiling(fx_graph_cache: bool, **functorch):
    """Compiles from a clean slate: dynamo reset before and after, inductor's FX graph cache on or off and the given
    functorch settings (AOTAutograd's cache), and afterwards the process-wide deterministic flag that compile_model
    sets for CPU models given back."""
    was = torch.are_deterministic_algorithms_enabled()
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=fx_graph_cache), functorch_config.patch(**functorch):
            yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch._dynamo.reset()


@pytest.fixture
def cold_compile():
    """Compiles with nothing cached to stand in (inductor's and AOTAutograd's caches off)."""
    with compiling(fx_graph_cache=False, enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("override, message", [
    ("compile_mode=fast", "compile_mode must be one of"),
    ("compile_memory_budget=0", "compile_memory_budget must be in (0, 1]"),
    ("compile_memory_budget=1.5", "compile_memory_budget must be in (0, 1]"),
    ("compile=3", "compile must be of type bool"),
])
def test_speed_keys_reject_bad_values_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_compile_model_compiles_in_place_and_sets_the_partitioner_budget():
    model = torch.nn.Linear(3, 2)
    names = [n for n, _ in model.named_parameters()]
    before = functorch_config.activation_memory_budget
    try:
        with pytest.raises(ValueError, match="compile_memory_budget"):
            compile_model(model, memory_budget=0.0)
        with pytest.raises(ValueError, match="compile_mode"):
            compile_model(model, mode="fast")
        assert compile_model(model, memory_budget=0.4) is model
        assert functorch_config.activation_memory_budget == 0.4
    finally:
        functorch_config.activation_memory_budget = before
    torch._dynamo.utils.counters.clear()
    x = torch.randn(4, 3)
    assert torch.allclose(model(x), torch.nn.functional.linear(x, model.weight, model.bias), atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # it ran compiled
    assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod. prefix: checkpoints unchanged
    torch._dynamo.reset()


def test_grad_checkpointing_channels_last_and_tf32_reach_the_run(tmp_path, monkeypatch):
    import lipsformer.engine.train as loop
    built = []
    start = loop.build_model

    def recording_start(*args, **kwargs):
        model, how = start(*args, **kwargs)
        built.append(model)
        return model, how

    monkeypatch.setattr(loop, "build_model", recording_start)
    config = write_config(tmp_path, epochs=1, ema_decay=None)
    runs = {"plain": [], "checkpointed": ["grad_checkpointing=true"], "nhwc": ["channels_last=true", "tf32=true"]}
    tf32 = {}
    try:
        for name, extra in runs.items():
            loop.train(load_config(config, ["epochs=1", f"output_dir={tmp_path / name}", *extra]))
            reset_accelerate()
            tf32[name] = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    finally:
        set_tf32(False)
    plain, checkpointed, nhwc = built
    assert tf32 == {"plain": (False, False), "checkpointed": (False, False), "nhwc": (True, True)}
    assert [s.grad_checkpointing for s in checkpointed.stages] == [True] * 4
    assert not any(s.grad_checkpointing for s in plain.stages)
    convs = [p for p in nhwc.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert not nhwc.patch_embed.proj.weight.is_contiguous()  # (1x1 and depth-wise kernels are both layouts)
    assert all(p.is_contiguous() for p in plain.parameters())
    # recomputing the forward pass in backward (same DropPath draws) gives the same weights, bit for bit
    a, b = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("plain", "checkpointed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_channels_last_model_gives_the_same_outputs():
    import timm
    from conftest import TINY
    model = timm.create_model("lipsformer_swin_t", **TINY["swin"]).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        got = prepare_model(model, channels_last=True)(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_compiled_cpu_backward_has_no_racing_scatter_add(cold_compile):
    """The backward of the relative-position-bias gather is a scatter-add. Inductor's default CPU code for it is
    a parallel loop of atomic adds, whose float sum depends on thread timing (a resumed compiled run would end with
    other bias tables than the uninterrupted one); compile_model compiles CPU models in deterministic mode, which
    lowers it to ATen's index_put_."""
    from torch._inductor.utils import run_and_get_code
    from lipsformer.models.lipsformer_swin import WindowAttention
    from lipsformer.layers.attention import AttentionKernel

    class Bias(torch.nn.Module):  # the gather at Swin-T's window, without the cost of compiling a whole model
        def __init__(self):
            super().__init__()
            self.attn = WindowAttention(96, 3, (7, 7), AttentionKernel("scsa"))

        def forward(self, scale):
            return self.attn.position_bias() * scale

    model = compile_model(Bias())
    assert torch.are_deterministic_algorithms_enabled()
    _, code = run_and_get_code(lambda: model(torch.randn(1, 3, 49, 49)).sum().backward())
    assert len(code) >= 2  # forward and backward were generated
    assert not any("atomic_add" in c for c in code)
    assert model.attn.relative_position_bias_table.grad.abs().sum() > 0


def test_compile_memory_budget_reaches_the_partitioner(cold_compile):
    """compile_memory_budget is read when the graph is compiled, at the first call after compile_model: at 0.5 a
    compiled LipsFormer MLP (its fused GELU included) keeps less for backward than at the compiler's default (what a
    budget does to a whole model's compiled training memory: docs/speed.md, beside its command). Caches off, so a
    cached graph of the other budget cannot stand in. An MLP rather than a block: compiling each kernel is the
    test's cost on a fresh machine."""
    import timm
    from conftest import TINY

    torch.manual_seed(0)
    model = timm.create_model("lipsformer_swin_t", num_classes=5, **TINY["swin"]).train()
    x = model.patch_embed(torch.randn(8, 3, 32, 32)).detach().requires_grad_()

    def saved_bytes(budget) -> int:
        torch._dynamo.reset()
        mlp = compile_model(model.stages[0].blocks[0].mlp, memory_budget=budget)
        total = 0

        def pack(t):
            nonlocal total
            if not isinstance(t, torch.nn.Parameter):
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mlp(x)
        y.square().mean().backward()
        return total

    with functorch_config.patch(activation_memory_budget=1.0):
        default, half = saved_bytes(None), saved_bytes(0.5)
    assert 0 < half < 0.7 * default


def test_compiled_cpu_training_computes_depthwise_weight_gradients_by_the_compiled_sums(monkeypatch, cold_compile):
    """Under torch.compile a float32 CPU training step takes the depth-wise weight gradients from
    conv_blocks._dw_weight_grad (fused loops instead of oneDNN's slow depth-wise weight gradient, docs/speed.md).
    Doubled here, the compiled gradients of both depth-wise weights come out twice the eager ones and
    every other gradient equal: the path is taken, and the compiled sums are right. And the (B, H, W, C) activations
    the compiled graph keeps for backward stay row-major: inductor's layout optimisation, which compile_model turns
    off on the CPU, would store them with H innermost."""
    from lipsformer.layers import ConvBlocks, conv_blocks

    real = conv_blocks._dw_weight_grad
    monkeypatch.setattr(conv_blocks, "_dw_weight_grad", lambda x, grad, k: 2 * real(x, grad, k))
    torch.manual_seed(0)
    eager = ConvBlocks(8, "D").train()
    compiled = ConvBlocks(8, "D").train()
    compiled.load_state_dict(eager.state_dict())
    x, g = torch.randn(2, 9, 11, 8), torch.randn(2, 9, 11, 8)
    eager(x).backward(g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = compile_model(compiled)(x)
    y.backward(g)
    activations = [t for t in saved if t.shape == x.shape]
    assert activations and all(t.is_contiguous() for t in activations), [t.stride() for t in activations]
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        factor = 2 if name in ("dw1.weight", "dw2.weight") else 1
        torch.testing.assert_close(q.grad, factor * p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_compiling_the_same_training_graph_again_loads_it_from_aotautograds_cache(tmp_path, monkeypatch):
    """A resumed run compiles its training graph again. With LipsFormer's autograd Functions in it, torch's default
    bypasses AOTAutograd's cache and traces the graph anew; compile_model lets the cache take it (the Functions are
    traced whole, so the key covers their code). Inductor's and AOTAutograd's caches on, in the test's own folder."""
    from torch._dynamo.utils import counters

    from lipsformer.layers import ConvBlocks

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(2, 9, 11, 8)
    with compiling(fx_graph_cache=True, enable_autograd_cache=True,
                   autograd_cache_allow_custom_autograd_functions=False):
        for _ in range(2):  # a second process in effect: nothing compiled is kept but the cache folder
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            compile_model(ConvBlocks(8, "D").train())(x).sum().backward()
        assert dict(counters["aot_autograd"]).get("autograd_cache_hit") == 1, dict(counters["aot_autograd"])


@pytest.mark.slow
def test_killed_compiled_run_resumes_to_bit_identical_weights(tmp_path):
    """train.py with compile: true, killed mid-epoch 2 and resumed in a new process (which compiles again, from
    inductor's cache), ends with the uninterrupted run's weights and EMA, bit for bit. One stage of one block: what
    costs here is compiling each kernel, the first time on a fresh machine."""
    data = make_folder(tmp_path / "data", val_per_class=(2, 2, 2, 2))  # one val batch shape: one eval graph
    cfg = dict(TINY_RUN, data_dir=str(data), epochs=2, checkpoint_every_steps=1, compile=True,
               model_kwargs=dict(TINY_RUN["model_kwargs"], depths=[1], num_heads=[1]))
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert_killed_run_resumes_exactly(config, tmp_path, total_steps=12, timeout=600)
    assert yaml.safe_load((tmp_path / "reference" / "config.yaml").read_text())["compile"] is True


def test_eval_channels_last_scores_like_the_default(tmp_path):
    import timm
    from conftest import TINY
    from helpers import NUM_CLASSES, write_image

    from lipsformer.engine.evaluate import evaluate_model
    from lipsformer.sources import export
    export(timm.create_model("lipsformer_swin_t", num_classes=NUM_CLASSES, **TINY["swin"]), tmp_path / "weights")
    for c in range(4):
        write_image(tmp_path / "v2" / str(c) / "a.png", c)
    runs = {}
    for channels_last in (False, True):
        runs[channels_last] = evaluate_model(None, tmp_path / "v2", "imagenet_v2", checkpoint=tmp_path / "weights",
                                             batch_size=2, workers=0, channels_last=channels_last)[0]
        reset_accelerate()
    assert (runs[False]["channels_last"], runs[True]["channels_last"]) == (False, True)
    assert torch.equal(runs[True]["classes"], runs[False]["classes"])
    assert torch.allclose(runs[True]["probs"], runs[False]["probs"], atol=1e-5)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_compiled_by_region_a_training_step_has_no_graph_break_and_a_graph_per_stage(name):
    """compile_model compiles each block in place: a training step (DropPath on, rates differing from block to
    block) traces one graph per stage shape, the first block, which does not drop, sharing its stage's with factors
    of one, and breaks no graph; the stem, downsampling and head stay eager. Dynamo alone (backend eager): the
    graphs, not inductor's code."""
    import timm
    from torch._dynamo.utils import counters

    from conftest import TINY, family
    from lipsformer.layers import LipsBlock
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.3, **{**TINY[family(name)], "depths": (2, 1, 2, 1)})
    model.train()
    with compiling(fx_graph_cache=False):
        counters.clear()
        compile_model(model, backend="eager")
        regions = [m for m in model.modules() if getattr(m, "compiled_body", None) is not None]
        assert regions == [m for m in model.modules() if isinstance(m, LipsBlock)] and model._compiled_call_impl is None
        for _ in range(2):
            model(torch.randn(2, 3, 32, 32)).square().mean().backward()
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 4  # stages 1 (the first block's DropPath factors 1), 2, 3, 4
        first = next(m for m in model.modules() if isinstance(m, LipsBlock))
        assert not first.drops() and first.compiled_unit_draws
