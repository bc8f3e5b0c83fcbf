"""A certifiable LipsFormer: 1-Lipschitz layers, bound keeping, the Lipschitz-margin loss."""
import copy
import math

import pytest
import timm
import torch

from conftest import TINY, config_model, family, reset_accelerate
from lipsformer.layers import ConvexResidual, GroupSort, create_residual


def test_groupsort_is_a_permutation_per_pair():
    x = torch.tensor([[1.0, 3.0, -2.0, -5.0, 0.5, 0.5]])
    assert GroupSort(2)(x).tolist() == [[3.0, 1.0, -2.0, -5.0, 0.5, 0.5]]
    assert GroupSort(3)(x).tolist() == [[3.0, 1.0, -2.0, 0.5, 0.5, -5.0]]
    with pytest.raises(ValueError, match="divisible by group_size 4"):
        GroupSort(4)(x)
    # norm-preserving, hence 1-Lipschitz: no pair of inputs moves further apart
    a, b = torch.randn(2, 1000, 8).unbind(0)
    ga, gb = GroupSort(2)(a), GroupSort(2)(b)
    assert torch.allclose(ga.norm(dim=-1), a.norm(dim=-1))
    assert ((ga - gb).norm(dim=-1) <= (a - b).norm(dim=-1) + 1e-6).all()


def test_maxmin_backward_is_the_forward_permutation_applied_to_the_gradient():
    """GroupSort(2)'s own backward: the gradient autograd gives through maximum / minimum where no pair ties, and at
    a tie the permutation's (the gradient unswapped: norm-preserving, where autograd's halves would lose norm); the
    same values without a graph; a unit vector's gradient keeps its norm."""
    torch.manual_seed(0)
    x = torch.randn(4, 7, 12, dtype=torch.float64)
    x[0, 0, 2] = x[0, 0, 3]  # a tie
    grad = torch.randn_like(x)
    leaf = x.clone().requires_grad_()
    out = GroupSort(2)(leaf)
    assert type(out.grad_fn).__name__ == "_MaxMinBackward"
    out.backward(grad)
    ref = x.clone().requires_grad_()
    a, b = ref.unflatten(-1, (-1, 2)).unbind(-1)
    torch.stack((torch.maximum(a, b), torch.minimum(a, b)), -1).flatten(-2).backward(grad)
    ties = torch.zeros_like(x, dtype=torch.bool)
    ties[0, 0, 2:4] = True
    assert torch.equal(leaf.grad[~ties], ref.grad[~ties])
    assert leaf.grad[0, 0, 2:4].tolist() == grad[0, 0, 2:4].tolist()  # unswapped
    with torch.no_grad():
        assert torch.equal(GroupSort(2)(x), out.detach())
    assert torch.allclose(leaf.grad.norm(dim=-1), grad.norm(dim=-1))
    # the derivatives autograd's own ops allowed still work: double backward, forward mode, batched gradients
    y = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(GroupSort(2), (y,)) and torch.autograd.gradgradcheck(GroupSort(2), (y,))
    with torch.autograd.forward_ad.dual_level():
        tangent = torch.randn_like(y)
        out = torch.autograd.forward_ad.unpack_dual(GroupSort(2)(torch.autograd.forward_ad.make_dual(y, tangent)))
        swapped = (y[:, 0::2] < y[:, 1::2]).unsqueeze(-1)
        pairs = tangent.detach().view(3, 4, 2)
        assert torch.equal(out.tangent, torch.where(swapped, pairs.flip(-1), pairs).view(3, 8))
    jacobian = torch.autograd.functional.jacobian(GroupSort(2), y.detach(), vectorize=True)
    assert torch.equal(jacobian, torch.autograd.functional.jacobian(GroupSort(2), y.detach()))


def test_convex_residual_is_a_convex_combination():
    res = ConvexResidual(4, alpha_init=0.25)
    assert res.alpha.shape == (1,)  # one scalar: per-channel weights would break the bound
    x, fx = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(res(x, fx), 0.75 * x + 0.25 * fx)
    with pytest.raises(ValueError, match=r"0 <= alpha_range\[0\] <= alpha_init <= alpha_range\[1\] <= 1"):
        ConvexResidual(4, alpha_init=1.5)
    with pytest.raises(ValueError, match=r"alpha_init 0.1 and alpha_range \(0.2, 1.0\)"):
        ConvexResidual(4, alpha_init=0.1, alpha_range=(0.2, 1.0))
    with pytest.raises(ValueError, match="the residual 'add' has none"):
        create_residual("add", 4, 0.1, alpha_range=(0.0, 0.0))
    with pytest.raises(ValueError, match="residual must be one of"):
        create_residual("sum", 4, 0.1)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_certifiable_options_build_and_run(name):
    kw = dict(TINY[family(name)], init="xavier")
    model = timm.create_model(name, num_classes=3, residual="convex", act="groupsort", norm="none",
                              alpha_init=0.5, **kw)
    assert model.lipschitz.residual == "convex" and model.lipschitz.act == "groupsort"
    assert all(isinstance(m, ConvexResidual) for n, m in model.named_modules() if n.endswith(("res1", "res2",
                                                                                              "res_attn", "res_mlp")))
    assert any(isinstance(m, GroupSort) for m in model.modules())
    assert not any(isinstance(m, torch.nn.GELU) for m in model.modules())
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_stage_act_opens_every_stage_without_new_weights(name):
    from lipsformer.layers import group_sort
    from lipsformer.lipschitz import lipschitz_report

    kw = dict(TINY[family(name)], init="xavier", residual="convex", norm="none", num_classes=3)
    plain, acted = timm.create_model(name, **kw), timm.create_model(name, stage_act="groupsort", **kw)
    acted.load_state_dict(plain.state_dict())  # strict: the activation has no parameters, the keys are the same
    seen = {}
    for i, stage in enumerate(acted.stages):
        assert isinstance(stage.act, GroupSort)
        stage.downsample.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("down", i), out))
        stage.blocks.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("blocks", i), a[0]))
    x = torch.randn(2, 3, 32, 32)
    assert not torch.allclose(acted(x), plain(x))
    for i in range(len(acted.stages)):  # stage 1: on the patch embedding's output (its downsample is the identity)
        torch.testing.assert_close(seen["blocks", i], group_sort(seen["down", i]), rtol=0, atol=0)
    rows = {r.name: r.lip for r in lipschitz_report(acted).rows}
    assert [rows[f"stages.{i}.act"] for i in range(len(acted.stages))] == [1.0] * len(acted.stages)
    gelu = {r.name: r.lip for r in lipschitz_report(timm.create_model(name, stage_act="gelu", **kw)).rows}
    assert gelu["stages.0.act"] == pytest.approx(1.1289, abs=1e-4)
    with pytest.raises(ValueError, match="stage_act must be one of"):
        timm.create_model(name, stage_act="relu", **kw)


