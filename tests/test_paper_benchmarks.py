"""The papers' experiments of benchmarks/paper/ (Table 3 in miniature, Kim et al. Fig. 2 / Fig. 3, AttLip Fig. 1)
on tiny settings, and the warmup schedule the ablation's warmup row relies on."""
import json
from pathlib import Path

import pytest
import torch
from conftest import load_script, reset_accelerate

ROOT = Path(__file__).resolve().parents[1]


def _bench(name):
    return load_script(f"benchmarks/paper/{name}.py")


@pytest.fixture
def digits(tmp_path):
    """A tiny 10-class image folder shaped like the digits data (32 px): 2 train and 1 val image per class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 2), ("val", 1)):
        for c in range(10):
            d = tmp_path / "digits" / split / f"{c}"
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray((rng.random((32, 32, 3)) * 25 * (c + 1)).astype(np.uint8)).save(d / f"{i}.png")
    return tmp_path / "digits"


def test_ablation_rows_are_table_3_and_runs_report_outcomes(tmp_path, digits):
    ablation = _bench("ablation")
    names = [r.name for r in ablation.ROWS]
    assert {"norm=layer", "norm=none", "attn=dot", "attn=l2", "init=xavier", "init=trunc_normal", "alpha=0.1",
            "alpha=0.3", "alpha=0.4", "conv=A", "conv=B", "conv=C", "drop_path=0.0", "drop_path=0.1",
            "warmup=5%", "default"} == set(names)
    assert [r.name for r in ablation.ROWS if r.paper_fails] == ["norm=layer", "attn=dot", "alpha=0.4"]
    out = tmp_path / "abl"
    summary = ablation.main(["--rows", "default", "warmup=5%", "alpha=0.4", "--epochs", "2", "--seeds", "2",
                             "--depths", "1", "1", "1", "1", "--embed-dim", "8", "--batch", "8", "--data", str(digits),
                             "--out", str(out), "--converge-loss", "2.2"])
    runs = summary["runs"]
    assert [(r["row"], r["seed"]) for r in runs] == [("default", 0), ("default", 1), ("warmup=5%", 0),
                                                    ("alpha=0.4", 0), ("alpha=0.4", 1)]
    assert runs[2]["train"]["warmup_epochs"] == 1 and runs[0]["train"] == {}
    assert runs[3]["model"] == {"alpha_init": 0.4}
    for r in runs:
        assert r["status"] in ("ok", "not converged", "diverged") and r["loss"]
        assert (r["status"] == "ok") == (r["final_train_loss"] < 2.2)
        if r["status"] == "ok":
            assert 0 <= r["top1"] <= 100
    assert json.loads((out / "ablation.json").read_text())["settings"]["depths"] == [1, 1, 1, 1]
    assert (out / "ablation.png").stat().st_size > 0
    # a blown-up run is classified as diverged
    blown = ablation.main(["--rows", "attn=dot", "--quick", "--quick-epochs", "1", "--depths", "1", "1", "1", "1",
                           "--embed-dim", "8", "--batch", "8", "--lr", "1e4", "--data", str(digits),
                           "--out", str(tmp_path / "b")])
    assert blown["runs"][0]["status"] == "diverged"
    with pytest.raises(SystemExit):  # argparse's one line: --jobs must be at least 1
        ablation.main(["--jobs", "0", "--data", str(digits)])


def test_warmup_ramps_as_timm_cosine_scheduler_does(tmp_path, digits):
    """train.py's per-step lr with warmup_epochs = 2 equals timm's CosineLRScheduler stepped per update."""
    from timm.scheduler import CosineLRScheduler

    from lipsformer.config import load_config
    from lipsformer.engine.train import train

    cfg = load_config(ROOT / "configs" / "demo_digits.yaml", [
        f"data_dir={digits}", f"output_dir={tmp_path / 'run'}", "epochs=4", "warmup_epochs=2", "lr=1e-2",
        "min_lr=1e-4", "batch_size=4", "global_batch=4", "log_every_steps=1", "checkpoint_every_steps=1000",
        "model_kwargs={embed_dim: 8, depths: [1, 1, 1, 1], num_heads: [1, 1, 1, 1], window_size: 4}"])
    try:
        train(cfg)
    finally:
        reset_accelerate()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in logged if m["kind"] == "train"}
    per_epoch = max(lrs) // 4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    timm_sched = CosineLRScheduler(opt, t_initial=4 * per_epoch, lr_min=cfg.min_lr, warmup_t=2 * per_epoch,
                                   warmup_lr_init=cfg.min_lr, t_in_epochs=False)
    expected = {}
    for step in lrs:
        timm_sched.step_update(step)
        expected[step] = opt.param_groups[0]["lr"]
    assert lrs == pytest.approx(expected, rel=1e-9)
    # linear from min_lr towards lr over the warmup steps; then timm (warmup_prefix=False) goes on with the cosine
    # at step warmup_t, which has already decayed during the warmup: lr itself is never reached
    warm = 2 * per_epoch
    for step in range(1, warm):
        assert lrs[step] == pytest.approx(cfg.min_lr + step * (cfg.lr - cfg.min_lr) / warm)
    assert lrs[warm] < lrs[warm - 1]


def test_invertibility_l2_reconstructs_and_dot_product_does_not(tmp_path):
    """Kim et al. Fig. 3 at reduced size: with one token at 0 and the others spread wide, the fixed-point iteration
    inverts x + c L2-MHA(x) to rounding and stalls for dot-product attention; the contractive form is certified."""
    inv = _bench("invertibility")
    summary = inv.main(["--n", "16", "--dim", "16", "--heads", "2", "--batch", "8", "--iters", "30",
                        "--out", str(tmp_path)])
    final = {(r["layer"], r["c"]): r["errors"][-1] for r in summary["runs"]}
    for c in inv.CS:
        assert final["L2-MHA", c] < 1e-10 and final["Contractive-L2-MHA", c] < 1e-10
        assert final["DP-MHA", c] > 1e-2
    for r in summary["runs"]:
        assert len(r["errors"]) == 30
        if r["layer"] == "Contractive-L2-MHA":
            assert r["certified_lip"] == pytest.approx(r["c"]) and r["invert_error_l2"] <= 1e-10
    assert (tmp_path / "invertibility.png").stat().st_size > 0


def test_kim_tightness_jacobian_is_exact_and_lower_bound_stays_under_theorem_3_2(tmp_path):
    from torch.func import jacrev

    from lipsformer.layers.attention import KimL2Attention

    kt = _bench("kim_tightness")
    attn = KimL2Attention(1, 1, fused=False).double()
    for m in (attn.q, attn.v, attn.proj):
        torch.nn.init.ones_(m.weight)
    x = torch.randn(7, dtype=torch.double) * 3
    exact = jacrev(lambda z: attn(z.view(1, 7, 1)).view(7))(x)
    assert torch.allclose(kt.scalar_l2_jacobian(x[None])[0], exact, atol=1e-12)
    summary = kt.main(["--ns", "8", "32", "--inits", "4", "--steps", "40", "--top", "2", "--out", str(tmp_path)])
    for r in summary["rows"]:
        assert 1.0 < r["lower"] <= r["upper"] and len(r["lower_top"]) == 2
    assert summary["rows"][1]["lower"] > summary["rows"][0]["lower"]  # grows with N, as the bound does
    assert (tmp_path / "kim_tightness.png").stat().st_size > 0


def test_attlip_solver_converges_linearly_at_every_n(tmp_path):
    """AttLip Fig. 1 at reduced size: the objective gap falls by orders of magnitude at a similar rate for each N."""
    summary = _bench("attlip_convergence").main(["--ns", "8", "32", "--dim", "32", "--iters", "12",
                                                 "--out", str(tmp_path)])
    for r in summary["rows"]:
        assert len(r["gap"]) == len(r["grad_norm"]) == 13
        assert min(r["gap"]) >= 0 and r["gap"][12] < 1e-3 * r["gap"][0]
        assert r["grad_norm"][12] < 1e-2 * r["grad_norm"][0]
        assert 0 < r["rate"] < 0.7
    assert (tmp_path / "attlip_convergence.png").stat().st_size > 0
