"""The Lipschitz toolkit: every certified bound is at least what is measured, exact where the module is linear."""
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from lipsformer.layers import AttentionKernel, CenterNorm
from lipsformer.layers.residual import WeightedResidual
from lipsformer.lipschitz import (conv_bound, conv_operator_norm, gelu_bound, jacobian_norm, lipschitz_report,
                                  matrix_norm, maximize_jacobian_norm)
from lipsformer.lipschitz.layer_bounds import (attention_heads_bound, mlp_bound, norm_bound, residual_bound,
                                               window_attention_bound)
from lipsformer.models.lipsformer_swin import WindowAttention

from conftest import TINY, family


def dense(f, shape):
    """The matrix of a linear map on inputs of ``shape``, column by column."""
    n = math.prod(shape)
    return torch.stack([f(torch.eye(n, dtype=torch.double)[i].view(shape)).flatten() for i in range(n)], 1)


def test_linear_bound_is_the_exact_norm_and_power_iteration_finds_it():
    lin = nn.Linear(24, 40)
    exact = float(torch.linalg.matrix_norm(lin.weight.detach().double(), 2))
    assert matrix_norm(lin.weight) == pytest.approx(exact, rel=1e-12)
    x = torch.randn(24)
    assert jacobian_norm(lin, x, iters=200) == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("spec, hw", [
    (dict(in_channels=3, out_channels=4, kernel_size=3, padding=1), (5, 6)),
    (dict(in_channels=6, out_channels=6, kernel_size=7, padding=3, groups=6), (7, 7)),  # depth-wise (conv blocks, LePE)
    (dict(in_channels=3, out_channels=8, kernel_size=4, stride=4), (8, 8)),  # patch embedding
    (dict(in_channels=4, out_channels=8, kernel_size=2, stride=2), (4, 6)),  # CSwin downsampling
])
def test_conv_operator_norm_matches_a_dense_svd_and_the_bound_covers_it(spec, hw):
    conv = nn.Conv2d(**spec)
    conv = conv.double()
    matrix = dense(lambda x: F.conv2d(x.unsqueeze(0), conv.weight, stride=conv.stride, padding=conv.padding,
                                      groups=conv.groups), (conv.in_channels, *hw))
    exact = float(torch.linalg.matrix_norm(matrix.detach(), 2))
    assert conv_operator_norm(conv, hw, iters=3000) == pytest.approx(exact, rel=1e-5)
    bound = conv_bound(conv, hw)
    assert bound >= exact * (1 - 1e-9)
    if conv.stride == conv.kernel_size:  # non-overlapping patches: exact
        assert bound == pytest.approx(exact, rel=1e-9)


def test_centernorm_bound_is_exact_for_constant_gamma_and_covers_random_gamma():
    norm = CenterNorm(8).double()
    with torch.no_grad():
        norm.weight.fill_(1.5)
    x = torch.randn(8, dtype=torch.double)
    assert jacobian_norm(norm, x, iters=100) == pytest.approx(norm_bound(norm), rel=1e-9)
    assert norm_bound(norm) == pytest.approx(8 / 7 * 1.5)
    with torch.no_grad():
        norm.weight.normal_()
    assert jacobian_norm(norm, x, iters=200) <= norm_bound(norm) * (1 + 1e-9)
    assert norm_bound(nn.LayerNorm(8)) == math.inf


def test_gelu_bound_is_its_largest_slope():
    slope = jacobian_norm(F.gelu, torch.full((1,), math.sqrt(2.0), dtype=torch.double), iters=3)
    assert gelu_bound() == pytest.approx(slope, rel=1e-12) == pytest.approx(1.1289, abs=1e-4)
    xs = torch.linspace(-6, 6, 10001, dtype=torch.double, requires_grad=True)
    (grad,) = torch.autograd.grad(F.gelu(xs).sum(), xs)
    assert float(grad.abs().max()) <= gelu_bound()


