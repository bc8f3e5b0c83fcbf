"""The certificate is for the function computed: AttLip solved to its tolerance or refused, the solver's defect
charged off the margin (AttLip appendix, Proposition 3), margins in float32 whatever the forward precision."""
import pytest
import timm
import torch

from lipsformer.layers import attlip_solver as attlip
from lipsformer.layers.attlip import AttLip, solve_to_tolerance
from lipsformer.layers.attlip_potential import attlip_grad
from lipsformer.layers.attlip_solver import (SolverToleranceError, attlip_prox, attlip_prox_certified, attlip_solve,
                                             prox_residual64)
from lipsformer.lipschitz import lipschitz_report
from lipsformer.lipschitz.certify import (certified_radius, logit_margin, normalization, pgd_l2, pixel_lipschitz,
                                          predict_certified)
from lipsformer.lipschitz.constraints import keep_bound


def small(tol=1e-6, **kw):
    torch.manual_seed(0)
    model = timm.create_model("lipsformer_swin_t", img_size=16, patch_size=2, embed_dim=16, depths=(1, 1),
                              num_heads=(2, 2), window_size=2, init="xavier", residual="convex", act="groupsort",
                              norm="none", attn="attlip", alpha_init=0.5, drop_path_rate=0.0, num_classes=4,
                              attlip_steps=(1, 3), attlip_tol=tol, stage_act="groupsort", **kw).eval()
    keep_bound(model, 1.01, weight_max=1.0, conv_max=1.0)
    return model


def set_tol(model, tol):
    for m in model.modules():
        if isinstance(m, AttLip):
            m.tol = tol


@pytest.mark.parametrize("form", ["general", "orthogonal"])
def test_early_stopped_solver_certifies_smaller_radii_never_larger(form):
    model = small(attlip_form=form)
    mean, std = normalization(model)
    images = (torch.rand(4, 3, 16, 16) - mean) / std
    with pytest.raises(SolverToleranceError, match="hard cap 2"):  # a cap fails loudly, never stops early
        predict_certified(model, images, max_steps=2)
    _, pred, tight = predict_certified(model, images)
    assert pixel_lipschitz(model).defect > 0
    set_tol(model, 3e-4)  # stopped earlier: a larger residual is allowed, and charged
    loose_L = pixel_lipschitz(model)
    loose_logits, loose_pred, loose = predict_certified(model, images, loose_L)
    assert loose_L.defect > 100 * pixel_lipschitz(small(attlip_form=form)).defect
    w = lipschitz_report(model).head  # the pairwise rule: 2 ||w_c - w_j|| D_b off each logit difference
    Lb, Db = loose_L.backbone * loose_L.input_scale, loose_L.backbone_defect
    assert Db > 0 and loose_L.backbone < loose_L.network
    charged = torch.tensor([min((z[c] - z[j] - 2 * (w[c] - w[j]).norm() * Db) / ((w[c] - w[j]).norm() * Lb)
                                for j in range(len(z)) if j != c)
                            for z, c in zip(loose_logits.double(), loose_pred.tolist())], dtype=torch.float64)
    assert torch.allclose(loose, charged.clamp_min(0), rtol=1e-12, atol=0)
    glob = (logit_margin(loose_logits).double() - 2 * 2 ** 0.5 * loose_L.defect) / (2 ** 0.5 * loose_L.bound)
    assert torch.equal(certified_radius(loose_logits, loose_L), glob.clamp_min(0))  # 2 sqrt(2) D off each margin
    assert (tight > 0).any()
    assert (loose <= tight).all() and (loose < tight)[tight > 0].all()


def test_head_gaps_are_upper_bounds_of_the_exact_row_distances_close_rows_included():
    """The pairwise rule's ``||w_c - w_j||`` never below the exact distance (squared, in exact rational arithmetic),
    within 1e-12 of it, for rows far apart and for rows 1e-6 apart, where the Gram-matrix shortcut
    ``||w_c||^2 + ||w_j||^2 - 2 w_c.w_j`` cancels; 32 rows, above the 25 where ``torch.cdist``'s default takes it."""
    from fractions import Fraction

    from lipsformer.lipschitz.certify import head_gaps

    g = torch.Generator().manual_seed(6)
    w = torch.randn(32, 33, generator=g)
    w[1] = w[0] + 1e-6 * torch.randn(33, generator=g)
    gaps = head_gaps(w)
    rows = [[Fraction(v) for v in r] for r in w.double().tolist()]
    for c, j in [(0, 1), (1, 0), (0, 0)] + [(c, (c * 7 + 3) % 32) for c in range(32)]:
        exact = sum((a - b) ** 2 for a, b in zip(rows[c], rows[j]))
        assert Fraction(float(gaps[c, j])) ** 2 >= exact
        assert float(gaps[c, j]) <= float(exact) ** 0.5 * (1 + 1e-12)
    assert 0 < float(gaps[0, 1]) < 1e-4


