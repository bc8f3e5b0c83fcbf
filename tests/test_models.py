"""Both families through timm: registration, timm's model face, ablations, conversion, figures."""
import pytest
import timm
import torch
from timm.optim import create_optimizer_v2

from lipsformer.flops import PAPER, count_flops, count_params
from lipsformer.layers import largest_singular_value
from lipsformer.layers.normalized import NormalizedConv2d, NormalizedLinear
from lipsformer.models import lipsformer_cswin, lipsformer_swin
from lipsformer.weights import CheckpointError

from conftest import ROOT, TINY, family
from helpers import CERTIFIED

MODELS = sorted(PAPER)
CONVERTERS = {"swin": lipsformer_swin, "cswin": lipsformer_cswin}


def tiny(name="lipsformer_swin_t", **kwargs):
    return timm.create_model(name, **dict(TINY[family(name)], **kwargs))


def test_every_paper_model_is_registered():
    assert sorted(timm.list_models("lipsformer_*")) == sorted(MODELS + list(CERTIFIED))  # and the certifiable ones
    assert "lipsformer_swin_t.official_in1k" in timm.list_pretrained("lipsformer_*")


@pytest.mark.parametrize("name", MODELS)
def test_variant_builds_runs_forward_and_backward(name):
    # the variant's own depths and heads, narrow (8 channels per head) and at 64x64
    with torch.device("meta"):
        heads = timm.create_model(name).stages[0].blocks[0].attn
    heads0 = getattr(heads, "num_heads", None) or 2 * heads.branch_heads
    split = dict(split_size=(1, 2, 2, 2)) if family(name) == "cswin" else dict(window_size=2)
    model = timm.create_model(name, img_size=64, embed_dim=8 * heads0, num_classes=7, init="xavier", **split)
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_full_size_parameter_count_within_2_percent_of_paper(name):
    assert count_params(name) / 1e6 == pytest.approx(PAPER[name]["params_m"], rel=0.02)