def test_mlp_and_weighted_residual_bounds_cover_the_measured_jacobian():
    mlp = Mlp(8, 32).double()
    res = WeightedResidual(8, 0.3).double()
    f = lambda x: res(x, mlp(x))  # noqa: E731
    bound = residual_bound(res, mlp_bound(mlp))
    x = torch.randn(5, 8, dtype=torch.double)
    measured = maximize_jacobian_norm(f, x, steps=30)["lower_bound"]
    assert 1.0 <= measured <= bound


def scsa_layer(n_side=2, heads=2, dim=8, **kernel):
    kernel = AttentionKernel("scsa", tau=10.0, v_norm=True, fused=False, eps=1e-2, **kernel)
    return WindowAttention(dim, heads, (n_side, n_side), kernel).double().eval()


def test_scsa_bound_covers_maximised_jacobian():
    attn = scsa_layer()
    bound, note = window_attention_bound(attn)
    assert "Thm 1, N=4" in note
    x = torch.randn(1, 2, 2, 8, dtype=torch.double)
    measured = maximize_jacobian_norm(attn, x, steps=40)["lower_bound"]
    assert 0 < measured <= bound


def test_scsa_infinity_norm_bound_covers_the_jacobians_row_sums():
    from lipsformer.lipschitz.layer_bounds import scsa_bound
    kernel = AttentionKernel("scsa", tau=10.0, v_norm=True, fused=False, eps=1e-2)
    w_q, w_k, w_v = (torch.randn(4, 4, dtype=torch.double) for _ in range(3))

    def head(x):  # one SCSA head on 3 tokens
        return kernel(*(t.unsqueeze(0).unsqueeze(0) for t in (x @ w_q.T, x @ w_k.T, x @ w_v.T)))[0, 0]

    bound = scsa_bound(w_q, w_k, w_v, 3, 10.0, 1.0, 1e-2, norm="inf")
    for seed in range(5):
        x = torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(seed))
        jac = torch.autograd.functional.jacobian(head, x).reshape(12, 12)
        assert float(jac.abs().sum(1).max()) <= bound


@pytest.mark.parametrize("kind, kwargs, message", [
    ("dot", {}, "not Lipschitz"),
    ("l2", {}, "untied L2 attention is not Lipschitz"),
    ("scsa", {}, "unnormalised v"),
])
def test_attention_without_a_proven_bound_reports_infinity(kind, kwargs, message):
    kernel = AttentionKernel(kind, **kwargs)
    bound, note = attention_heads_bound(kernel, torch.randn(8 * kernel.num_proj, 8), 2, 4)
    assert bound == math.inf and message in note


def test_dot_product_attention_jacobian_grows_without_limit():
    """Kim et al. Theorem 3.1: no fixed number bounds the measured Jacobian norm of dot-product attention."""
    torch.manual_seed(0)
    attn = WindowAttention(4, 1, (2, 2), AttentionKernel("dot", fused=False), qkv_bias=False).double().eval()

    def pin_first_token(x):  # the proof's construction: one token at 0, the others free
        x = x.clone()
        x[0, 0, 0] = 0
        return x

    x = pin_first_token(torch.randn(1, 2, 2, 4, dtype=torch.double))
    start = jacobian_norm(attn, x)
    result = maximize_jacobian_norm(attn, x, steps=100, lr=0.3, project=pin_first_token)
    assert result["lower_bound"] > 500 > 500 * start
    tail = result["history"][-20:]
    assert all(b > a for a, b in zip(tail, tail[1:]))  # still climbing: no plateau in sight


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_network_bound_is_the_product_and_covers_the_measured_network(name):
    model = timm.create_model(name, **TINY[family(name)], v_norm=True, fused_attn=False).double().eval()
    report = lipschitz_report(model, (3, 32, 32))
    with pytest.raises(ValueError, match=r"built for, \(3, 32, 32\); build it with img_size=\(64, 64\)"):
        lipschitz_report(model, (3, 64, 64))
    assert report.bound == pytest.approx(math.prod(r.lip for r in report.rows))
    assert report.log10_bound == pytest.approx(math.log10(report.bound))
    assert math.isfinite(report.bound)
    assert report.rows[0].name == "patch_embed.proj" and report.rows[-1].name == "head.fc"
    x = torch.randn(3, 32, 32, dtype=torch.double)
    measured = jacobian_norm(lambda v: model(v.unsqueeze(0)).squeeze(0), x, iters=20)
    assert 0 < measured <= report.bound
    assert report.dominant().name.endswith("res_attn")