def test_the_pairwise_radius_is_never_below_the_global_one_and_charges_the_backbone():
    """``min_j (z_c - z_j - 2 g_cj D_b) / (g_cj L_b)`` with ``g_cj = ||w_c - w_j||``: never below the global
    ``(margin - 2 sqrt(2) D) / (sqrt(2) L)`` (``g_cj <= sqrt(2) ||W||``), larger on most images here, and it is what
    predict_certified returns."""
    model = small()
    mean, std = normalization(model)
    images = (torch.rand(12, 3, 16, 16, generator=torch.Generator().manual_seed(3)) - mean) / std
    logits, pred, radius = predict_certified(model, images)
    L = pixel_lipschitz(model)
    report = lipschitz_report(model)
    fc = model.head.fc
    assert torch.equal(report.head, fc.weight.detach().double())  # the matrix the forward multiplies by
    assert L.backbone == report.backbone().bound and L.backbone_defect == report.backbone().defect > 0
    assert L.backbone * report.rows[-1].lip == pytest.approx(L.network, rel=1e-12)  # L = L_b ||W||
    glob = certified_radius(logits, L)
    assert (glob > 0).sum() >= 4
    assert (radius >= glob).all() and (radius > 1.2 * glob).sum() >= 6


@pytest.mark.parametrize("form", ["general", "orthogonal"])
def test_pgd_at_the_certified_radius_flips_none_on_inputs_hardest_for_the_solver(form):
    model = small(attlip_form=form)
    mean, std = normalization(model)
    candidates = torch.cat([torch.rand(4, 3, 16, 16), torch.ones(1, 3, 16, 16),
                            (torch.arange(16 * 16).view(1, 1, 16, 16) % 2).float().expand(1, 3, 16, 16)])
    worst = torch.zeros(len(candidates))  # the first block's initial residual ||grad f(x)||: what the solver must undo

    def hook(module, inputs, _):
        g = attlip_grad(inputs[0], module.weight, module.heads).pow(2).sum((-1, -2)).sqrt()
        worst.copy_(torch.maximum(worst, g.view(len(candidates), -1).amax(1)))

    layer = next(m for m in model.modules() if isinstance(m, AttLip))
    handle = layer.register_forward_hook(hook)
    with torch.no_grad():
        model((candidates - mean) / std)
    handle.remove()
    pixels = candidates[worst.topk(2).indices]
    _, pred, radius = predict_certified(model, (pixels - mean) / std)
    assert (radius > 0).all()
    with solve_to_tolerance(model):
        fooled = pgd_l2(model, pixels, pred, radius.float() * (1 - 1e-6), mean, std, steps=5, restarts=3)
    assert not fooled.any()