# -- the Lipschitz-margin loss -------------------------------------------------------------------------
def test_margin_loss_lowers_the_true_logit_by_sqrt2_L_eps():
    from timm.loss import SoftTargetCrossEntropy

    from lipsformer.engine.margin import LipschitzMarginLoss, margin_criterion

    logits, target = torch.randn(5, 4), torch.tensor([0, 3, 1, 1, 2])
    ce = torch.nn.CrossEntropyLoss()
    loss = LipschitzMarginLoss(ce, eps=0.25, bound=2.0)
    assert loss.margin == pytest.approx(math.sqrt(2) * 2.0 * 0.25)
    shifted = logits.clone()
    shifted[torch.arange(5), target] -= math.sqrt(2) * 0.5
    assert loss(logits, target) == pytest.approx(float(ce(shifted, target)), rel=1e-6)
    assert loss(logits, target) > ce(logits, target)  # harder: the margin must be earned
    # by hand for one sample: -log softmax of the lowered true logit
    z = logits[0] - math.sqrt(2) * 0.5 * torch.nn.functional.one_hot(target[0], 4)
    assert LipschitzMarginLoss(ce, 0.25, 2.0)(logits[:1], target[:1]) == pytest.approx(
        float(torch.logsumexp(z, 0) - z[0]), rel=1e-6)
    # soft targets (mixup): each logit lowered by the margin times its target weight
    soft = torch.softmax(torch.randn(5, 4), -1)
    st = SoftTargetCrossEntropy()
    assert LipschitzMarginLoss(st, 0.25, 2.0)(logits, soft) == pytest.approx(
        float(st(logits - math.sqrt(2) * 0.5 * soft, soft)), rel=1e-6)
    assert margin_criterion(ce, 0.0, None) is ce  # off
    with pytest.raises(ValueError, match="eps must be a finite number"):
        LipschitzMarginLoss(ce, -1.0)


# -- bound keeping -----------------------------------------------------------------------------------
def dense_operator_norm(conv: torch.nn.Conv2d, hw) -> float:
    """The conv's operator norm on (C, H, W) from its dense matrix (one column per input pixel of a group; groups
    are independent blocks), by the eigenvalues of its Gram matrix: independent of the bound code's DFT and power
    iteration."""
    if conv.stride == conv.kernel_size and conv.padding == (0, 0):
        # non-overlapping patches: the operator is the direct sum of one map per patch, the same norm on 2x2 patches
        hw = (2 * conv.kernel_size[0], 2 * conv.kernel_size[1])
    g = conv.groups
    cin = conv.in_channels // g
    n = cin * hw[0] * hw[1]
    basis = torch.eye(n, dtype=torch.float64).view(n, cin, *hw)
    w = conv.weight.detach().double()
    out = 0.0
    for part in w.chunk(g, 0):
        m = torch.nn.functional.conv2d(basis, part, None, conv.stride, conv.padding, conv.dilation).flatten(1)
        gram = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m
        out = max(out, float(torch.linalg.eigvalsh(gram)[-1]) ** 0.5)
    return out


def certifiable(name, **kw):
    args = dict(TINY[family(name)], init="xavier", residual="convex", act="groupsort", norm="none", attn="attlip",
                alpha_init=0.5, drop_path_rate=0.0, num_classes=4, attlip_steps=(1, 20), stage_act="groupsort")
    return timm.create_model(name, **dict(args, **kw))


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_keep_bound_keeps_convs_linears_and_convex_weights_at_their_limits(name):
    from lipsformer.lipschitz import conv_bound, lipschitz_report
    from lipsformer.lipschitz.constraints import conv_input_sizes, keep_bound

    model = certifiable(name)
    sizes = conv_input_sizes(model)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for step in range(2):  # a large step, then keeping
        torch.nn.functional.cross_entropy(model(x) * 10, y).backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        model.zero_grad()
        with torch.no_grad():  # as after a much larger one: norms past 1, convex weights out of [0, 1] both ways
            for n, p in model.named_parameters():
                if n.endswith("weight") and p.ndim > 1:
                    p.mul_(3.0)
                if n.endswith("alpha"):
                    p.fill_(1.5 if len(n) % 2 else -0.5)
        before = {c: dense_operator_norm(c, hw) for c, hw in sizes.items()}
        assert max(before.values()) > 2.0
        info = keep_bound(model, 1e6, weight_max=1.0, conv_max=1.0)
        for conv, hw in sizes.items():
            dense = dense_operator_norm(conv, hw)
            assert dense <= 1.0 + 1e-5, (conv, dense)
            if before[conv] > 1.0 and conv.stride == conv.kernel_size:
                assert dense == pytest.approx(1.0, abs=1e-5)  # non-overlapping patches: exact bound, kept at 1
            elif before[conv] > 1.0:  # stride 1, zero padding: the certified (circular) bound is kept at 1
                assert conv_bound(conv, hw) == pytest.approx(1.0, abs=1e-6)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                assert torch.linalg.matrix_norm(m.weight.double(), ord=2) <= 1.0 + 1e-5
            if isinstance(m, ConvexResidual):
                assert 0.0 <= float(m.alpha.detach()) <= 1.0
        assert {float(m.alpha.detach()) for m in model.modules() if isinstance(m, ConvexResidual)} == {0.0, 1.0}
        assert info["alpha_scale"] == 1.0 and info["bound"] <= 1.0 + 1e-6
        assert lipschitz_report(model).bound == pytest.approx(info["bound"])


# -- the new modules' registered bounds against measured difference quotients -------------------------
def test_convex_residual_bound_formula_and_tightness():
    from lipsformer.lipschitz.layer_bounds import residual_bound

    res = ConvexResidual(8, alpha_init=0.3)
    assert residual_bound(res, 1.0) == pytest.approx(1.0)  # a convex combination of 1-Lipschitz maps
    assert residual_bound(res, 0.5) == pytest.approx(0.7 + 0.3 * 0.5)
    assert residual_bound(res, 2.0) == pytest.approx(0.7 + 0.6)
    with torch.no_grad():
        res.alpha.fill_(1.4)  # outside [0, 1]: |1 - a| counts
    assert residual_bound(res, 1.0) == pytest.approx(0.4 + 1.4)
    # attained: f = c x gives ((1 - a) + a c) x
    with torch.no_grad():
        res.alpha.fill_(0.3)
    x, d = torch.randn(4, 8), torch.randn(4, 8)
    quotient = (res(x + d, 2.0 * (x + d)) - res(x, 2.0 * x)).norm() / d.norm()
    assert float(quotient) == pytest.approx(residual_bound(res, 2.0), rel=1e-5)