def test_released_defaults_have_no_finite_bound_and_say_why():
    model = timm.create_model("lipsformer_swin_t", **TINY["swin"])
    report = lipschitz_report(model)
    assert report.bound == math.inf and report.log10_bound == math.inf
    assert "unnormalised v" in report.dominant().note


def test_droppath_expectation_follows_eq21_and_timm_rescaling():
    """Eq. 21 without rescaling shrinks the bound; timm's DropPath divides kept branches by 1-p, which
    restores the evaluation bound in expectation."""
    model = timm.create_model("lipsformer_swin_t", **TINY["swin"], v_norm=True, drop_path_rate=0.5)
    report = lipschitz_report(model)
    assert report.train_expected_bound == pytest.approx(report.bound, rel=1e-9)
    for row in report.rows:
        row.scale_by_keep = False
    expected = math.prod(1 + (1 - r.drop_path) * r.alpha * r.branch if r.branch is not None else r.lip
                         for r in report.rows)
    assert report.train_expected_bound == pytest.approx(expected, rel=1e-9) and expected < report.bound


def test_command_prints_table_writes_json_and_plot_and_measures(tmp_path, capsys):
    from lipsformer.lipschitz.__main__ import main
    args = ["--model", "lipsformer_cswin_t", "--model-args", json.dumps(dict(TINY["cswin"], v_norm=True))]
    out = tmp_path / "bounds.json"
    assert main([*args, "--json", str(out), "--plot", str(tmp_path / "bounds.png"),
                 "--measure", "network", "stages.2.blocks.0"]) == 0
    printed = capsys.readouterr().out
    assert "network bound (eq. 19, eval)" in printed and "measured Jacobian norm of network" in printed
    result = json.loads(out.read_text())
    assert set(result["measured"]) == {"network", "stages.2.blocks.0"}
    assert 0 < result["measured"]["network"] and math.log10(result["measured"]["network"]) <= result["log10_bound"]
    assert [s for s in result["log10_stages"]][:2] == ["patch_embed", "stages.0"]
    assert (tmp_path / "bounds.png").stat().st_size > 0
    assert main([*args, "--measure", "stages.9"]) == 2
    assert "--measure" in capsys.readouterr().err


def test_scsa_with_unnormalised_v_grows_with_input_scale_and_normalised_v_does_not():
    """Why the released SCSA (v unnormalised) gets no finite bound: with one token at 0 (its normalised key
    has slope eps^-1/2 there), the Jacobian grows with the other tokens' scale; normalising v (Thm 1) stops it."""
    x = torch.randn(1, 2, 2, 4, dtype=torch.double, generator=torch.Generator().manual_seed(1))
    x[0, 0, 0] = 0
    for v_norm in (False, True):
        kernel = AttentionKernel("scsa", fused=False, eps=1e-2, v_norm=v_norm)
        attn = WindowAttention(4, 1, (2, 2), kernel, qkv_bias=False).double().eval()
        norms = [jacobian_norm(attn, x * c) for c in (1, 10, 100, 1000)]
        if v_norm:
            assert max(norms) <= window_attention_bound(attn)[0]
            assert norms[-1] < 2 * norms[0]
        else:
            assert all(b > 9 * a for a, b in zip(norms, norms[1:]))


