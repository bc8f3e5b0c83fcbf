"""Resolution and window transfer: bias tables resized as timm resizes them, set_input_size,
strict_img_size=False for inputs of any size."""
import copy
import warnings

import pytest
import timm
import torch
from timm.layers import resize_rel_pos_bias_table

from lipsformer.models import lipsformer_cswin, lipsformer_swin
from lipsformer.build import build_model

from conftest import TINY, family

SWIN, CSWIN = "lipsformer_swin_t", "lipsformer_cswin_t"
CONVERTERS = {"swin": lipsformer_swin, "cswin": lipsformer_cswin}
# another size for each tiny model, with windows / splits that divide it and keep each CSwin stage's attention kind
BIGGER = {"swin": dict(img_size=64, window_size=4), "cswin": dict(img_size=64, split_size=(1, 2, 4, 2))}


def tiny(name, **kwargs):
    return timm.create_model(name, **dict(TINY[family(name)], drop_path_rate=0.0, **kwargs)).eval()


def perturbed(name, **kwargs):
    model = tiny(name, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tables(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith("relative_position_bias_table")}


def test_loaded_bias_tables_equal_timms_resize_and_the_same_window_is_the_identity(tmp_path):
    source = perturbed(SWIN)  # window 2: tables of 3x3 entries (1x1 in the last stage)
    path = tmp_path / "released.pth"
    torch.save({"model": lipsformer_swin.released_state_dict(source)}, path)
    # timm's pretrained path (and lipsformer.build.build_model) into a model built at 64 px with window 4
    target = tiny(SWIN, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **BIGGER["swin"])
    via_weights, _ = build_model(SWIN, path, **dict(TINY["swin"], **BIGGER["swin"]))
    resized = tables(target)
    assert len(resized) == 5 and {v.shape[0] for v in resized.values()} == {49, 9}  # windows 4, 4, 4, 2
    for key, table in tables(source).items():
        attn = target.get_submodule(key.rsplit(".", 1)[0])
        expected = resize_rel_pos_bias_table(table, new_window_size=attn.window, new_bias_shape=resized[key].shape)
        assert torch.equal(resized[key], expected), key
        assert torch.equal(via_weights.state_dict()[key], expected), key
    assert not torch.equal(resized["stages.0.blocks.0.attn.relative_position_bias_table"],
                           torch.zeros_like(resized["stages.0.blocks.0.attn.relative_position_bias_table"]))
    # every other tensor is the file's
    for key, value in source.state_dict().items():
        if not key.endswith("relative_position_bias_table"):
            assert torch.equal(target.state_dict()[key], value), key
    # the same window: the identity, bit-equal logits
    same = tiny(SWIN, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(same(x), source(x))
    unchanged = copy.deepcopy(source)
    unchanged.set_input_size(img_size=32, window_size=2)
    assert torch.equal(unchanged(x), source(x))


@pytest.mark.parametrize("name", [SWIN, CSWIN])
def test_set_input_size_equals_building_at_the_new_size_and_loading_the_weights(name):
    source = perturbed(name)
    moved = copy.deepcopy(source)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed beside the resize (timm's interpolator makes torch warn)
        moved.set_input_size(**BIGGER[family(name)])
    built = tiny(name, **BIGGER[family(name)])
    built.load_state_dict(CONVERTERS[family(name)].checkpoint_filter_fn(source.state_dict(), built))
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(moved(x), built(x))
    assert moved.patch_embed.img_size == (64, 64)
    with pytest.raises(ValueError, match="does not match the size this model was built for, \\(64, 64\\)"):
        moved(torch.randn(1, 3, 32, 32))


def test_set_input_size_refuses_what_does_not_fit_and_leaves_the_model_as_it_was():
    swin = tiny(SWIN)
    with pytest.raises(ValueError, match="not divisible by window size 3"):
        swin.set_input_size(img_size=64, window_size=3)
    assert swin.patch_embed.img_size == (32, 32) and swin.window_size == 2
    assert swin(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    cswin = tiny(CSWIN)
    with pytest.raises(ValueError, match="stage 2 would change from full attention to stripes"):
        cswin.set_input_size(img_size=64)
    assert cswin.patch_embed.img_size == (32, 32)


@pytest.mark.parametrize("name, bad, message", [
    (SWIN, dict(img_size=-32), r"img_size \(-32, -32\) must be positive integers"),
    (SWIN, dict(img_size=0), r"img_size \(0, 0\) must be positive integers"),
    (SWIN, dict(img_size=64, window_size=0), "window_size 0 must be a positive integer"),
    (CSWIN, dict(img_size=-32), r"img_size \(-32, -32\) must be positive integers"),
    (CSWIN, dict(split_size=(0, 2, 2, 2)), "split size 0 of stage 0 must be a positive integer"),
])
def test_set_input_size_validates_before_it_changes_the_model(name, bad, message):
    # a refused call leaves the model exactly as it was (size, windows, weights, outputs)
    model = perturbed(name, init="xavier")
    x = torch.randn(2, 3, 32, 32)
    before, state = model(x), copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        model.set_input_size(**bad)
    assert model.patch_embed.img_size == (32, 32)
    assert getattr(model, "window_size", None) in (None, 2)
    assert getattr(model, "split_size", (1, 2, 2, 2)) == (1, 2, 2, 2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(model(x), before)
    with pytest.raises(ValueError, match=message.split(" ")[0]):
        tiny(name, **bad)  # building with the same sizes is refused too, naming the same argument


def test_cswin_split_error_names_the_sizes_that_divide():
    with pytest.raises(ValueError, match=r"stage 1 resolution \(12, 12\) is not divisible by split size 5; "
                                         r"split sizes that divide it: 1, 2, 3, 4, 6, 12"):
        tiny(CSWIN, img_size=96, split_size=(1, 5, 2, 2))


@pytest.mark.parametrize("name", [SWIN, CSWIN])
def test_timms_dynamic_img_size_is_strict_img_size_false(name):
    """timm's Swin takes ``dynamic_img_size=True`` for "any input size" (its strict_img_size=False): so do both
    families, through timm.create_model, whatever strict_img_size says."""
    for strict in (True, False):
        model = timm.create_model(name, dynamic_img_size=True, strict_img_size=strict, **TINY[family(name)])
        assert model(torch.randn(1, 3, 40, 56)).shape == (1, 1000)
    assert timm.create_model(name, dynamic_img_size=False, **TINY[family(name)]).patch_embed.strict_img_size


@pytest.mark.parametrize("name", [SWIN, CSWIN])
def test_strict_img_size_false_pads_any_size_and_matches_the_strict_model_where_it_divides(name):
    strict = perturbed(name)
    loose = tiny(name, strict_img_size=False)
    loose.load_state_dict(strict.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(loose(x), strict(x))
    assert all(torch.equal(a, b) for a, b in zip(loose.forward_intermediates(x)[1], strict.forward_intermediates(x)[1]))
    odd = torch.randn(1, 3, 230, 230)
    with pytest.raises(ValueError, match="does not match"):
        strict(odd)
    logits = loose(odd)
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all()
    # stage i maps are ceil(230 / (4 * 2^i)) high: 58, 29, 15, 8 (documented in the constructors)
    shapes = [tuple(f.shape[-2:]) for f in loose.forward_intermediates(odd, intermediates_only=True)]
    assert shapes == [(58, 58), (29, 29), (15, 15), (8, 8)]
    features = timm.create_model(name, features_only=True, strict_img_size=False, **TINY[family(name)])
    assert [tuple(f.shape[-2:]) for f in features(torch.randn(1, 3, 230, 97))] == [(58, 25), (29, 13), (15, 7), (8, 4)]
    # cropped back: the logits are those of the features the head sees
    assert torch.equal(logits, loose.forward_head(loose.forward_features(odd)))