def test_groupsort_and_certifiable_model_bounds_cover_measured_quotients():
    from lipsformer.lipschitz import lipschitz_report, maximize_difference_quotient
    from lipsformer.lipschitz.registry import module_bound
    from lipsformer.lipschitz.constraints import keep_bound

    gs = GroupSort(2)
    assert module_bound(gs).lip == 1.0
    q = maximize_difference_quotient(gs, torch.randn(16), radius=0.1, steps=20)["lower_bound"]
    assert 0.99 < q <= 1.0 + 1e-5  # norm-preserving (float32 rounding): the bound is attained
    model = certifiable("lipsformer_swin_t", attlip_steps=(1, 10)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("weight") and p.ndim > 1:
                p.mul_(3.0)
    keep_bound(model, 1.01, weight_max=1.0, conv_max=1.0)
    bound = lipschitz_report(model).bound
    assert bound <= 1.01
    lower = maximize_difference_quotient(model, torch.rand(1, 3, 32, 32), radius=0.5, steps=5)["lower_bound"]
    assert 0 < lower <= bound


# -- the config keys, through train() -----------------------------------------------------------------
def test_margin_and_conv_keeping_keys_change_training(tmp_path, fresh_accelerate):
    import json

    from safetensors.torch import load_file
    from helpers import make_folder

    from lipsformer.config import ConfigError, load_config
    from lipsformer.engine.train import train
    from lipsformer.lipschitz import conv_bound
    from lipsformer.lipschitz.constraints import conv_input_sizes

    data = make_folder(tmp_path / "data", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    base = ["model=lipsformer_swin_t", "num_classes=4", "img_size=32", "crop_pct=1.0", "drop_path=0.0",
            "model_kwargs={embed_dim: 16, depths: [1, 1], num_heads: [2, 2], window_size: 4, attn: attlip, "
            "attlip_steps: [1, 2], norm: none, residual: convex, act: groupsort, alpha_init: 0.1}",
            f"data_dir={data}", "workers=0", "epochs=1", "global_batch=4", "batch_size=4", "lr=0.05", "aa=null",
            "reprob=0.0", "mixup=0.0", "cutmix=0.0", "label_smoothing=0.0", "ema_decay=null",
            "mixed_precision='no'", "log_every_steps=1", "checkpoint_every_steps=100", "keep_last=1"]

    def run(name, *overrides):
        cfg = load_config(None, base + [f"output_dir={tmp_path / name}", *overrides])
        try:
            train(cfg)
        finally:
            reset_accelerate()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        model = config_model(cfg)
        model.load_state_dict(load_file(str(tmp_path / name / "last.safetensors")))
        return next(r["loss"] for r in rows if r["kind"] == "train"), model

    plain, plain_model = run("plain")
    fixed, _ = run("fixed", "margin_eps=0.5", "margin_bound=2.0")
    followed, kept_model = run("followed", "margin_eps=0.5", "lipschitz_target=1e6", "lipschitz_conv_max=0.5")
    # the first step's loss: same weights, same batch; the margin sqrt(2) L eps lowers the true logit
    assert fixed > plain and followed > plain and followed != pytest.approx(fixed)
    sizes = conv_input_sizes(kept_model)
    assert max(conv_bound(c, hw) for c, hw in sizes.items()) <= 0.5 + 1e-6  # kept after every step
    assert max(conv_bound(c, hw) for c, hw in conv_input_sizes(plain_model).items()) > 0.5
    for bad, match in ((["margin_eps=0.5"], "margin_bound: null follows the bound kept by lipschitz_target"),
                       (["lipschitz_conv_max=1.0"], "lipschitz_conv_max is applied when the bound is kept"),
                       (["margin_eps=-1"], "margin_eps must be a number >= 0"),
                       (["margin_bound=0", "margin_eps=0.1"], "margin_bound must be positive")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, bad)


def test_attlip_train_steps_schedule_sets_the_steps_per_epoch_and_resumes_mid_schedule(tmp_path, monkeypatch,
                                                                                       fresh_accelerate):
    """attlip_train_steps (the AttLip paper's schedule, starting at one step): each epoch's training forwards use
    its phase's step count, evaluation keeps eval_steps, and a run resumed mid-schedule trains as the
    uninterrupted one (bit-identical weights, the normalised layers' power iteration continued from the
    checkpoint); a model without AttLip refuses the key before writing anything."""
    from safetensors.torch import load_file
    from helpers import make_folder

    from lipsformer.config import ConfigError, load_config
    from lipsformer.engine.train import train
    from lipsformer.layers.attlip import AttLip

    used = []
    forward = AttLip.forward
    monkeypatch.setattr(AttLip, "forward", lambda self, x: used.append(
        (self.training, self.train_steps if self.training else self.eval_steps)) or forward(self, x))
    data = make_folder(tmp_path / "data", train_per_class=(2, 2, 2, 2), val_per_class=(1, 1, 1, 1))
    base = ["model=lipsformer_swin_t", "num_classes=4", "img_size=32", "crop_pct=1.0", "drop_path=0.0",
            "model_kwargs={embed_dim: 16, depths: [1, 1], num_heads: [2, 2], window_size: 4, attn: attlip, "
            "attlip_steps: [2, 3], norm: none, residual: convex, act: groupsort, alpha_init: 0.1, init: xavier, "
            "linear: normalized_power}",
            f"data_dir={data}", "workers=0", "epochs=3", "global_batch=4", "batch_size=4", "lr=0.05", "aa=null",
            "reprob=0.0", "mixup=0.0", "cutmix=0.0", "label_smoothing=0.0", "ema_decay=null", "eval_every_epochs=3",
            "mixed_precision='no'", "checkpoint_every_steps=100", "keep_last=5"]

    def run(name, *overrides, resume=None):
        used.clear()
        cfg = load_config(None, base + [f"output_dir={tmp_path / name}", *overrides])
        try:
            train(cfg, resume=resume)
        finally:
            reset_accelerate()
        trained = [s for t, s in used if t]  # 2 batches x 2 AttLip modules per epoch
        per_epoch = [sorted(set(trained[i:i + 4])) for i in range(0, len(trained), 4)]
        return load_file(str(tmp_path / name / "last.safetensors")), per_epoch, sorted({s for t, s in used if not t})

    fixed, fixed_steps, _ = run("fixed")
    scheduled, steps, eval_steps = run("scheduled", "attlip_train_steps=[1, 2, 2]")
    assert fixed_steps[:3] == [[2], [2], [2]] and steps[:3] == [[1], [2], [2]] and eval_steps == [3]
    assert any(not torch.equal(fixed[k], scheduled[k]) for k in fixed)
    # resumed from the end of the first epoch (2 steps per epoch): epochs 2 and 3 take 2 steps, the same weights
    (tmp_path / "scheduled" / "last.safetensors").unlink()
    resumed, steps, _ = run("scheduled", "attlip_train_steps=[1, 2, 2]",
                            resume=str(tmp_path / "scheduled" / "checkpoints" / "step_000000002"))
    assert steps[:2] == [[2], [2]] and all(torch.equal(scheduled[k], resumed[k]) for k in scheduled)
    with pytest.raises(ConfigError, match="attlip_train_steps sets the proximal steps of AttLip attention"):
        run("no_attlip", "attlip_train_steps=[1]", "model_kwargs.attn=scsa")
    assert not (tmp_path / "no_attlip").exists()
    with pytest.raises(ConfigError, match="attlip_train_steps has 3 phases but the run has 2 epochs"):
        load_config(None, ["epochs=2", "attlip_train_steps=[1, 2, 3]"])


def test_bound_kept_every_k_steps_resumes_bit_identical_and_projects_the_weights_each_epoch_saves(tmp_path,
                                                                                                 fresh_accelerate):
    """With lipschitz_every_steps > 1 (the ImageNet certified recipe keeps the bound every 10th step) a run resumed
    from a checkpoint between projections trains as the uninterrupted one: the resume restores the last
    projection's margin L instead of projecting again (which would clamp the weights and move L at a step the
    uninterrupted run did not); each epoch ends projected, so the weights evaluated and saved keep the bound."""
    import json

    from safetensors.torch import load_file
    from helpers import make_folder

    from lipsformer.config import load_config
    from lipsformer.engine.train import train

    data = make_folder(tmp_path / "data", train_per_class=(3, 3, 3, 3), val_per_class=(1, 1, 1, 1))
    base = ["model=lipsformer_swin_t_cert", "num_classes=4", "img_size=32", "crop_pct=1.0",
            "model_kwargs={embed_dim: 16, depths: [1, 1], num_heads: [2, 2], window_size: 4}",
            f"data_dir={data}", "workers=0", "epochs=2", "global_batch=4", "batch_size=4", "lr=0.05", "aa=null",
            "reprob=0.0", "mixup=0.0", "cutmix=0.0", "label_smoothing=0.0", "ema_decay=null", "eval_every_epochs=2",
            "mixed_precision='no'", "checkpoint_every_steps=1", "keep_last=10", "lipschitz_target=1.01",
            "lipschitz_every_steps=4", "margin_eps=0.5"]

    def run(name, resume=None):
        cfg = load_config(None, base + [f"output_dir={tmp_path / name}"])
        try:
            train(cfg, resume=resume)
        finally:
            reset_accelerate()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return load_file(str(tmp_path / name / "last.safetensors")), [r for r in rows if r["kind"] == "epoch"]

    whole, epochs = run("whole")  # 3 steps an epoch: projections at 0, 3 (epoch end), 4, 6 (epoch end)
    alphas = {k: v for k, v in whole.items() if k.endswith(".alpha")}
    assert alphas and all(0.0 <= float(v.min()) and float(v.max()) <= 1.0 for v in alphas.values())
    assert len(epochs) == 2 and all(0 < r["lipschitz_bound"] <= 1.01 for r in epochs)
    for step in (2, 5):  # between projections, before and after an epoch's end
        (tmp_path / "whole" / "last.safetensors").unlink()
        resumed, _ = run("whole", resume=str(tmp_path / "whole" / "checkpoints" / f"step_{step:09d}"))
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), step


def test_benchmark_cnn_baseline_is_1_lipschitz_and_its_certificates_hold():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "paper"))
    from certified import LipschitzCNN, pixel_bound, register_cnn

    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.certify import certified_radius, normalization, pgd_l2

    cnn = LipschitzCNN(num_classes=4, widths=(16, 32, 64))
    with torch.no_grad():
        for conv in cnn.convs:
            conv.lin.raw.mul_(5.0)  # the forward divides by the exact norm whatever the raw weights
    assert cnn.lipschitz_bound() <= 1.0 + 1e-5
    mean, std = normalization(cnn)
    register_cnn()  # its report: one row per layer, the head's matrix for the pairwise rule
    assert pixel_bound(cnn).bound == pytest.approx(cnn.lipschitz_bound() / float(std.min()), rel=1e-12)
    w = cnn.head.weight.detach().double()
    assert torch.allclose(pixel_bound(cnn).gaps, torch.cdist(w, w), rtol=1e-9, atol=1e-12)  # ||w_c - w_j||
    x = torch.rand(6, 3, 32, 32)
    q = maximize_difference_quotient(lambda z: cnn(z[None])[0], x[0], radius=0.5, steps=10)["lower_bound"]
    assert 0 < q <= cnn.lipschitz_bound() + 1e-5
    with torch.no_grad():
        logits = cnn(x)
    labels = logits.argmax(1)
    radius = certified_radius(logits, cnn.lipschitz_bound())
    # an attack at each image's own certified radius changes nothing (the CNN takes pixels: mean 0, std 1 here)
    zero, one = torch.zeros(3, 1, 1), torch.ones(3, 1, 1)
    assert not pgd_l2(cnn, x, labels, radius.float(), zero, one, steps=10, restarts=3).any()
    assert pgd_l2(cnn, x, labels, 3 * radius.float() + 0.5, zero, one, steps=10, restarts=3).any()