def test_keep_bound_projects_to_the_target_with_the_smallest_uniform_alpha_shrink():
    from lipsformer.lipschitz.constraints import BoundUnreachable, keep_bound
    model = timm.create_model("lipsformer_swin_t", **TINY["swin"], v_norm=True)
    with torch.no_grad():
        model.stages[0].blocks[0].norm2.weight.mul_(3.0)  # gamma beyond gamma_max
    before = lipschitz_report(model).bound
    target = before ** 0.5
    info = keep_bound(model, target)
    after = lipschitz_report(model).bound
    assert info["bound_before"] < before and 0 < info["alpha_scale"] < 1  # the gamma clip already lowered it
    assert target * 0.999 <= after <= target  # shrunk no more than needed
    assert float(model.stages[0].blocks[0].norm2.weight.detach().abs().max()) <= 1.0
    assert keep_bound(model, target)["alpha_scale"] == 1.0  # already inside: untouched
    with torch.no_grad():
        model.stages[2].blocks[0].mlp.fc1.weight.mul_(5.0)
    keep_bound(model, target, weight_max=1.0)
    assert all(matrix_norm(m.weight) <= 1.0 + 1e-6 for m in model.modules() if isinstance(m, nn.Linear))
    with pytest.raises(BoundUnreachable, match="unnormalised v"):
        keep_bound(timm.create_model("lipsformer_swin_t", **TINY["swin"]), 1e6)


def test_training_with_a_bound_target_keeps_and_logs_the_bound(tmp_path, capsys):
    from helpers import TRAIN, call, read_metrics, write_config
    kwargs = dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], window_size=2, v_norm=True)
    config = write_config(tmp_path, epochs=2, model_kwargs=kwargs, ema_decay=None, lr=1e-2)
    code, _, err = call(capsys, TRAIN.main, ["--config", config, "--lipschitz-target", "1e20"])
    assert code == 0, err[-3000:]
    epochs = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "epoch"]
    assert len(epochs) == 2 and all(0 < r["lipschitz_bound"] <= 1e20 for r in epochs)
    from safetensors.torch import load_file
    model = timm.create_model("lipsformer_swin_t", num_classes=4, img_size=32, **kwargs)
    model.load_state_dict(load_file(str(tmp_path / "run" / "last.safetensors")))
    assert lipschitz_report(model).bound <= 1e20
    code, _, err = call(capsys, TRAIN.main, ["--config", write_config(tmp_path / "b", epochs=1),
                                             "--lipschitz-target", "10"])
    # the released Swin's SCSA (unnormalised v) has no finite bound: refused before the run folder is written
    assert code == 2 and "lipschitz_target: stages.0.blocks.0.res_attn has no finite Lipschitz bound" in err
    assert not (tmp_path / "b" / "run").exists()


def test_kim_l2_attention_stays_under_theorem_3_2():
    from lipsformer.layers.attention import KimL2Attention
    from lipsformer.lipschitz.layer_bounds import kim_l2_bound, lambert_phi_inverse
    y = lambert_phi_inverse(15.0)
    assert y * math.exp(y + 1) == pytest.approx(15.0, rel=1e-12)
    attn = KimL2Attention(16, heads=2, fused=False).double()
    explicit = KimL2Attention(16, heads=2, fused=True).double()
    explicit.load_state_dict(attn.state_dict())
    x = torch.randn(1, 8, 16, dtype=torch.double)
    assert torch.allclose(attn(x), explicit(x), atol=1e-10)
    heads = []  # the paper's formula, literally: P^h X A_h W^{V,h}, concatenated, times W^O
    for h in range(2):
        w_q = attn.q.weight[h * 8:(h + 1) * 8].T  # W^{Q,h}: (D, D/H)
        w_v = attn.v.weight[h * 8:(h + 1) * 8].T
        q = x[0] @ w_q
        p = (-torch.cdist(q, q).pow(2) / math.sqrt(8)).softmax(-1)
        heads.append(p @ x[0] @ (w_q @ w_q.T / math.sqrt(8)) @ w_v)
    assert torch.allclose(attn(x)[0], torch.cat(heads, -1) @ attn.proj.weight.T, atol=1e-10)
    measured = maximize_jacobian_norm(attn, x, steps=40)["lower_bound"]
    assert 0 < measured <= kim_l2_bound(attn, 8)
    assert kim_l2_bound(attn, 64) > kim_l2_bound(attn, 8)  # the bound grows with N