def test_the_attack_finds_a_known_adversarial_and_none_inside_the_certified_radius():
    """Potency: the same PGD breaks every image within the distance of an adversarial we know (the first point on
    the segment toward an image of another class where the prediction changes), so its silence at the certified
    radius means something."""
    torch.manual_seed(1)
    model = small()
    mean, std = normalization(model)
    pixels = torch.cat([torch.rand(6, 3, 16, 16), torch.rand(6, 3, 1, 1).expand(6, 3, 16, 16),
                        (torch.rand(6, 3, 16, 16) > 0.5).float()])  # noise, flat colours, binary noise
    logits, pred, radius = predict_certified(model, (pixels - mean) / std)  # the pairwise rule's radii
    assert (radius > 1.2 * certified_radius(logits, pixel_lipschitz(model))).sum() >= 6  # beyond the global rule
    pairs = [(i, next(j for j in range(len(pred)) if pred[j] != pred[i])) for i in range(len(pred))
             if (pred != pred[i]).any()]
    assert len(pairs) >= 4
    src, dst = (pixels[[p[k] for p in pairs]] for k in (0, 1))
    lo, hi = torch.zeros(len(pairs)), torch.ones(len(pairs))
    with torch.no_grad(), solve_to_tolerance(model):
        for _ in range(12):  # bisection for the first t where the prediction of src + t (dst - src) changes
            mid = (lo + hi) / 2
            moved = (model((src + mid.view(-1, 1, 1, 1) * (dst - src) - mean) / std).argmax(-1)
                     != pred[[p[0] for p in pairs]])
            hi, lo = torch.where(moved, mid, hi), torch.where(moved, lo, mid)
    known = hi * (dst - src).flatten(1).norm(dim=1)  # an adversarial lies at this distance
    with solve_to_tolerance(model):
        assert pgd_l2(model, src, pred[[p[0] for p in pairs]], known * 1.05, mean, std, steps=20, restarts=3).all()
        assert not pgd_l2(model, src, pred[[p[0] for p in pairs]], radius[[p[0] for p in pairs]].float(),
                          mean, std, steps=20, restarts=3).any()
    assert (radius[[p[0] for p in pairs]] < known.double()).all()


def test_certified_solve_meets_its_tolerance_in_float64_and_says_what_it_took():
    torch.manual_seed(0)
    layer = AttLip(16, heads=2)
    x = torch.randn(6, 9, 16) * 2
    ref = attlip_prox(x.double(), layer.weight.detach().double(), 2, steps=500, tol=1e-12)
    for tol in (1e-4, 1e-6):  # at 1e-6 float32 stalls above tol here: the stalled windows finish in float64
        y, stats = attlip_prox_certified(x, layer.weight, 2, 1.0, tol)
        assert y.dtype == torch.float32 and stats.tol == tol
        if tol == 1e-4:  # (after a float64 finish the bound is residual(y64) + ||y - y64|| / eta, checked below)
            assert float(prox_residual64(y, x, layer.weight, 2, 1.0).max()) <= tol
        assert stats.residual <= tol and 1 <= stats.mean_steps <= stats.steps
        assert (stats.float64_windows > 0) == (tol == 1e-6)
        # Prop. 3 (1): the output is within eta * tol of the exact prox (plus float32 rounding of the output)
        assert float((y.detach().double() - ref).pow(2).sum((-1, -2)).sqrt().max()) <= tol + 1e-6
    layer.eval()
    with solve_to_tolerance(layer):
        layer(x)
    assert layer.last_solve.steps > 1 and layer.last_solve.residual <= layer.tol
    with pytest.raises(SolverToleranceError, match="rounding of the output to torch.float32 alone"):
        attlip_prox_certified(x, layer.weight, 2, 1.0, 1e-8)  # below what a float32 output can carry


@pytest.mark.parametrize("overshoot, stall_floor", [(10.0, 100.0), (float("inf"), 100.0), (10.0, float("inf"))])
def test_a_solve_whose_first_step_overshoots_comes_back_and_meets_its_tolerance(monkeypatch, overshoot, stall_floor):
    """On 256 tokens the first Barzilai-Borwein step (eta / 2) takes the residual from 192 to thousands. With
    neither safeguard the solve would be declared stalled there and plain evaluation would return that point (AttLip
    Table 1's N = 1024 would measure a Lipschitz constant in the tens of thousands); undoing the step (OVERSHOOT) or
    not calling a window stalled far above its rounding floor (STALL_FLOOR) each suffices."""
    torch.manual_seed(0)
    w, x = torch.randn(32, 32) / 32 ** 0.5, torch.randn(1, 256, 32)
    start = float(prox_residual64(x, x, w, 1, 1.0))
    monkeypatch.setattr(attlip, "OVERSHOOT", overshoot)
    monkeypatch.setattr(attlip, "STALL_FLOOR", stall_floor)
    # the plain solve stops on its float32 residual, or on a stall within STALL_FLOOR of its rounding floor, which
    # leaves the float64 residual near tol on some CPUs' float32 arithmetic; the certified solve meets tol exactly
    assert float(prox_residual64(attlip_solve(x, w, 1, 1.0, 1e-4, 100), x, w, 1, 1.0)) <= 2e-4
    _, stats = attlip_prox_certified(x, w, 1, 1.0, 1e-4)
    assert stats.residual <= 1e-4
    monkeypatch.setattr(attlip, "OVERSHOOT", float("inf"))
    monkeypatch.setattr(attlip, "STALL_FLOOR", float("inf"))  # neither: the case exercises them
    assert float(prox_residual64(attlip_solve(x, w, 1, 1.0, 1e-4, 100), x, w, 1, 1.0)) > start