# -- spectrally normalised linear maps (linear="normalized") and the prox mixer (attlip_prox) -------------
def test_normalized_linear_divides_by_its_norm_inside_the_graph():
    from lipsformer.layers import NormalizedConv2d, NormalizedLinear, init_weights
    from lipsformer.lipschitz.registry import module_bound

    plain = torch.nn.Linear(12, 5)
    with torch.no_grad():
        plain.weight.mul_(7.0)
    lin = NormalizedLinear.from_linear(plain)
    assert list(lin.state_dict()) == list(plain.state_dict())  # a Linear's keys: checkpoints load either way
    sigma = torch.linalg.matrix_norm(plain.weight.detach().double(), ord=2)
    assert torch.equal(lin.raw_weight, plain.weight)
    assert float(torch.linalg.matrix_norm(lin.weight.detach().double(), ord=2)) == pytest.approx(1.0, abs=1e-6)
    x = torch.randn(3, 12)
    assert torch.allclose(lin(x), torch.nn.functional.linear(x, plain.weight / sigma.float(), plain.bias), atol=1e-6)
    # the gradient sees the division: the map does not depend on the raw weight's scale, so no gradient along it
    lin(x).pow(2).sum().backward()
    assert abs(float((lin.raw_weight.grad * lin.raw_weight.detach()).sum())) < 1e-4 * float(lin.raw_weight.grad.norm())
    assert module_bound(lin).lip == pytest.approx(1.0, abs=1e-6)
    # and it is the exact gradient: autograd back through the Gram matrix's eigendecomposition gives the same
    for layer, inputs in _normalized_pair():
        layer.train()
        w = layer.raw_weight
        layer(inputs).sin().sum().backward()
        ref = w.detach().clone().requires_grad_()
        tall = ref.flatten(1).double().T if w.shape[0] < w.flatten(1).shape[1] else ref.flatten(1).double()
        sigma = torch.linalg.eigvalsh(tall.T @ tall)[-1].sqrt()
        out = (torch.nn.functional.linear(inputs, ref / sigma.float(), layer.bias) if ref.ndim == 2 else
               torch.nn.functional.conv2d(inputs, ref / sigma.float(), layer.bias, stride=2))
        out.sin().sum().backward()
        assert torch.allclose(w.grad, ref.grad, rtol=1e-4, atol=1e-6)
    init_weights(lin, "xavier")  # init writes the parameter, not a temporary
    assert not torch.equal(lin.raw_weight, plain.weight)
    conv = NormalizedConv2d(3, 8, 2, stride=2)
    with torch.no_grad():
        conv.raw_weight.mul_(9.0)
    assert module_bound(conv, (8, 8)).lip == pytest.approx(1.0, abs=1e-6)
    assert dense_operator_norm(conv, (8, 8)) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="stride == kernel"):
        NormalizedConv2d(3, 8, 3, padding=1)