@pytest.mark.parametrize("name, attn, finite", [
    ("lipsformer_cswin_t", dict(attn="l2", tied_qk=True), True),  # Kim's form, no position bias
    ("lipsformer_swin_t", dict(attn="l2", tied_qk=True), False),  # Swin's relative position bias is outside Thm 3.2
    ("lipsformer_swin_t", dict(attn="attlip"), True),
    ("lipsformer_cswin_t", dict(attn="attlip"), True),
])
def test_attention_variants_in_both_families_get_their_bounds(name, attn, finite):
    model = timm.create_model(name, **TINY[family(name)], **attn).double().eval()
    report = lipschitz_report(model)
    assert math.isfinite(report.log10_bound) == finite
    row = next(r for r in report.rows if r.name.endswith("res_attn"))
    if attn["attn"] == "attlip":
        assert row.branch == 1.0 and "AttLip" in row.note
    x1, x2 = (torch.randn(4, 3, 32, 32, dtype=torch.double) for _ in range(2))
    with torch.no_grad():
        ratio = (model(x1) - model(x2)).norm(dim=1) / (x1 - x2).flatten(1).norm(dim=1)
    assert float(ratio.max()) <= report.bound


def test_deep_bounds_are_kept_in_log10_rather_than_overflowing():
    from lipsformer.lipschitz import LipschitzReport, Row
    report = LipschitzReport([Row(f"stages.0.blocks.{i}.res_attn", 1e100, 1e100, 1.0) for i in range(5)])
    assert report.log10_bound == pytest.approx(500.0) and report.bound == math.inf
    assert report.stages() == [("stages.0", pytest.approx(500.0))]


def test_unknown_mixer_downsampler_or_attention_kind_has_no_bound_and_says_which(monkeypatch):
    """Bounds by type: a module the registry does not know is refused by name, even when it carries the attributes
    of a known one; a registered bound is used once registered."""
    from lipsformer.lipschitz import NoBoundError, register_bound, register_kernel_bound
    from lipsformer.lipschitz import registry as bounds

    class NewMixer(nn.Module):
        window = (2, 2)  # what an attribute probe would take for Swin windows

        def forward(self, x):
            return x

    class NewDown(nn.Module):
        reduction = nn.Linear(4, 4)  # what an attribute probe would take for patch merging

    class SubclassedAttention(WindowAttention):  # may compute something else: not assumed to be bounded alike
        pass

    def model():
        return timm.create_model("lipsformer_swin_t", **TINY["swin"], v_norm=True)

    m = model()
    m.stages[0].blocks[0].attn = NewMixer()
    with pytest.raises(NoBoundError, match=r"module 'stages.0.blocks.0.attn' of type .*NewMixer"):
        lipschitz_report(m)
    m = model()
    m.stages[1].downsample = NewDown()
    with pytest.raises(NoBoundError, match=r"'stages.1.downsample' of type .*NewDown"):
        lipschitz_report(m)
    m = model()
    old = m.stages[0].blocks[0].attn
    m.stages[0].blocks[0].attn = SubclassedAttention(16, 1, (2, 2), old.kernel)
    with pytest.raises(NoBoundError, match="SubclassedAttention"):
        lipschitz_report(m)
    m = model()
    m.stages[2].blocks[1].attn.kernel.kind = "contractive"
    with pytest.raises(NoBoundError, match="attention kind 'contractive'"):
        lipschitz_report(m)

    # registering is one decorator, in one table; registering a type twice is refused
    monkeypatch.setattr(bounds, "BOUNDS", dict(bounds.BOUNDS))
    monkeypatch.setattr(bounds, "KERNEL_BOUNDS", dict(bounds.KERNEL_BOUNDS))
    register_bound(NewMixer)(lambda mixer, hw: bounds.Bound(1.0, "identity mixer"))
    register_kernel_bound("contractive")(lambda kernel, w, n, bias: bounds.Bound(0.5, "contractive"))
    with pytest.raises(ValueError, match="already registered"):
        register_bound(NewMixer)(lambda mixer, hw: 2.0)
    m.stages[0].blocks[0].attn = NewMixer()
    rows = {r.name: r for r in lipschitz_report(m).rows}
    new, contractive = rows["stages.0.blocks.0.res_attn"], rows["stages.2.blocks.1.res_attn"]
    assert new.branch == 1.0 and new.note == "identity mixer" and contractive.note == "contractive"
    assert contractive.branch == pytest.approx(0.5 * matrix_norm(m.stages[2].blocks[1].attn.proj.weight))


