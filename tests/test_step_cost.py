"""benchmarks/step_cost.py: what a step moves, counted on the meta device against timm's Swin (deterministic), and the
targets docs/speed.md states for it."""
import json

import pytest
import timm
import torch
from conftest import load_script

import lipsformer  # noqa: F401  (registers the models)

BASELINE = "swin_tiny_patch4_window7_224"


@pytest.fixture(scope="module")
def tool():
    return load_script("benchmarks/step_cost.py")


@pytest.fixture(scope="module")
def rows(tool, tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    assert tool.main(["--json", str(out)]) == 0
    return {(r["model"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}


def test_swin_t_moves_at_most_1_3x_the_ops_and_1_2x_the_bytes_of_swin_tiny(rows):
    """A training step and an inference batch of lipsformer_swin_t against swin_tiny's, fp32, 224 px."""
    for mode in ("train", "infer"):
        r = rows["lipsformer_swin_t", mode]
        assert r["ops_ratio"] <= 1.3 and r["bytes_ratio"] <= 1.2, r


def test_cswin_t_moves_at_most_1_6x_the_ops_and_1_3x_the_bytes_of_swin_tiny(rows):
    """A training step and an inference batch of lipsformer_cswin_t against swin_tiny's, fp32, 224 px."""
    for mode in ("train", "infer"):
        r = rows["lipsformer_cswin_t", mode]
        assert r["ops_ratio"] <= 1.6 and r["bytes_ratio"] <= 1.3, r


def test_counts_are_the_same_on_every_run_and_a_training_step_reads_nothing_to_the_host(tool, rows):
    with torch.device("meta"):
        model = timm.create_model("lipsformer_swin_t")
    cost = tool.measure(model, 224, True)
    r = rows["lipsformer_swin_t", "train"]
    assert cost.ops == r["ops"] and round(cost.bytes_per_image(256) / 1e6, 1) == r["mb_per_image"]
    assert cost.host_reads == 0
    assert rows[BASELINE, "train"]["ops_ratio"] == 1.0
    assert rows[BASELINE, "train"]["gflops_per_image"] == pytest.approx(3 * rows[BASELINE, "infer"]["gflops_per_image"],
                                                                        rel=0.01)  # backward: twice the forward


def test_the_estimate_is_the_slowest_of_launch_bytes_and_flops_per_op(tool):
    gpu = tool.GPU("card", bandwidth=1e12, matmul=1e14, launch=1e-5, peak_bandwidth=2e12, peak_matmul=2e14)
    cost = tool.Cost(ops=3, host_reads=0, per_op=[
        ("tiny", False, 100, 0, 0, 0),  # launch-bound
        ("copy", False, 0, 1e8, 0, 0),  # 1e8 bytes per image
        ("mm", True, 0, 0, 0, 1e10)])  # 1e10 FLOPs per image
    est = cost.estimate(gpu, 4)
    assert est["bound_s"] == pytest.approx(dict(launch=1e-5, bytes=4e8 / 1e12, flops=4e10 / 1e14))
    assert est["seconds"] == pytest.approx(sum(est["bound_s"].values())) and est["img_s"] == pytest.approx(4 / est[
        "seconds"])
    assert cost.bytes_per_image(4) == pytest.approx((100 + 4e8) / 4) and cost.flops_per_image(2) == 1e10


def test_fused_attention_and_fused_ops_count_as_the_kernels_cuda_launches(tool):
    """SDPA with a mask that needs a gradient: one op forward, one backward and the mask gradient's reduction; a
    fused op with a second launch (its partial sums) counts two."""
    q = torch.empty(8, 3, 49, 32, device="meta", requires_grad=True)
    bias = torch.empty(1, 3, 49, 49, device="meta", requires_grad=True)
    tally = tool.Tally()
    counting = tool.Counting(tally)
    with tool.FusedAttention(counting), counting:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias).sum().backward()
    names = [o.name for o in tally.ops]
    assert names.count("attention") == 1 and names.count("attention_backward") == 1
    assert "attention_mask_grad_sum" in names and not any("_scaled_dot_product" in n for n in names)
    from lipsformer.layers.fused import residual_center_norm
    x = torch.empty(2, 7, 7, 16, device="meta", requires_grad=True)
    w, b = torch.ones(16, device="meta", requires_grad=True), torch.zeros(16, device="meta", requires_grad=True)
    tally = tool.Tally()
    with tool.Counting(tally):
        residual_center_norm(x, x, None, 1.0, w, b, 16 / 15).sum().backward()
    names = [o.name for o in tally.ops]
    assert names.count("lipsformer.residual_center_norm") == 1
    assert names.count("lipsformer.residual_center_norm_backward") == 1
    assert names.count("lipsformer.residual_center_norm_backward.sum") == 1


@pytest.mark.parametrize("name, per_block", [("lipsformer_swin_t", 2), ("lipsformer_cswin_t", 1)])
def test_a_block_adds_its_last_maps_biases_inside_the_centernorm_op(tool, name, per_block, monkeypatch):
    """Before a CenterNorm (both of Swin's residuals, CSwin's MLP; CSwin has none after its attention) a branch's
    last bias is added by the residual-CenterNorm op, whose backward sums its gradient with CenterNorm's own: a
    training step launches one op fewer for each such residual than with the bias in the map."""
    from lipsformer.layers import LipsBlock, block
    with torch.device("meta"):
        model = timm.create_model(name, drop_path_rate=0.1)
    blocks = sum(isinstance(m, LipsBlock) for m in model.modules())
    split = tool.measure(model, 224, True).ops
    monkeypatch.setattr(block, "split_bias", lambda branch, scale, x: (scale, None))
    assert tool.measure(model, 224, True).ops - split == per_block * blocks


def test_a_training_step_of_the_conv_blocks_launches_one_op_for_each_pass(tool):
    """The released conv blocks (``D``) in a training step: each depth-wise convolution with its GELU or residual one
    op forward, the 1x1 convolution one matmul, whose bias the residual's op adds and whose bias gradient the
    residual's backward sums with alpha's (no reduction of its own); backward the fused ops and the matmuls."""
    from lipsformer.layers.conv_blocks import ConvBlocks
    with torch.device("meta"):
        blocks = ConvBlocks(32, "D").train()
        x, grad = torch.empty(2, 7, 7, 32, requires_grad=True), torch.empty(2, 7, 7, 32)
    tally = tool.Tally()
    with tool.Counting(tally):
        blocks(x).backward(grad)
    assert [o.name for o in tally.ops] == [
        "lipsformer.depthwise_conv", "aten.mm", "lipsformer.gelu_residual", "lipsformer.depthwise_conv",
        "lipsformer.conv_residual_backward", *["lipsformer.conv_residual_backward.sum"] * 2,
        "lipsformer.gelu_residual_backward", "lipsformer.gelu_residual_backward.sum",
        "aten.mm", "lipsformer.gelu_and_grad", "aten.mm",
        "lipsformer.depthwise_conv_backward", "lipsformer.depthwise_conv_backward.sum"]


def test_host_cost_times_the_fused_ops_cuda_route_and_splits_a_step_as_counted(rows, monkeypatch):
    """benchmarks/host_cost.py: its fused op runs through the stub kernels (the CUDA route a GPU's host issues),
    called directly and then through the dispatcher, and the real kernels are back afterwards; a step's aten ops and
    fused launches add up to step_cost's ops."""
    from lipsformer.layers import fused, fused_op
    from lipsformer.layers.fused import use_fused_ops
    host = load_script("benchmarks/host_cost.py")
    dispatched = []
    for op in (fused._rcn, fused._rcn_backward):
        monkeypatch.setattr(op, "op", lambda *a, op=op.op: dispatched.append(op) or op(*a))
    kernels, calls, direct = fused._kernels, host.StubKernels.calls, fused_op.dispatched
    cost = host.per_call(chain=2, reps=1, number=1)
    # each route: warm-up and timed step, forward and backward, 2 links; the second route's through the dispatcher
    assert host.StubKernels.calls - calls == 2 * 2 * 2 * 2 and len(dispatched) == 2 * 2 * 2
    assert fused._kernels is kernels and fused_op.dispatched is direct
    assert cost["fused_call"] > 0 and cost["dispatched_call"] > 0 and cost["aten_op"] > 0
    with use_fused_ops(False), pytest.raises(RuntimeError, match="did not take its CUDA route"):
        host.per_call(chain=2, reps=1, number=1)  # timing the plain composition instead is refused
    assert host.step_counts(BASELINE) == dict(aten_ops=rows[BASELINE, "train"]["ops"], fused_calls=0, fused_launches=0)
    c = host.step_counts("lipsformer_swin_t")
    assert c["aten_ops"] + c["fused_launches"] == rows["lipsformer_swin_t", "train"]["ops"]
    assert 0 < c["fused_calls"] < c["fused_launches"]