def _normalized_pair():
    from lipsformer.layers import NormalizedConv2d, NormalizedLinear
    return [(NormalizedLinear(12, 5), torch.randn(3, 12)),
            (NormalizedConv2d(3, 6, 2, stride=2), torch.randn(2, 3, 8, 8))]


def _fresh(layer, x):
    """The eval output of a new layer loaded with ``layer``'s weights (nothing cached)."""
    other = copy.deepcopy(layer)
    other.forget_divisor()
    with torch.no_grad():
        return other.eval()(x)


def test_eval_divisor_is_computed_once(monkeypatch):
    """Eval mode computes each normalised weight's exact divisor once, not in every forward."""
    from lipsformer.layers import normalized

    calls = []
    exact = normalized.top_singular_triple
    monkeypatch.setattr(normalized, "top_singular_triple", lambda w, **kw: calls.append(1) or exact(w, **kw))
    for layer, x in _normalized_pair():
        layer.eval()
        calls.clear()
        with torch.no_grad():
            first, second = layer(x), layer(x)
        assert len(calls) == 1 and torch.equal(first, second)
        assert torch.allclose(first, layer.train()(x), atol=1e-6)  # the train-mode (in-graph) divisor's output


def test_training_divisor_is_computed_once_per_weight_change_and_shared_with_bound_keeping(monkeypatch):
    """In training the divisor is computed once per change of the raw weight: the forwards of an accumulation
    window share it, the bound keeping after an optimizer step computes the one the next forward divides by (which
    gives a fresh computation's output) beside the verified triple its bound needs, and a change of mode drops it."""
    from lipsformer.layers import normalized
    from lipsformer.lipschitz.registry import module_bound

    calls = dict(verified=[], estimate=[])
    verified, estimate = normalized.top_singular_triple, normalized.estimated_top_triple
    monkeypatch.setattr(normalized, "top_singular_triple",
                        lambda w, **kw: calls["verified"].append(1) or verified(w, **kw))
    monkeypatch.setattr(normalized, "estimated_top_triple",
                        lambda w, *a: calls["estimate"].append(1) or estimate(w, *a))

    def counts():
        return len(calls["verified"]), len(calls["estimate"])

    for layer, x in _normalized_pair():
        layer.train()
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
        calls["verified"].clear(), calls["estimate"].clear()
        for _ in range(2):  # two micro-batches of one accumulation window
            layer(x).pow(2).sum().backward()
        assert counts() == (0, 1)
        opt.step()
        assert module_bound(layer, (8, 8)).lip == pytest.approx(1.0, abs=1e-6) and counts() == (1, 2)
        out = layer(x)
        assert counts() == (1, 2)
        fresh = copy.deepcopy(layer)
        fresh.forget_divisor()
        assert torch.equal(out, fresh(x)) and counts() == (1, 3)
        layer.eval()
        layer(x)
        assert counts() == (2, 3)
        layer.train()
        layer(x)
        assert counts() == (2, 4)


def _change(layer, x, how):
    if how == "load_state_dict":
        layer.load_state_dict({k: v * torch.linspace(0.5, 2, v.shape[-1]) for k, v in layer.state_dict().items()})
    elif how in ("step in train mode, then eval", "step in eval mode"):
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        layer.train(how.startswith("step in train"))
        layer(x).pow(2).sum().backward()
        opt.step()
        layer.eval()
    elif how == "in-place edit":
        with torch.no_grad():
            layer.raw_weight[0].mul_(-3.0)
    else:  # .to() a dtype and back: new storage (the rounded weights), perhaps at the old address
        layer.half().float()


@pytest.mark.parametrize("how", ["load_state_dict", "step in train mode, then eval", "step in eval mode",
                                 "in-place edit", "half, then float"])
def test_eval_divisor_is_never_stale(how):
    """The cached divisor is recomputed after every change of the raw weight: the eval output equals a fresh
    computation's (a copy with nothing cached)."""
    for layer, x in _normalized_pair():
        with torch.no_grad():
            before = layer.eval()(x)  # cached
        _change(layer, x, how)
        with torch.no_grad():
            after = layer(x)
        assert torch.equal(after, _fresh(layer, x)) and not torch.allclose(after, before)