def test_a_window_is_not_called_stalled_far_above_its_rounding_floor(monkeypatch):
    """Ill-conditioned weights (as trained AttLip weights can be: ||W|| about 4 here, 8 on the certifiable digits
    models) make BB's residual rise for more than STALLED_AFTER evaluations far above float32's floor; stopped
    there, a window came back worse than it started. Gated by the floor, every window goes on descending."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 64) / 2, torch.randn(64, 16, 64)
    start = prox_residual64(x, x, w, 4, 1.0)
    ratio = prox_residual64(attlip_solve(x, w, 4, 1.0, 1e-4, 100), x, w, 4, 1.0) / start
    assert float(ratio.max()) <= 1e-3
    monkeypatch.setattr(attlip, "STALL_FLOOR", float("inf"))  # the ungated stall test
    ratio = prox_residual64(attlip_solve(x, w, 4, 1.0, 1e-4, 100), x, w, 4, 1.0) / start
    assert float(ratio.max()) > 1


@pytest.mark.parametrize("scale", [0.5, 5.0])
def test_solver_counts_the_multiply_adds_it_makes(scale):
    """SolveStats' multiply-adds (solve and float64 check) are what the profiler counts in their matrix products,
    exactly, also when windows finish in float64 (scale 5): benchmarks/certified_speed.py reports them per image."""
    torch.manual_seed(0)
    x, w = torch.randn(12, 9, 16) * scale, torch.randn(16, 16) / 4
    with torch.profiler.profile(with_flops=True) as prof:
        _, stats = attlip_prox_certified(x, w, 2, 1.0, 1e-5)
    products = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm")
    counted = sum(e.flops for e in prof.key_averages() if e.key in products and e.flops) // 2
    assert (stats.float64_windows > 0) == (scale > 1) and stats.check_multiply_adds > 0
    assert stats.multiply_adds + stats.check_multiply_adds == counted


def test_bf16_forward_never_certifies_more_than_fp32_and_margins_stay_fp32(fresh_accelerate):
    from accelerate import Accelerator

    model = small()
    mean, std = normalization(model)
    images = (torch.rand(3, 3, 16, 16) - mean) / std
    _, _, fp32 = predict_certified(model, images)
    prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare_model(model)
    logits, _, bf16 = predict_certified(prepared, images)
    assert logits.dtype == torch.float32 and torch.equal(bf16, fp32)  # the autocast wrapper is bypassed
    with pytest.raises(ValueError, match="float32 margins"):
        predict_certified(small().to(torch.bfloat16), images.to(torch.bfloat16))


def test_spectral_norm_bound_is_an_upper_bound_with_its_rounding_charged():
    """The bounds read a certified upper bound of each normalised layer's norm, never the eigensolver's value as is:
    above the exact float64 value (an SVD in extended work), by at most 1e-12 relative."""
    from lipsformer.layers.normalized import NormalizedLinear
    from lipsformer.layers.spectral import gram_norm_upper, top_singular_triple
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    for shape in ((64, 64), (300, 40), (40, 300), (8, 3, 4, 4)):
        w = torch.randn(shape)
        exact = float(top_singular_triple(w)[0])
        upper = gram_norm_upper(w)
        assert exact < upper <= exact * (1 + 1e-12)
        assert upper >= float(torch.linalg.matrix_norm(w.flatten(1).double(), ord=2))
    layer = NormalizedLinear(96, 96)
    bound = module_bound(layer).lip  # the normalised matrix, as the forward uses it, with rounding charged
    assert float(top_singular_triple(layer.weight)[0]) < bound <= 1.0 + 1e-6


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_normalised_layer_bound_holds_for_the_matrix_each_mode_divides_by(kind):
    """A normalised layer's bound is at least the exact norm of the matrix its forward uses, in training (exact
    divisor), in eval mode (cached divisor), after a write that bypasses the version counter (the checksum sees it),
    after the cache was made stale some other way (computing the bound puts the exact divisor back, and the forward
    divides by it), and with a power iterate that lags; and within 1e-6 of 1 where the divisor is exact."""
    from lipsformer.layers.normalized import NormalizedConv2d, NormalizedLinear
    from lipsformer.lipschitz.registry import module_bound

    def used(layer) -> float:  # the float64 norm of the float32 matrix the forward multiplies by
        return float(torch.linalg.matrix_norm(layer.weight.detach().flatten(1).double(), ord=2))

    torch.manual_seed(0)
    make = (lambda p: NormalizedLinear(48, 40, power_iteration=p)) if kind == "linear" else \
        (lambda p: NormalizedConv2d(6, 16, 2, stride=2, power_iteration=p))
    layer = make(False)
    for mode in (True, False):
        layer.train(mode)
        bound = module_bound(layer, (8, 8)).lip
        assert used(layer) <= bound <= 1.0 + 1e-6
    layer.raw_weight.data[0].mul_(3.0)  # no version bump
    assert used(layer) <= 1.0 + 1e-6 and module_bound(layer, (8, 8)).lip <= 1.0 + 1e-6
    key, alias, (sigma, u, v) = layer._divisor_cache
    layer.__dict__["_divisor_cache"] = (key, alias, (sigma / 2, u, v))  # a stale divisor the key cannot tell
    assert used(layer) > 1.9
    bound = module_bound(layer, (8, 8)).lip
    assert used(layer) <= bound <= 1.0 + 1e-6
    power = make(True).train()
    power(torch.randn(2, 48) if kind == "linear" else torch.randn(2, 6, 8, 8))  # first iterate: the exact vector
    with torch.no_grad():
        power.raw_weight.add_(torch.randn_like(power.raw_weight))  # moves the top direction: one iteration lags
    bound = module_bound(power, (8, 8)).lip
    assert used(power) > 1.0 + 1e-3 and used(power) <= bound <= used(power) * (1 + 1e-6)


def test_certify_dataset_reports_the_solver_steps_of_every_attlip_block(fresh_accelerate):
    from accelerate import Accelerator

    from lipsformer.lipschitz.certify import certify_dataset

    model = small()
    mean, std = normalization(model)
    images = (torch.rand(4, 3, 16, 16) - mean) / std
    loader = [(images[:2], torch.tensor([0, 1])), (images[2:], torch.tensor([2, 3]))]
    out = certify_dataset(model, loader, Accelerator(cpu=True), [[0], [1], [2], [3]], certify_eps=(0.0,))
    blocks = [name for name, m in model.named_modules() if isinstance(m, AttLip)]
    assert sorted(out["solver_steps"]) == sorted(blocks)
    assert all(s >= 1 for s in out["solver_steps"].values())


def test_platform_float32_exp_is_within_the_error_the_residual_bound_assumes():
    """prox_residual32's bound charges each float32 exp a relative error of EXP_REL_ERROR32 (2^-18, 64 ulp; SLEEF
    and CUDA document 1 and 2 ulp): measured here against float64 on 2^21 arguments covering [-104, 0], and on
    every float32 in [-1, 0) with a 2^-12 step of its exponent bits' neighbourhood."""
    t = torch.cat([torch.linspace(-104.0, 0.0, 2 ** 21),
                   -torch.rand(2 ** 18, generator=torch.Generator().manual_seed(0))])
    got, ref = torch.exp(t).double(), torch.exp(t.double())
    normal = ref > torch.finfo(torch.float32).tiny
    worst = float(((got - ref).abs() / ref)[normal].max())
    assert worst <= attlip.EXP_REL_ERROR32 / 8  # room to spare (about 1 ulp, 6e-8, on this machine)