def test_max_pooled_head_is_bounded_as_max_pooling_not_as_a_mean():
    """The head's pool is bounded by its type: a mean over N tokens has 1/sqrt(N), a max 1 (a mean's 1/sqrt(N)
    would undercut a max-pooled model, checked here against two inputs that differ in one token)."""
    kw = dict(TINY["swin"], img_size=64, v_norm=True)
    pooled = {p: {r.name: r.lip for r in lipschitz_report(timm.create_model("lipsformer_swin_t", global_pool=p,
                                                                            **kw)).rows} for p in ("avg", "max")}
    assert pooled["avg"]["head.global_pool"] == pytest.approx(0.5) and pooled["max"]["head.global_pool"] == 1.0
    pool = timm.create_model("lipsformer_swin_t", global_pool="max", **kw).head.global_pool
    x = torch.zeros(1, 2, 2, 8)
    y = x.clone()
    y[0, 0, 0] = 1.0
    assert float((pool(x) - pool(y)).norm()) == pytest.approx(float((x - y).norm()))  # the ratio is 1, not 1/2


def test_command_names_a_module_without_a_bound_in_one_line(monkeypatch, capsys):
    from lipsformer.lipschitz import registry as bounds
    from lipsformer.lipschitz.__main__ import main
    monkeypatch.setattr(bounds, "BOUNDS", {k: v for k, v in bounds.BOUNDS.items() if k is not CenterNorm})
    assert main(["--model", "lipsformer_swin_t", "--model-args", json.dumps(dict(TINY["swin"], v_norm=True))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Lipschitz bound is registered for module 'patch_embed.norm' of type")
    assert "CenterNorm" in err and err.strip().count("\n") == 0


def test_command_json_is_strict_and_plot_marks_layers_without_a_finite_bound(tmp_path, capsys):
    # the released defaults (no finite SCSA bound) wrote Infinity tokens that strict JSON parsers
    # reject, and the plot dropped those layers without a word
    from lipsformer.lipschitz.__main__ import main

    def strict(token):
        raise ValueError(f"not JSON: {token}")
    assert main(["--model", "lipsformer_swin_t", "--model-args", json.dumps(TINY["swin"]),
                 "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]) == 0
    result = json.loads((tmp_path / "b.json").read_text(), parse_constant=strict)
    assert result["log10_bound"] is None
    unbounded = [r["name"] for r in result["rows"] if r["lip"] is None]
    assert unbounded and all(r["note"] for r in result["rows"] if r["lip"] is None)
    printed = capsys.readouterr().out
    assert f"plot: {len(unbounded)} of {len(result['rows'])} layers have no finite bound (red, marked inf): " \
           f"{unbounded[0]}" in printed


@pytest.mark.parametrize("args, message", [
    (["--model-args", "[1]"], "--model-args must be a JSON object of model arguments"),  # not a TypeError traceback
    (["--json", f"{__file__}/b.json"],  # found before the bounds
     f"python -m lipsformer.lipschitz: argument --json: {__file__}/b.json: {__file__} is a file, not a folder"),
    (["--plot", f"{__file__}/b.png"],
     f"python -m lipsformer.lipschitz: argument --plot: {__file__}/b.png: {__file__} is a file, not a folder"),
    (["--plot", "b.pngx"], "python -m lipsformer.lipschitz: argument --plot: b.pngx: cannot draw a .pngx figure"),
])
def test_command_refuses_unusable_arguments_before_any_work_in_one_line(capsys, args, message):
    from lipsformer.lipschitz.__main__ import main
    assert main(["--model", "lipsformer_swin_t", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}" + err[len(f"error: {message}"):] and err.count("\n") == 1, err
