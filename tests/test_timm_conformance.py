"""What timm's own model tests check, on our tiny models, so conformance cannot regress:
the declared output_fmt matches forward_features, and torch.fx symbolic tracing (timm's FX feature extraction
and quantisation tools use it) runs forward and backward like the module."""
import pytest
import timm
import torch
from timm.layers import get_channel_dim, get_spatial_dim
from timm.models._features_fx import create_feature_extractor, get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor as tv_create_feature_extractor
from torchvision.models.feature_extraction import get_graph_node_names

from conftest import TINY, family

NAMES = ["lipsformer_swin_t", "lipsformer_cswin_t"]
# The certifiable models add GroupSort, AttLip, convex residuals and normalised linear maps (GroupSort's shape check
# must not stop timm's FX tests on them): traced with one block a stage and few AttLip steps (tracing, not the
# solve, is the point).
CERT = ["lipsformer_swin_t_cert", "lipsformer_cswin_t_cert"]
CHEAP = dict(depths=(1, 1, 1, 1), attlip_steps=(1, 3), init="xavier")


def tiny(name, **kwargs):
    sizes = dict(TINY[family(name)], **(CHEAP if name in CERT else {}))
    return timm.create_model(name, **dict(sizes, **kwargs))


@pytest.mark.parametrize("name", NAMES)
def test_declared_output_fmt_matches_forward_features(name):
    """timm's test_model_default_cfgs: forward_features is unpooled in the declared layout, and so is forward
    once the classifier and pooling are removed."""
    model = tiny(name).eval()
    assert model.output_fmt == "NHWC"
    spatial, channel = get_spatial_dim(model.output_fmt), get_channel_dim(model.output_fmt)
    x = torch.randn(1, 3, 32, 32)
    features = model.forward_features(x)
    assert [features.shape[a] for a in spatial] == [1, 1] and features.shape[channel] == model.num_features
    x = torch.randn(1, 3, 64, 32)
    wide = tiny(name, img_size=(64, 32), num_classes=0, global_pool="").eval()
    out = wide(x)
    assert out.ndim == 4 and [out.shape[a] for a in spatial] == [2, 1] and out.shape[channel] == wide.num_features
    assert model.forward_head(features, pre_logits=True).shape == (1, model.head_hidden_size)


def fx_model(model, train: bool):
    """timm's _create_fx_model: the graph's last node, traced with timm's registered leaves and wrapped functions."""
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    return tv_create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]],
                        tracer_kwargs=tracer_kwargs).train(train)


@pytest.mark.filterwarnings("ignore:NOTE. The nodes obtained by tracing")
@pytest.mark.parametrize("name", NAMES + CERT)
def test_fx_symbolic_trace_forward_equals_the_module_and_backward_reaches_every_parameter(name):
    model = tiny(name).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(tuple(fx_model(model, train=False)(x).values())[0], model(x))
    model = tiny(name, num_classes=42).train()  # drop path on: its random mask is traced too
    traced = fx_model(model, train=True)
    out = tuple(traced(torch.randn(2, 3, 32, 32)).values())[0]
    out.mean().backward()
    assert out.shape == (2, 42)
    assert all(p.grad is not None for p in traced.parameters())
    assert sum(p.numel() for p in traced.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.filterwarnings("ignore:NOTE. The nodes obtained by tracing")
@pytest.mark.parametrize("name", NAMES + CERT)
def test_timm_fx_feature_extraction_gives_the_stage_maps(name):
    model = tiny(name).eval()
    extractor = create_feature_extractor(model, return_nodes={f"stages.{i}": str(i) for i in range(4)})
    x = torch.randn(1, 3, 32, 32)
    maps = extractor(x)
    expected = model.forward_intermediates(x, output_fmt="NHWC", intermediates_only=True)
    assert all(torch.equal(maps[str(i)], e) for i, e in enumerate(expected))