@pytest.mark.parametrize("scale", [0.1, 1.0, 2.0])
def test_float32_residual_and_its_bound_cover_the_float64_residual(scale):
    """At the solver's float32 output, |r32 - r64| <= e for every group (so r32 + e bounds the exact residual),
    while r32 alone is below r64 for some groups (the bound is needed); the bound grows with the scores, and where
    it does not settle a group the certified solve evaluates that group in float64."""
    from lipsformer.layers.attlip_potential import DiagonalWeight
    from lipsformer.layers.attlip_solver import prox_residual32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, 8, generator=gen) * scale
    w = DiagonalWeight(2 * torch.rand(96, 1, 1, generator=gen), 8)
    y, stats = attlip_prox_certified(x, w, 1, 1.0, 1e-4)
    r, e = prox_residual32(y, x, w, 1.0)
    r64 = prox_residual64(y, x, w, 1, 1.0)
    assert ((r - r64).abs() <= e).all() and (r < r64).any()
    assert stats.float64_windows == 0 and stats.residual <= 1e-4
    assert stats.float64_checks == int(((r + e) > 1e-4).sum())  # float64 exactly where the bound did not settle
    assert (scale < 1) == (stats.float64_checks == 0)


def test_orthogonal_form_counts_its_multiply_adds_rotations_and_checks_included():
    """The orthogonal block's SolveStats count what the profiler counts in its matrix products: the two rotations,
    the per-head solves and the float32 check, and the float64 checks where the float32 bound did not settle."""
    from lipsformer.layers.attlip import OrthogonalAttLip
    torch.manual_seed(0)
    layer = OrthogonalAttLip(16, heads=2).eval()
    products = ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm")
    for scale in (0.3, 3.0):
        x = torch.randn(12, 9, 16) * scale
        with torch.profiler.profile(with_flops=True) as prof, torch.no_grad(), solve_to_tolerance(layer):
            layer(x)
        counted = sum(e.flops for e in prof.key_averages() if e.key in products and e.flops) // 2
        stats = layer.last_solve
        assert (stats.float64_checks > 0) == (scale > 1)
        assert stats.multiply_adds + stats.check_multiply_adds == counted