def test_power_iteration_divisor_in_training_exact_at_evaluation():
    """linear=normalized_power trains with one power iteration per weight change: the divisor
    ||W^T u|| is at most the exact norm and tracks it, the first iterate is the exact vector (no random start: the
    global RNG stream is that of the exact divisor), forwards between two steps share it, and eval mode divides by
    the exact norm (the same output as the exact layer)."""
    from lipsformer.layers import NormalizedLinear

    x = torch.randn(3, 12)
    torch.manual_seed(1)
    exact = NormalizedLinear(12, 5, power_iteration=False)
    after_exact = (exact.train()(x), torch.rand(1))
    torch.manual_seed(1)
    lin = NormalizedLinear(12, 5, power_iteration=True)
    first = lin.train()(x)
    assert torch.equal(torch.rand(1), after_exact[1]) and torch.allclose(first, after_exact[0], atol=1e-6)
    opt, opt_exact = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (lin, exact))
    for step in range(4):
        out = lin(x)
        u = lin.weight_u.clone()
        assert torch.equal(lin(x), out) and torch.equal(lin.weight_u, u)  # once per weight change, not per forward
        true = float(torch.linalg.matrix_norm(lin.raw_weight.detach().double(), 2))
        sigma = float((lin.raw_weight / lin.weight).detach().mean())
        assert sigma <= true * (1 + 1e-6) and sigma == pytest.approx(true, rel=1e-3)
        for m, o in ((lin, opt), (exact, opt_exact)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    lin.eval()
    exact.load_state_dict(lin.state_dict())
    with torch.no_grad():
        assert torch.equal(lin(x), exact.eval()(x))


def test_power_iteration_state_is_not_in_the_state_dict_and_loads_from_an_exact_checkpoint():
    """The vectors are non-persistent: a normalised layer's state dict keeps nn.Linear's keys either way, a
    linear=normalized (or older) checkpoint loads strictly, and the first training divisor after a load is exact."""
    from lipsformer.layers import NormalizedConv2d
    from lipsformer.layers.normalized import PowerIterationState

    conv, older = NormalizedConv2d(3, 6, 2, stride=2, power_iteration=True), NormalizedConv2d(3, 6, 2, stride=2)
    assert list(conv.state_dict()) == list(older.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 3, 8, 8)
    conv.train()(x)
    conv.load_state_dict(older.state_dict())
    assert torch.allclose(conv(x), older.train()(x), atol=1e-6)
    saved = PowerIterationState(conv).state_dict()
    with pytest.raises(ValueError, match="power-iteration state for 1 layers, the model has 0"):
        PowerIterationState(older).load_state_dict(saved)


def test_eval_divisor_keeps_the_weight_gradient_and_the_input_gradient():
    """The cached divisor is a constant in the input (attacks) and, where the raw weight needs a gradient, gives
    the gradient of the in-graph division (u v^T straight through)."""
    for layer, x in _normalized_pair():
        grads = {}
        for mode in (True, False):
            layer.train(mode)
            xi = x.clone().requires_grad_()
            layer(xi).pow(2).sum().backward()
            grads[mode] = (layer.raw_weight.grad.clone(), xi.grad)
            layer.zero_grad()
        assert torch.allclose(grads[False][0], grads[True][0], atol=1e-5)
        assert torch.allclose(grads[False][1], grads[True][1], atol=1e-5)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_normalized_model_bound_holds_and_keeping_leaves_it_alone(name):
    from lipsformer.layers import NormalizedConv2d, NormalizedLinear
    from lipsformer.lipschitz import lipschitz_report, maximize_difference_quotient
    from lipsformer.lipschitz.constraints import keep_bound

    model = certifiable(name, linear="normalized", attlip_prox=True, attlip_steps=(1, 10)).eval()
    kinds = {type(m) for m in model.modules()}
    assert NormalizedLinear in kinds and NormalizedConv2d in kinds and torch.nn.Linear not in kinds
    assert type(model.head.fc) is NormalizedLinear and type(model.patch_embed.proj) is NormalizedConv2d
    with pytest.raises(ValueError, match="linear must be one of"):
        certifiable(name, linear="orthogonal")
    with torch.no_grad():  # raw weights far from norm 1: the normalised maps do not care
        for m in model.modules():
            if isinstance(m, (NormalizedLinear, NormalizedConv2d)):
                m.raw_weight.mul_(5.0)
    raw = {n: p.clone() for n, p in model.named_parameters()}
    keep_bound(model, 1.01, weight_max=1.0, conv_max=1.0)  # projects only the overlapping (depth-wise) convs
    for n, m in model.named_modules():
        if isinstance(m, (NormalizedLinear, NormalizedConv2d)):
            assert torch.equal(m.raw_weight, raw[f"{n}.weight"])
    report = lipschitz_report(model)
    norm_rows = [r for r in report.rows
                 if isinstance(model.get_submodule(r.name), (NormalizedLinear, NormalizedConv2d))]
    assert norm_rows and all(r.lip == pytest.approx(1.0, abs=1e-5) for r in norm_rows)
    bound = report.bound
    assert bound <= 1.01
    lower = maximize_difference_quotient(model, torch.rand(1, 3, 32, 32), radius=0.5, steps=5)["lower_bound"]
    assert 0 < lower <= bound


def test_attlip_prox_mixer_returns_the_proximal_point():
    from lipsformer.layers import AttLipMixer, ConvexResidual
    from lipsformer.layers.attlip_solver import attlip_prox
    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    delta = AttLipMixer(8, 2, [(4, 4)], eval_steps=100).eval()
    prox = AttLipMixer(8, 2, [(4, 4)], eval_steps=100, delta=False).eval()
    prox.load_state_dict(delta.state_dict())
    x = 3 * torch.randn(2, 4, 4, 8)
    tokens = x.reshape(2, 16, 8).double()
    layer = prox.branches[0]
    exact = attlip_prox(tokens, layer.weight.detach().double(), 2, steps=500, tol=1e-12).reshape(2, 4, 4, 8)
    near = layer.eta * layer.tol  # each window solved to tol: within eta * tol of the prox (AttLip Prop. 3 (1))
    assert (prox(x).detach().double() - exact).flatten(1).norm(dim=1).max() <= near
    assert (delta(x).detach().double() - (exact - x.double())).flatten(1).norm(dim=1).max() <= near
    assert not torch.allclose(prox(x), delta(x), atol=1e-2)
    assert module_bound(prox).lip == 1.0
    q = maximize_difference_quotient(prox, x, radius=1.0, steps=8)["lower_bound"]
    assert q <= 1.0 + 1e-4
    # under a convex residual at a = 0 the block is the identity; with prox(x) - x at a = 1/2 it is prox(x) / 2
    res = ConvexResidual(8, 0.0)
    assert torch.equal(res(x, prox(x)), x)
    res_half = ConvexResidual(8, 0.5)
    assert torch.allclose(res_half(x, delta(x)).double(), 0.5 * exact, atol=1e-4)
    model = certifiable("lipsformer_cswin_t", attlip_prox=True)
    assert all(not m.delta for m in model.modules() if isinstance(m, AttLipMixer))


def test_certifiable_checkpoint_reloads_with_its_normalisation_and_normalized_layers(tmp_path):
    """What eval.py does with a certified run: the run's own pretrained_cfg_overlay (std 1) and the normalised
    layers come back, with the same logits (the overlay does not clash with the file's own)."""
    from safetensors.torch import save_file

    from lipsformer.layers import NormalizedLinear
    from lipsformer.build import build_model

    kw = dict(TINY["cswin"], init="xavier", residual="convex", act="groupsort", norm="none", linear="normalized",
              num_classes=4)
    model = timm.create_model("lipsformer_cswin_t", **kw).eval()
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    net, _ = build_model("lipsformer_cswin_t", tmp_path / "w.safetensors",
                         pretrained_cfg_overlay=dict(mean=(0.5,) * 3, std=(1.0,) * 3), **kw)
    net.eval()
    assert tuple(net.pretrained_cfg["std"]) == (1.0,) * 3 and type(net.head.fc) is NormalizedLinear
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(net(x), model(x), atol=1e-6)


def test_benchmark_table_averages_over_seeds_and_rejects_no_jobs():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "paper"))
    import certified

    def row(model, seed, value, in_use):
        r = dict(model=model, seed=seed, branches_in_use=in_use, seconds=10.0)
        r.update({c: value for c in certified.columns(certified.EPS)})
        return r

    lines = certified.table([row("A", 0, 90.0, [3, 8]), row("A", 1, 92.0, [0, 8]),
                             row("B", 0, 80.0, [0, 0])]).splitlines()
    assert lines[0].count("cert.") == 3 and lines[0].count("global") == 3  # both rules at each radius
    assert lines[2].startswith("| A | 2 | 91.0 ± 1.4 | 91.0 ± 1.4 |")  # mean ± sample standard deviation
    assert lines[2].endswith("| 3/8, 0/8 | 10 |")  # per seed: residual branches with |a| >= 0.02; mean seconds
    assert lines[3].startswith("| B | 1 | 80.0 | 80.0 |") and "±" not in lines[3]
    model = certifiable("lipsformer_swin_t")
    with torch.no_grad():
        model.stages[0].blocks[0].res_attn.alpha.zero_()
    total = sum(isinstance(m, ConvexResidual) for m in model.modules())  # attention, MLP and conv-block branches
    assert total > 2 * len(model.stages) and certified.branches_in_use(model) == [total - 1, total]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ConvexResidual):
                m.alpha.zero_()
    assert certified.branches_in_use(model) == [0, total]
    for bad in (["--jobs", "0"], ["--set", "seed=3"]):
        with pytest.raises(SystemExit):
            certified.main(bad)