@pytest.mark.parametrize("name", [n for n in MODELS if PAPER[n]["gflops"]])
def test_full_size_fvcore_gflops_within_3_percent_of_paper(name):
    model = timm.create_model(name, init="xavier")
    assert count_flops(model) / 1e9 == pytest.approx(PAPER[name]["gflops"], rel=0.03)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_fused_and_unfused_attention_count_the_same_flops_and_agree(name):
    fused, unfused = tiny(name), tiny(name, fused_attn=False)
    unfused.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert count_flops(fused, (3, 32, 32)) == count_flops(unfused, (3, 32, 32))
    torch.testing.assert_close(fused.eval()(x), unfused.eval()(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_spectral_init_is_the_default_and_unit_norm(name):
    model = tiny(name)
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert len(layers) > 20
    for m in layers:
        assert largest_singular_value(m.weight) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_spectral_init_equals_the_serial_division_of_the_xavier_draws(name):
    """The norms are computed on worker threads while the next weights are drawn: the model must still be, bit for
    bit, the Xavier model (same seed, same draws) with each weight divided by its norm in turn."""
    torch.manual_seed(0)
    spectral = tiny(name)
    torch.manual_seed(0)
    serial = tiny(name, init="xavier")
    with torch.no_grad():
        for m in serial.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                w = m.raw_weight if isinstance(m, (NormalizedLinear, NormalizedConv2d)) else m.weight
                w.div_(largest_singular_value(w, certified=False))
    for (key, a), b in zip(spectral.state_dict().items(), serial.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name, alpha", [("lipsformer_swin_t", 1 / 5), ("lipsformer_cswin_t", 0.2)])
def test_residual_weights_start_at_the_released_value(name, alpha):
    model = tiny(name)  # TINY depths sum to 5
    alphas = [p for n, p in model.named_parameters() if n.endswith(".alpha")]
    assert len(alphas) == 5 * 4  # conv res1, res2, attention, mlp per block
    for a in alphas:
        torch.testing.assert_close(a.detach(), torch.full_like(a, alpha))


# -- timm's face ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_features_only_gives_four_nchw_stage_maps(name):
    model = tiny(name, features_only=True)
    maps = model(torch.randn(2, 3, 32, 32))
    assert [tuple(m.shape) for m in maps] == [(2, 16, 8, 8), (2, 32, 4, 4), (2, 64, 2, 2), (2, 128, 1, 1)]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    assert [m.shape[1] for m in maps] == model.feature_info.channels()


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_forward_pieces_agree_with_forward(name):
    model = tiny(name, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, 1, 1, 128)
    torch.testing.assert_close(model.forward_head(feats), model(x))
    assert model.forward_head(feats, pre_logits=True).shape == (2, 128)
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, feats)
    assert [i.shape[1] for i in inter] == [16, 32, 64, 128]
    assert len(model.forward_intermediates(x, indices=2, intermediates_only=True)) == 2
    model.reset_classifier(3)
    assert model(x).shape == (2, 3) and model.get_classifier().out_features == 3
    model.reset_classifier(0)
    assert model(x).shape == (2, 128)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_grad_checkpointing_gives_same_output_and_gradients(name):
    model = tiny(name, drop_path_rate=0.0)
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing()
    assert all(s.grad_checkpointing for s in model.stages)
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_optimizer_skips_weight_decay_on_norms_biases_alphas_and_position_tables():
    model = tiny("lipsformer_swin_t", learn_tau=True)
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert any("relative_position_bias_table" in n for n in no_decay)
    assert any(n.endswith(".tau") for n in no_decay)
    assert all(n.endswith(".weight") and "norm" not in n for n in decay)
    assert {n for n in no_decay if n.endswith(".alpha")}


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_group_matcher_assigns_every_parameter(name):
    from timm.models import group_parameters
    model = tiny(name)
    groups = group_parameters(model, model.group_matcher())
    assert sum(len(g) for g in groups.values()) == len(list(model.parameters()))
    assert len(groups) > 5


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_wrong_input_size_names_the_built_size(name):
    model = tiny(name)
    with pytest.raises(ValueError, match=r"\(32, 32\)"):
        model(torch.randn(1, 3, 64, 64))


def test_swin_builds_for_384_with_window_12():
    model = timm.create_model("lipsformer_swin_t", img_size=384, window_size=12, embed_dim=24, depths=(1, 1, 1, 1),
                              init="xavier")
    assert [b.attn.window for b in (s.blocks[0] for s in model.stages)] == [(12, 12)] * 4
    assert model(torch.randn(1, 3, 384, 384)).shape == (1, 1000)


def test_swin_window_that_does_not_divide_a_stage_is_an_error():
    with pytest.raises(ValueError, match=r"stage 0 resolution \(56, 56\) is not divisible by window size 12"):
        timm.create_model("lipsformer_swin_t", window_size=12, init="xavier")


def test_cswin_split_that_does_not_divide_a_stage_is_an_error():
    with pytest.raises(ValueError, match=r"stage 2 resolution \(14, 14\) is not divisible by split size 4"):
        timm.create_model("lipsformer_cswin_t", split_size=(1, 2, 4, 7), init="xavier")


def test_odd_stage_resolution_is_an_error():
    with pytest.raises(ValueError, match="odd resolution"):
        timm.create_model("lipsformer_cswin_t", img_size=40, split_size=(1, 1, 1, 1), init="xavier")


# -- Table 3 ablations ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
@pytest.mark.parametrize("option", [
    dict(norm="layer"), dict(norm="none"), dict(attn="dot"), dict(attn="l2"), dict(attn="l2", tied_qk=True),
    dict(init="xavier"), dict(init="trunc_normal"), dict(conv_blocks="A"), dict(conv_blocks="B"),
    dict(conv_blocks="C"), dict(alpha_init=1.0), dict(learn_tau=True, v_norm=True, nu=0.5),
])
def test_table3_ablation_switches_build_and_train(name, option):
    model = tiny(name, **option)
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_standard_transformer_counterpart_has_layernorm_dot_attention():
    model = tiny("lipsformer_swin_t", norm="layer", attn="dot", init="trunc_normal", alpha_init=1.0)
    assert isinstance(model.stages[0].blocks[0].norm1, torch.nn.LayerNorm)
    assert model.stages[0].blocks[0].attn.kernel.kind == "dot"


# -- released-layout conversion -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
@pytest.mark.parametrize("conv_blocks", ["A", "C", "D"])
def test_conversion_round_trips_to_identical_outputs(name, conv_blocks):
    convert = CONVERTERS[family(name)]
    source = tiny(name, conv_blocks=conv_blocks, drop_path_rate=0.0).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # make alphas, norms and biases non-trivial
    released = convert.released_state_dict(source)
    assert not any(k.startswith("stages.") for k in released)
    target = tiny(name, conv_blocks=conv_blocks, drop_path_rate=0.0).eval()
    target.load_state_dict(convert.checkpoint_filter_fn({"model": released}, target), strict=True)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(source(x), target(x))


def test_released_swin_layout_names():
    released = lipsformer_swin.released_state_dict(tiny("lipsformer_swin_t"))
    for key in ["patch_embed.proj.weight", "layers.0.blocks.0.dwconv_layers.1.weight", "layers.0.blocks.0.nin.weight",
                "layers.0.blocks.0.scale_layers.0.scale", "layers.0.blocks.0.alpha1.scale",
                "layers.0.blocks.0.attn.relative_position_index", "layers.0.downsample.reduction.weight",
                "layers.2.blocks.1.mlp.fc2.bias", "norm.weight", "head.weight"]:
        assert key in released, key
    assert "layers.3.downsample.norm.weight" not in released


def test_released_cswin_layout_names():
    released = lipsformer_cswin.released_state_dict(tiny("lipsformer_cswin_t"))
    for key in ["stage1_conv_embed.0.weight", "stage1_conv_embed.2.bias", "stage1.0.attns.0.get_v.weight",
                "stage1.0.attns.1.get_v.weight", "stage4.0.attns.0.get_v.weight", "stage3.1.qkv.weight",
                "stage3.1.proj.bias", "stage3.1.norm1.weight", "merge1.conv.weight", "merge3.norm.bias",
                "head.weight"]:
        assert key in released, key
    assert "stage4.0.attns.1.get_v.weight" not in released


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_pretrained_file_in_released_layout_loads_through_timm(tmp_path, name):
    source = tiny(name).eval()
    path = tmp_path / "released.pth"
    torch.save({"model": CONVERTERS[family(name)].released_state_dict(source), "epoch": 299}, path)
    loaded = tiny(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(source(x), loaded(x))


def test_learnable_tau_model_loads_released_weights_at_released_tau(tmp_path):
    source = tiny("lipsformer_swin_t").eval()
    path = tmp_path / "released.pth"
    torch.save(lipsformer_swin.released_state_dict(source), path)
    loaded = tiny("lipsformer_swin_t", learn_tau=True, pretrained=True,
                  pretrained_cfg_overlay=dict(file=str(path))).eval()
    assert all(b.attn.kernel.tau.item() == 10.0 for s in loaded.stages for b in s.blocks)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(source(x), loaded(x))


def test_checkpoint_for_another_configuration_is_refused(tmp_path):
    path = tmp_path / "released.pth"
    torch.save(lipsformer_swin.released_state_dict(tiny("lipsformer_swin_t")), path)
    with pytest.raises(CheckpointError, match=r"released\.pth does not fit .*unexpected keys \(15\): .*dw2"):
        tiny("lipsformer_swin_t", conv_blocks="C", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


# docs/weights.md: every registered model but the certifiable ones traces as one graph and exports; the other sizes of
# a family build the same modules at these tiny sizes, so they are checked in the slow run
ONE_GRAPH = [n for n in timm.list_models("lipsformer*") if not n.endswith("_cert")]


def test_the_docs_say_which_models_trace_as_one_graph():
    text = " ".join((ROOT / "docs" / "weights.md").read_text().split())
    assert "Every registered model of both families but the certifiable `*_cert` ones traces as one graph" in text
    assert sorted(set(timm.list_models("lipsformer*")) - set(ONE_GRAPH)) == sorted(CERTIFIED)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("lipsformer_swin_t", "lipsformer_cswin_t")
                                               else pytest.mark.slow) for n in ONE_GRAPH])
def test_models_trace_in_one_graph_and_export_with_equal_outputs(name):
    """torch.compile sees each registered model (at tiny sizes) as a single graph (no breaks), and torch.export gives
    the same logits. A family's other sizes build the same modules as its _t here: one graph in eval mode is their
    check."""
    model = tiny(name).eval()
    x = torch.randn(2, 3, 32, 32)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_break_count, explained.graph_count) == (0, 1)
    if name not in ("lipsformer_swin_t", "lipsformer_cswin_t"):
        return
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        assert torch.allclose(exported.module()(x), model(x), atol=1e-6)
    # training mode too: DropPath and the GELUs (plain ops under the compiler) trace without breaks
    explained = torch._dynamo.explain(tiny(name, drop_path_rate=0.1).train())(x)
    assert (explained.graph_break_count, explained.graph_count) == (0, 1)


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_the_certifiable_models_do_not_export(name):
    """What docs/weights.md says of the ``*_cert`` models: the AttLip solve's stopping test is read on the host, a
    data-dependent guard torch.export refuses. (Their graph breaks under torch.compile are too slow to trace for
    the suite.)"""
    from torch._dynamo.exc import UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    with pytest.raises((GuardOnDataDependentSymNode, UserError)):
        torch.export.export(tiny(name).eval(), (torch.randn(2, 3, 32, 32),))


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_onnx_export_runs_in_onnxruntime_with_equal_logits(name, dynamo, tmp_path):
    """timm's own ONNX exporter (TorchScript or torch.export based); onnxruntime gives the model's logits."""
    ort = pytest.importorskip("onnxruntime")
    from timm.utils.onnx import onnx_export
    model = tiny(name).eval()
    path = tmp_path / "model.onnx"
    onnx_export(model, str(path), input_size=(3, 32, 32), batch_size=2, use_dynamo=dynamo, check=True)
    x = torch.randn(2, 3, 32, 32)
    (logits,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input0": x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(x), rtol=1e-4, atol=1e-5)


# -- one typed home for the Lipschitz choices, one route to a model ---------------------------------------------
# A value other than the released Swin's for every LipschitzOptions field (the attlip_* fields act under
# attn="attlip" only, tied_qk under attn="l2": they are given with it).
OPTION_VALUES = dict(norm="layer", attn="l2", tau=5.0, learn_tau=True, v_norm=True, nu=0.5, tied_qk=True,
                     alpha_init=0.3, init="trunc_normal", conv_blocks="B", fused_attn=False, attlip_eta=0.5,
                     attlip_steps=(1, 3), attlip_tol=1e-3, residual="convex", act="groupsort", linear="normalized",
                     attlip_prox=True, stage_act="groupsort", alpha_range=(0.1, 0.9), attlip_reflect=True, mlp="cpl",
                     attlip_form="orthogonal")
WITH = dict({k: dict(attn="attlip") for k in ("attlip_eta", "attlip_steps", "attlip_tol", "attlip_prox",
                                              "attlip_reflect", "attlip_form")},
            tied_qk=dict(attn="l2"), alpha_range=dict(residual="convex"))


def built_alike(a, b) -> bool:
    """The same resolved choices, state dict and outputs (eval mode, one input)."""
    x = torch.randn(2, 3, 32, 32)
    sa, sb = a.state_dict(), b.state_dict()
    with torch.no_grad():
        same_out = torch.equal(a.eval()(x), b.eval()(x))
    return (a.lipschitz == b.lipschitz and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
            and same_out)


def both_routes(name, options: dict, **kwargs):
    """``name`` built with ``lipschitz=LipschitzOptions(**options)`` and with the same choices as keywords (the same
    seed for each), plus ``kwargs`` on both."""
    from lipsformer.layers import LipschitzOptions
    torch.manual_seed(0)
    by_object = tiny(name, lipschitz=LipschitzOptions(**options), **kwargs)
    torch.manual_seed(0)
    return by_object, tiny(name, **options, **kwargs)


def test_every_option_field_has_a_case():
    import dataclasses
    from lipsformer.layers import LipschitzOptions
    from lipsformer.layers.options import RELEASED
    assert set(OPTION_VALUES) == {f.name for f in dataclasses.fields(LipschitzOptions)} == set(RELEASED)
    assert all(OPTION_VALUES[k] != RELEASED[k] for k in OPTION_VALUES)


@pytest.mark.parametrize("field", sorted(OPTION_VALUES))
@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_an_option_given_as_an_object_or_as_a_keyword_builds_the_same_model(name, field):
    """``lipschitz=LipschitzOptions(field=v)`` and ``field=v`` build the same choices, state dict and
    outputs, with the family's defaults for every field not given (CSwin: tau 12, alpha 0.2, not the released
    Swin's tau 10 and alpha 1/sum(depths))."""
    options = dict(init="xavier", **WITH.get(field, {}))  # xavier: no SVDs where the init is not the point
    options[field] = OPTION_VALUES[field]
    by_object, by_keywords = both_routes(name, options)
    assert getattr(by_object.lipschitz, field) == OPTION_VALUES[field]
    assert built_alike(by_object, by_keywords)
    if family(name) == "cswin":
        defaults = dict(tau=12.0, alpha_init=0.2)
        expected = {k: options.get(k, v) for k, v in defaults.items()}
        assert {k: getattr(by_object.lipschitz, k) for k in defaults} == expected


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_a_certifiable_preset_is_under_the_callers_object_and_keywords(name):
    """``*_cert(lipschitz=LipschitzOptions(...))`` takes the object's fields over the preset, as keywords do (the
    preset does not replace the object's fields); fields the object leaves out keep the preset's."""
    from lipsformer.layers.options import CERTIFIABLE
    options = dict(act="gelu", alpha_init=0.3, attlip_steps=(1, 3), init="xavier")
    by_object, by_keywords = both_routes(name, options)
    assert by_object.lipschitz.act == "gelu" and by_object.lipschitz.attlip_steps == (1, 3)
    assert by_object.lipschitz.attn == CERTIFIABLE["attn"] and by_object.lipschitz.residual == CERTIFIABLE["residual"]
    assert built_alike(by_object, by_keywords)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_keywords_replace_an_options_object_which_replaces_the_family_defaults(name):
    from lipsformer.layers import LipschitzOptions
    torch.manual_seed(0)
    both = tiny(name, lipschitz=LipschitzOptions(tau=5.0, alpha_init=0.3, conv_blocks="C"), tau=7.0, v_norm=True)
    torch.manual_seed(0)
    assert built_alike(both, tiny(name, tau=7.0, alpha_init=0.3, conv_blocks="C", v_norm=True))
    assert (both.lipschitz.tau, both.lipschitz.alpha_init, both.lipschitz.v_norm) == (7.0, 0.3, True)
    expected = (12.0, 0.2) if family(name) == "cswin" else (10.0, None)
    assert (tiny(name).lipschitz.tau, tiny(name).lipschitz.alpha_init) == expected
    assert (tiny(name, lipschitz=LipschitzOptions()).lipschitz.tau,) == expected[:1]
    with pytest.raises(TypeError, match="unexpected keyword argument 'v_nrom'"):
        tiny(name, v_nrom=True)
    with pytest.raises(TypeError, match="lipschitz must be a LipschitzOptions, got dict"):
        tiny(name, lipschitz=dict(tau=5.0))


def test_an_options_object_carries_only_what_its_maker_chose():
    """A field left out is UNSET (the family decides it), also after dataclasses.replace; a built model's
    ``lipschitz`` has every field set."""
    import dataclasses
    from lipsformer.layers import LipschitzOptions
    from lipsformer.layers.options import UNSET
    options = LipschitzOptions(attn="l2", tied_qk=True)
    assert repr(options) == "LipschitzOptions(attn='l2', tied_qk=True)" and options.tau is UNSET
    assert dataclasses.replace(options, tau=3.0).chosen() == dict(attn="l2", tau=3.0, tied_qk=True)
    assert UNSET not in tiny("lipsformer_cswin_t", lipschitz=options).lipschitz.chosen().values()
    with pytest.raises(ValueError, match="attn must be one of"):
        LipschitzOptions(attn="softmax")


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_loading_weights_skips_the_spectral_init_and_still_gives_the_file(tmp_path, monkeypatch, name):
    """pretrained=True and lipsformer.build.build_model with a source do not pay for a spectral init the load
    overwrites: only the classifier (the layer a load with another class count re-creates) is normalised, and the
    logits are the file's."""
    from lipsformer.layers import init as init_module
    from lipsformer.build import build_model
    source = tiny(name).eval()
    path = tmp_path / "released.pth"
    torch.save(CONVERTERS[family(name)].released_state_dict(source), path)
    shapes = []

    def counting(weight, *args, **kwargs):
        shapes.append(tuple(weight.shape))
        return largest_singular_value(weight, *args, **kwargs)

    monkeypatch.setattr(init_module, "largest_singular_value", counting)
    loaded = tiny(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    assert shapes == [tuple(loaded.head.fc.weight.shape)]
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(source(x), loaded(x))
    shapes.clear()
    refit = tiny(name, num_classes=3, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert shapes == [(3, refit.num_features)]  # the new head starts spectrally normalised
    assert largest_singular_value(refit.head.fc.weight) == pytest.approx(1.0, abs=1e-5)
    shapes.clear()
    again = build_model(name, path, **TINY[family(name)]).model.eval()
    assert shapes == [tuple(again.head.fc.weight.shape)] and torch.equal(source(x), again(x))
    shapes.clear()
    tiny(name)
    assert len(shapes) > 20  # a plain build still normalises every layer