def test_orthogonal_rotation_bound_covers_the_rounded_rotation():
    """The certified ||Q'^T Q' - I|| of the float32 rotation is at least its value from an SVD in float64, and the
    block's and mixer's bounds charge it: 1 + delta for prox, 1 + 2 delta for I - prox."""
    from lipsformer.layers import AttLipMixer
    from lipsformer.lipschitz.registry import module_bound
    from lipsformer.layers.spectral import orthogonality_defect
    torch.manual_seed(0)
    for delta_mixer in (False, True):
        mixer = AttLipMixer(96, 6, [(4, 4), (4, 4)], delta=delta_mixer, form="orthogonal")
        layer = mixer.branches[0]
        q = layer._rotation()
        sv = torch.linalg.svdvals(q.double())
        exact = float((sv.pow(2) - 1).abs().max())
        delta = layer.rotation_defect()
        assert exact <= delta < 1e-5 and delta == orthogonality_defect(q)
        deltas = [b.rotation_defect() for b in mixer.branches]
        assert module_bound(layer).lip >= 1 + delta
        assert module_bound(mixer, (8, 8)).lip >= 1 + (2 if delta_mixer else 1) * max(deltas)


@pytest.mark.parametrize("kind", ["random", "orthogonal", "near_repeated", "rank_one"])
def test_the_verified_top_singular_triple_is_exact_and_its_bound_certified(kind):
    """The normalised layers' divisor and certified norm come from Lanczos verified by a Cholesky factorisation just
    above its estimate: sigma within the margin of the norm, the bound above the true norm (an SVD) by at most 1e-8
    relative, the same bits on every call (a resumed run divides by what the uninterrupted one did), and top singular
    values repeated or nearly so do not break it."""
    from lipsformer.layers import spectral

    g = torch.Generator().manual_seed(3)
    if kind == "random":
        w = torch.randn(300, 160, generator=g) * 0.02
    elif kind == "orthogonal":  # every singular value equal
        w = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))[0].float() * 3.0
    elif kind == "near_repeated":
        q1 = torch.linalg.qr(torch.randn(200, 128, generator=g, dtype=torch.float64))[0]
        q2 = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))[0]
        s = torch.linspace(1.0, 0.1, 128, dtype=torch.float64)
        s[1] = 1.0 - 1e-12
        w = (q1 * s) @ q2.T
    else:
        w = torch.randn(200, 1, generator=g) @ torch.randn(1, 150, generator=g)
    exact = float(torch.linalg.matrix_norm(w.flatten(1).double(), ord=2))
    a, _ = spectral._tall(w.double())
    assert spectral._verified_top(a, a.T @ a) is not None  # the route under test, not eigh's
    sigma, u, v, upper = spectral.top_singular_triple(w, upper=True)
    # ||W v|| for a unit v: never above the norm, and within the verification's margin of it (where every singular
    # value is the same up to float32 rounding, the vector is any of theirs)
    assert exact * (1 - 1e-8) <= float(sigma) <= exact * (1 + 1e-12)
    assert float(u @ w.flatten(1).double() @ v) == pytest.approx(float(sigma), rel=1e-12)
    assert exact < upper <= exact * (1 + 1e-8)
    again = spectral.top_singular_triple(w.clone(), upper=True)
    assert all(torch.equal(p, q) for p, q in zip((sigma, u, v), again[:3])) and again[3] == upper