# -- residual weights kept in a range (branches forced off, a floor), the reflected AttLip mixer, CPL MLP --
def test_alpha_range_holds_the_branches_off_or_on_through_training_steps():
    from lipsformer.lipschitz.constraints import keep_bound

    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for kw, lo, hi in ((dict(alpha_init=0.0, alpha_range=(0.0, 0.0)), 0.0, 0.0),
                       (dict(alpha_init=0.3, alpha_range=(0.25, 1.0)), 0.25, 1.0)):
        model = certifiable("lipsformer_swin_t", **kw)
        residuals = [m for m in model.modules() if isinstance(m, ConvexResidual)]
        assert residuals and all(m.alpha_range == (lo, hi) for m in residuals)
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(x) * 10, y).backward()
            torch.optim.SGD(model.parameters(), lr=10.0).step()  # a step far out of range
            model.zero_grad()
            with torch.no_grad():
                for m in residuals:
                    m.alpha.fill_(-1.0)
            keep_bound(model, 1e30, weight_max=1.0, conv_max=1.0)
            assert {float(m.alpha.detach()) for m in residuals} == {lo}
    off = certifiable("lipsformer_swin_t", alpha_init=0.0, alpha_range=(0.0, 0.0))
    seen = []
    for stage in off.stages:
        stage.blocks[0].register_forward_hook(lambda m, args, out: seen.append(torch.equal(out, args[0])))
    off(x)
    assert seen == [True] * len(off.stages)  # every branch off: each block is the identity


def test_reflected_attlip_mixer_is_2_prox_minus_x_nonexpansive_with_twice_the_defect():
    from lipsformer.layers import AttLipMixer
    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    prox = AttLipMixer(8, 2, [(4, 4)], eval_steps=100, delta=False).eval()
    reflect = AttLipMixer(8, 2, [(4, 4)], eval_steps=100, delta=False, reflect=True).eval()
    reflect.load_state_dict(prox.state_dict())
    x = 3 * torch.randn(2, 4, 4, 8)
    assert torch.allclose(reflect(x), 2 * prox(x) - x, atol=1e-5)
    assert module_bound(reflect).lip == 1.0 and reflect.solver_defect((4, 4)) == 2 * prox.solver_defect((4, 4))
    q = maximize_difference_quotient(reflect, x, radius=1.0, steps=8)["lower_bound"]
    assert 0.5 < q <= 1.0 + 1e-4  # the reflection keeps much more of a difference than prox's contraction
    model = certifiable("lipsformer_cswin_t", attlip_reflect=True)
    assert all(m.reflect for m in model.modules() if isinstance(m, AttLipMixer))


def test_cpl_mlp_is_x_minus_2_wt_relu_wx_b_and_its_bound_holds():
    from lipsformer.layers.block import CPLMlp
    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    mlp = CPLMlp(8, 32)
    x = torch.randn(5, 8)
    w, b = mlp.fc.weight, mlp.fc.bias
    assert torch.allclose(mlp(x), x - 2 * torch.relu(x @ w.T + b) @ w, atol=1e-6)
    for scale in (1.0, 3.0):  # ||W|| <= 1: 1; larger: 2 ||W||^2 - 1
        with torch.no_grad():
            mlp.fc.weight.mul_(scale / torch.linalg.matrix_norm(mlp.fc.weight, ord=2))
        bound = module_bound(mlp).lip
        assert bound == pytest.approx(max(1.0, 2 * scale ** 2 - 1), rel=1e-6)
        q = maximize_difference_quotient(mlp, x[0], radius=1.0, steps=20)["lower_bound"]
        assert q <= bound * (1 + 1e-5) and (scale == 1.0 or q > 1.5)
    model = certifiable("lipsformer_swin_t", mlp="cpl")
    assert all(isinstance(b.mlp, CPLMlp) for s in model.stages for b in s.blocks)


def test_conv_input_sizes_measures_a_compiled_model_eagerly():
    """The measuring forward of bound keeping runs eagerly in a compiled model: compiled, it would trace the hooks
    that fill a weak dictionary, whose keys dynamo guards on and which fail that guard once a key is collected; and
    it would compile a batch-1 graph for nothing."""
    from torch._dynamo.testing import CompileCounter
    from lipsformer.lipschitz.constraints import _CONV_INPUT_HW, conv_input_sizes
    model = timm.create_model("lipsformer_swin_t", img_size=32, embed_dim=16, depths=(1, 1, 1, 1),
                              num_heads=(1, 2, 4, 8), window_size=4)
    counter = CompileCounter()
    model.compile(backend=counter)
    sizes = conv_input_sizes(model)
    assert counter.frame_count == 0 and all(conv in _CONV_INPUT_HW for conv in sizes)
    assert sizes[model.stages[0].blocks[0].convs.dw1] == (8, 8)