def test_a_failed_verification_falls_back_to_eigh_and_stays_certified(monkeypatch):
    """With the Cholesky test run below the top eigenvalue it must fail (a pass there would certify a bound below
    the norm): the triple then comes from eigh, and the bound is still above the norm."""
    from lipsformer.layers import spectral

    w = torch.randn(300, 160, generator=torch.Generator().manual_seed(4))
    a, _ = spectral._tall(w.double())
    monkeypatch.setattr(spectral, "VERIFY_MARGIN", -1e-6)
    assert spectral._verified_top(a, a.T @ a) is None
    sigma, _, _, upper = spectral.top_singular_triple(w, upper=True)
    exact = float(torch.linalg.matrix_norm(w.double(), ord=2))
    assert float(sigma) == pytest.approx(exact, rel=1e-12) and exact < upper <= exact * (1 + 1e-12)


@pytest.mark.parametrize("shape", [(300, 160), (130, 520), (200, 97)])
def test_the_training_divisor_is_lanczos_estimate_at_most_the_norm_and_within_1e_8(shape):
    """In training the normalised layers divide by Lanczos's estimate without the Gram matrix: never above the norm
    (the image of a unit vector), within 1e-8 of it, a consistent triple (u^T W v = sigma), the same bits on every
    call; sides up to SMALL_DIM take the exact route, and a verified triple given for them is used as it is."""
    from lipsformer.layers import spectral

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.05
    exact = float(torch.linalg.matrix_norm(w.double(), ord=2))
    sigma, u, v = spectral.estimated_top_triple(w)
    assert exact * (1 - 1e-8) <= float(sigma) <= exact * (1 + 1e-12)
    assert float(u @ w.double() @ v) == pytest.approx(float(sigma), rel=1e-12)
    assert all(torch.equal(p, q) for p, q in zip((sigma, u, v), spectral.estimated_top_triple(w.clone())))
    verified = spectral.top_singular_triple(w)
    assert not torch.equal(sigma, verified[0])  # the route under test, not the verified one
    small = w[:, :spectral.SMALL_DIM] if w.shape[0] > w.shape[1] else w[:spectral.SMALL_DIM]
    exact_small = spectral.top_singular_triple(small)
    assert all(torch.equal(p, q) for p, q in zip(spectral.estimated_top_triple(small), exact_small))
    assert spectral.estimated_top_triple(small, exact_small) is exact_small


def test_the_training_forward_divides_by_the_same_bits_whether_or_not_the_bound_was_kept():
    """With bound keeping every k steps (lipschitz_every_steps), a training forward must not depend on whether a
    certified norm was computed since the last optimizer step (a resumed run keeps it at other steps than the
    uninterrupted one): the bound reads the verified triple, the forward the estimate, and the bound covers the
    matrix the forward uses; in eval mode the forward divides by the verified triple."""
    from lipsformer.layers.normalized import NormalizedLinear
    from lipsformer.layers.spectral import top_singular_triple
    from lipsformer.lipschitz.registry import module_bound

    torch.manual_seed(0)
    a = NormalizedLinear(160, 300).train()
    b = NormalizedLinear(160, 300).train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 160)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b)]
    for step in range(3):
        outs = []
        for m, opt in zip((a, b), opts):
            if m is a:  # the bound kept after a's steps only
                bound = module_bound(m).lip
                used = float(torch.linalg.matrix_norm(m.weight.detach().double(), ord=2))
                assert used <= bound <= 1 + 1e-6
            out = m(x)
            outs.append(out)
            out.square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(outs[0], outs[1]), step
    a.eval()
    a(x)
    assert torch.equal(a._divisor_cache[2][0], top_singular_triple(a.raw_weight)[0])  # the verified sigma, float64