def test_bound_keeping_keys_are_keep_bounds_arguments_and_the_resume_record_compares_them():
    """The fields declared with ``keep_bound=`` say which config keys train.py passes to keep_bound, under which
    argument names; they and the margin's keys are what a checkpoint's record of the last projection is compared on
    at resume (a changed key projects again instead of restoring), in the order checkpoints store them."""
    import dataclasses
    import inspect
    from lipsformer.config import KEEP_BOUND_KEYS, TrainConfig
    from lipsformer.engine.margin import keep_bound_args, keep_settings
    from lipsformer.lipschitz.constraints import keep_bound
    params = inspect.signature(keep_bound).parameters
    assert set(KEEP_BOUND_KEYS.values()) <= set(params) and set(KEEP_BOUND_KEYS) <= {f.name for f in
                                                                                     dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(lipschitz_target=3.0, lipschitz_conv_max=0.5)
    assert keep_bound_args(cfg)["target"] == 3.0 and keep_bound_args(cfg)["conv_max"] == 0.5
    for key in KEEP_BOUND_KEYS:
        changed = dataclasses.replace(cfg, **{key: 0.25})
        assert keep_settings(changed) != keep_settings(cfg)
    stored = ("lipschitz_target", "lipschitz_gamma_max", "lipschitz_tau_max", "lipschitz_weight_max",
              "lipschitz_conv_max", "margin_eps", "margin_bound")  # the order written checkpoints hold
    distinct = TrainConfig(**{k: 0.5 + i for i, k in enumerate(stored)})
    assert keep_settings(distinct) == [getattr(distinct, k) for k in stored]


# -- the attention-free mixer of the same parameters ----------------------------------------------------
def test_shift_tokens_moves_four_channel_groups_one_token_each_way_with_zeros_in():
    from lipsformer.layers.shift import shift_tokens

    x = torch.randn(2, 3, 4, 9)  # four groups of 2 channels and one channel that stays
    out = shift_tokens(x)
    zero = torch.zeros_like
    torch.testing.assert_close(out[..., 0:2], torch.cat([zero(x[:, :1, :, 0:2]), x[:, :-1, :, 0:2]], 1))  # down
    torch.testing.assert_close(out[..., 2:4], torch.cat([x[:, 1:, :, 2:4], zero(x[:, :1, :, 2:4])], 1))  # up
    torch.testing.assert_close(out[..., 4:6], torch.cat([zero(x[:, :, :1, 4:6]), x[:, :, :-1, 4:6]], 2))  # right
    torch.testing.assert_close(out[..., 6:8], torch.cat([x[:, :, 1:, 6:8], zero(x[:, :, :1, 6:8])], 2))  # left
    torch.testing.assert_close(out[..., 8:], x[..., 8:])
    # a partial permutation: differences never grow
    y = torch.randn_like(x)
    assert (shift_tokens(x) - shift_tokens(y)).norm() <= (x - y).norm()
    assert shift_tokens(torch.ones(1, 1, 1, 8)).abs().sum() == 0  # one token: every shifted channel leaves


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_shift_mixer_replaces_attention_with_its_parameters_and_its_certificate_holds(name):
    from lipsformer.layers.shift import ShiftMixer
    from lipsformer.lipschitz import lipschitz_report, maximize_difference_quotient
    from lipsformer.lipschitz.certify import normalization, pgd_l2, predict_certified
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    shift = certifiable(name, attn="shift", linear="normalized").eval()
    mixers = [b.attn for s in shift.stages for b in s.blocks]
    assert mixers and all(isinstance(m, ShiftMixer) for m in mixers)
    # the parameters of one output map: Swin's orthogonal AttLip has a C x C rotation (and a scale a head)
    assert all(sum(p.numel() for p in m.parameters()) == m.proj.in_features * (m.proj.in_features + 1)
               for m in mixers)
    mixer = ShiftMixer(8)
    with torch.no_grad():
        mixer.proj.weight.mul_(3.0)
    bound = module_bound(mixer, (4, 4)).lip
    assert bound == pytest.approx(float(torch.linalg.matrix_norm(mixer.proj.weight.detach(), ord=2)), rel=1e-6)
    q = maximize_difference_quotient(mixer, torch.randn(1, 4, 4, 8), radius=1.0, steps=20)["lower_bound"]
    assert 0.5 * bound < q <= bound * (1 + 1e-5)
    report = lipschitz_report(shift)
    assert report.bound <= 1.0 + 1e-5 and report.defect == 0  # no solver: nothing to charge
    # sound: PGD at 0.98x each image's certified radius flips nothing
    mean, std = normalization(shift)
    pixels = torch.rand(6, 3, 32, 32)
    _, pred, radius = predict_certified(shift, (pixels - mean) / std)
    assert (radius > 0).all()
    assert not pgd_l2(shift, pixels, pred, radius.float() * 0.98, mean, std, steps=10, restarts=2).any()
    shift.set_input_size(img_size=64)  # no windows: any size, the weights kept
    assert shift(torch.randn(1, 3, 64, 64)).shape == (1, 4)


@pytest.mark.parametrize("mode", ["prox", "I - prox", "2 prox - I"])
def test_one_token_attlip_windows_are_bounded_by_their_gains_and_exactly(mode):
    from lipsformer.layers import AttLipMixer
    from lipsformer.lipschitz.layer_bounds import one_token_gains
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    kw = dict(delta=mode == "I - prox", reflect=mode == "2 prox - I", form="orthogonal", eval_steps=100)
    mixer = AttLipMixer(16, 4, [(1, 1), (1, 1)], **kw).double().eval()
    with torch.no_grad():  # s_h from 0.3 to 1.9: gains 1 / (1 + 4 s_h^2 / sqrt(4)) from 0.85 to 0.12
        for branch, raw in zip(mixer.branches, ([-2.0, 3.0], [0.5, -1.0])):
            branch.scale.copy_(torch.tensor(raw))
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda t: mixer(t.view(1, 1, 1, 16)).flatten(), x.flatten())
    exact = float(torch.linalg.matrix_norm(jac, ord=2))
    bound = module_bound(mixer, (1, 1)).lip
    assert exact <= bound <= exact * (1 + 1e-9)  # the one-token map is linear: its bound is its norm
    lo, hi = one_token_gains(mixer.branches[0])
    assert 0.1 < lo < hi < 0.9
    assert bound < 0.9  # prox and 2 prox - I shrink every direction here; I - prox by 1 - min(lam) = 0.88
    wide = AttLipMixer(16, 4, [(2, 2), (2, 2)], **kw).double()
    wide.load_state_dict(mixer.state_dict())
    assert module_bound(wide, (2, 2)).lip >= 1.0  # several tokens a window: Theorem 4's 1 (plus rounding)


def test_one_token_bound_certifies_a_model_whose_last_stage_contracts():
    from lipsformer.lipschitz import lipschitz_report
    from lipsformer.lipschitz.certify import normalization, pgd_l2, predict_certified

    torch.manual_seed(0)
    model = timm.create_model("lipsformer_swin_t_cert", **TINY["swin"], num_classes=4).eval()
    last = model.stages[-1].blocks[-1]
    assert last.attn.windows == [(1, 1)]  # 32 px: the last stage is one token
    with torch.no_grad():  # the last attention branch fully open: s_h = 1.9, its prox 1 / (1 + 4 s_h^2 / 4) = 0.22
        last.attn.branches[0].scale.fill_(3.0)
        last.res_attn.alpha.fill_(1.0)
    report = lipschitz_report(model)
    assert report.bound < 0.25  # Theorem 4's 1 would leave it at 1
    # sound: PGD at 0.98x each image's certified radius flips nothing
    mean, std = normalization(model)
    pixels = torch.rand(6, 3, 32, 32)
    _, pred, radius = predict_certified(model, (pixels - mean) / std)
    assert (radius > 0).all()
    assert not pgd_l2(model, pixels, pred, radius.float() * 0.98, mean, std, steps=10, restarts=2).any()
