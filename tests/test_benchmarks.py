"""benchmarks/throughput.py: its output, and its memory targets, which are deterministic (bytes saved
for backward do not depend on the machine's speed)."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import timm
import torch
from conftest import load_script

import lipsformer  # noqa: F401  (registers the models)
from lipsformer.flops import count_flops
from lipsformer.layers.attlip import AttLip

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_prints_a_table_and_writes_json_against_the_baseline(tmp_path, capsys):
    out = tmp_path / "speed.json"
    load_script("benchmarks/throughput.py").main(["--models", "lipsformer_swin_t", "--reps", "1", "--iters", "1",
                                                  "--batch", "2", "--train-batch", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["swin_tiny_patch4_window7_224", "lipsformer_swin_t"]
    assert [round(r["gflops"], 2) for r in rows] == [4.51, 4.98]  # fvcore, as `python -m lipsformer.flops`
    assert rows[0]["infer_ratio"] == rows[0]["train_ratio"] == 1.0
    for r in rows:
        assert r["infer_img_s"] > 0 and r["train_img_s"] > 0 and r["train_memory_mb"] > 0
        assert r["infer_gflop_s"] == pytest.approx(r["infer_img_s"] * r["gflops"])
    assert "lipsformer_swin_t" in printed and "per-FLOP" in printed


def test_training_memory_targets_at_batch_16():
    """Bytes autograd saves in a training step (224 px, fp32, CPU): <= 1.1x swin_tiny's for both families,
    <= 0.6x with gradient checkpointing."""
    train_memory = load_script("benchmarks/throughput.py").train_memory
    x = torch.randn(16, 3, 224, 224)
    mb = {}
    for name, checkpointing in (("swin_tiny_patch4_window7_224", False), ("lipsformer_swin_t", False),
                                ("lipsformer_cswin_t", False), ("lipsformer_swin_t", True)):
        model = timm.create_model(name).train()
        if checkpointing:
            model.set_grad_checkpointing(True)
        mb[name, checkpointing] = train_memory(model, x, "cpu", "no")
    base = mb["swin_tiny_patch4_window7_224", False]
    assert mb["lipsformer_swin_t", False] / base == pytest.approx(1800 / 1735, abs=0.01)  # docs/speed.md
    assert mb["lipsformer_cswin_t", False] / base == pytest.approx(1638 / 1735, abs=0.01)
    assert max(mb["lipsformer_swin_t", False], mb["lipsformer_cswin_t", False]) <= 1.1 * base
    assert mb["lipsformer_swin_t", True] <= 0.6 * base


def test_training_benchmark_prints_eager_rows_with_ratios_and_saved_bytes(tmp_path, capsys):
    """--matrix: a row per model, thread count and batch, ratios and per-FLOP ratios against the
    baseline's row of the same group, the bytes autograd saves, and the targets a row misses."""
    out = tmp_path / "matrix.json"
    load_script("benchmarks/throughput.py").main(["--matrix", "--models", "lipsformer_swin_t", "--threads", "1",
                                                  "--train-batches", "1", "2", "--reps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["threads"], r["batch"], r["model"]) for r in rows] == [
        ("eager", 1, b, m) for b in (1, 2) for m in ("swin_tiny_patch4_window7_224", "lipsformer_swin_t")]
    for base, r in (rows[0:2], rows[2:4]):
        assert base["train_ratio"] == base["saved_ratio"] == 1.0 and base["missed"] == []
        assert r["train_ratio"] == pytest.approx(r["train_img_s"] / base["train_img_s"])
        assert r["train_per_flop"] == pytest.approx(r["train_ratio"] * 4.98 / 4.51, rel=1e-3)
        assert r["infer_per_flop"] == pytest.approx(r["infer_img_s"] / base["infer_img_s"] * 4.98 / 4.51, rel=1e-3)
        assert r["saved_ratio"] == pytest.approx(r["saved_mb"] / base["saved_mb"])
        assert set(r["missed"]) == {k for k in ("train_ratio", "train_per_flop", "infer_per_flop")
                                    if r[k] < {"train_ratio": 0.9}.get(k, 1.0)} | (
            {"saved_ratio"} if r["saved_ratio"] > 1.1 else set())
    assert rows[3]["saved_mb"] > rows[1]["saved_mb"] > 0  # activations grow with the batch
    printed = capsys.readouterr().out
    assert "missed targets" in printed and printed.count("lipsformer_swin_t") == 2


def test_build_time_prints_both_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "build.json"
    assert load_script("benchmarks/build_time.py").main(["--models", "lipsformer_swin_t", "--reps", "1",
                                                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    [build], [load] = result["build"], result["load"]
    assert build["baseline"] == "swin_tiny_patch4_window7_224"
    assert (round(build["params_m"], 1), round(build["baseline_params_m"], 1)) == (30.9, 28.3)
    assert build["ratio"] == pytest.approx(build["build_s"] / build["baseline_s"])
    assert load["ratio"] == pytest.approx(load["load_s"] / load["build_read_s"])
    assert "lipsformer_swin_t" in printed and "pretrained load" in printed


def test_loader_benchmark_prints_each_loaders_rate_against_timms_and_the_seeding_cost(tmp_path):
    out = tmp_path / "loader.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loader.py"), "--data", str(tmp_path / "jpegs"),
                           "--images", "8", "--size", "64x48", "--batch", "4", "--workers", "1", "0", "--rounds", "1",
                           "--seeding-samples", "20", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(list((tmp_path / "jpegs" / "train").rglob("*.jpg"))) == result["images"] == 8
    rows = result["rows"]
    assert [(r["workers"], r["loader"]) for r in rows] == [
        (w, name) for w in (1, 0) for name in ("timm", "ours", "ours unseeded")]
    for r in rows:
        base = next(b for b in rows if b["workers"] == r["workers"] and b["loader"] == "timm")
        assert r["img_s"] > 0 and r["ratio"] == pytest.approx(r["img_s"] / base["img_s"])  # one round
    assert set(result["seeding_us"]) == {"worker", "main"}
    assert "vs timm" in proc.stdout and "per-sample seeding" in proc.stdout


def test_certified_speed_prints_each_ratio_its_floor_the_profile_and_the_solver_steps(tmp_path, capsys, monkeypatch):
    """The cswin pair at a small width and depth and 64 px (what the rows assert does not depend on the size: the
    full-size multiply-adds are fvcore's count, which tests/test_flops.py holds to the README's model table)."""
    script = load_script("benchmarks/certified_speed.py")
    create = timm.create_model
    small = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 8), split_size=(2, 2, 2, 1))
    monkeypatch.setattr(timm, "create_model", lambda name, **kwargs: create(name, **small, **kwargs))
    out = tmp_path / "cert.json"
    script.main(["--pairs", "lipsformer_cswin_t:lipsformer_cswin_t_cert", "--batch", "1", "--img-size", "64",
                 "--rounds", "1", "--train-steps", "1", "2", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    [row] = json.loads(out.read_text())["rows"]
    assert row["attlip_form"] == ["orthogonal"]  # the certifiable model's own form
    assert row["infer_ratio"] == pytest.approx(row["cert_infer_s"] / row["plain_infer_s"])
    assert row["eval_ratio"] == pytest.approx(row["cert_eval_s"] / row["plain_infer_s"])
    by_steps = row["cert_train_by_steps_s"]  # each count timed once; the schedule [1, 2, 2] averages its phases
    assert set(by_steps) == {"1", "2"} and row["train_steps"] == [1, 2, 2]
    assert row["cert_train_s"] == pytest.approx((by_steps["1"] + 2 * by_steps["2"]) / 3)
    assert row["train_ratio"] == pytest.approx(row["cert_train_s"] / row["plain_train_s"])
    assert row["train_ratio_by_steps"]["1"] == pytest.approx(by_steps["1"] / row["plain_train_s"])
    assert row["keep_bound_s"] > 0 and row["lipschitz_target"] == 1.01  # the recipe's keeping
    assert row["lipschitz_every_steps"] == 10  # the recipe's: keep_bound counted at a tenth per step
    assert row["defect"] > 0 and row["radius_cost"] == pytest.approx(2 * row["defect"] / row["lipschitz"])
    p = row["profile"]
    assert p["attlip_solve_s"] > 0 and p["attlip_check_s"] > 0 and p["attlip_other_s"] > 0
    assert p["rest_s"] == pytest.approx(p["total_s"] - p["attlip_solve_s"] - p["attlip_check_s"] - p["attlip_other_s"]
                                        - p["normalized_divisor_s"])
    model = timm.create_model("lipsformer_cswin_t_cert", img_size=64)
    assert [s["block"] for s in row["solver_steps"]] == [n for n, m in model.named_modules() if isinstance(m, AttLip)]
    assert all(1 <= s["mean_steps"] <= s["steps"] for s in row["solver_steps"])
    macs = row["gmacs_per_image"]  # counted on the calls timed; a plain forward is fvcore's count
    assert macs["plain_infer"] == pytest.approx(count_flops(timm.create_model("lipsformer_cswin_t", img_size=64),
                                                            (3, 64, 64)) / 1e9, rel=1e-3)
    assert macs["plain_train"] == pytest.approx(3 * macs["plain_infer"], rel=0.02)  # backward: twice the forward
    assert macs["cert_train"] == pytest.approx((macs["cert_train_1"] + 2 * macs["cert_train_2"]) / 3)
    assert 0 < macs["keep_bound"] / 10 < macs["cert_train"]  # kept every 10 steps: less per step than the step
    split = row["cert_infer_split"]
    assert min(split.values()) > 0 and sum(split.values()) == pytest.approx(macs["cert_infer"])
    assert row["floor"] == pytest.approx(dict(infer=macs["cert_infer"] / macs["plain_infer"],
                                              eval=macs["cert_eval"] / macs["plain_infer"],
                                              train=macs["cert_train"] / macs["plain_train"]))
    assert "lipsformer_cswin_t_cert" in printed and "gradient evaluations per AttLip block" in printed
    assert "multiply-adds per image" in printed and "ratio (floor)" in printed


@pytest.mark.parametrize("args", [["--train-steps", "0"], ["--pairs", "lipsformer_swin_t"],
                                  ["--lipschitz-every-steps", "0"]])
def test_certified_speed_refuses_settings_it_cannot_time_in_one_line(args, capsys):
    with pytest.raises(SystemExit) as stop:
        load_script("benchmarks/certified_speed.py").main(args)
    assert stop.value.code == 2
    assert f"error: {args[0]} takes" in capsys.readouterr().err.strip().splitlines()[-1]


def test_parts_time_each_block_part_of_each_model_against_the_baseline(tmp_path, capsys, monkeypatch):
    """--parts (the profile of the gap to the baseline): every block split into LipsFormer's conv blocks, attention and
    MLP residuals and timm Swin's attention and MLP residuals, which chained give the block's output; each part timed
    forward + backward and summed over the blocks (a clock that ticks once per reading: each timed part costs 1, so
    a part's sum is its number of blocks); a model it has no parts for, or a setting it ignores, is refused in one
    line."""
    script = load_script("benchmarks/throughput.py")
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(script, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    out = tmp_path / "parts.json"
    script.main(["--parts", "--models", "lipsformer_cswin_t", "--train-batch", "1", "--reps", "1",
                 "--json", str(out)])
    parts = json.loads(out.read_text())["parts"]
    assert parts == {"swin_tiny_patch4_window7_224": {"attention": 12e3, "mlp": 12e3},
                     "lipsformer_cswin_t": {"convs": 25e3, "attention": 25e3, "mlp": 25e3}}  # in ms: a second a part
    printed = capsys.readouterr().out
    assert "convs" in printed and "total" in printed
    for name in ("swin_tiny_patch4_window7_224", "lipsformer_swin_t"):
        model = timm.create_model(name).eval()
        for block, block_parts, inp in script.block_parts(model, torch.randn(1, 3, 224, 224))[::5]:
            y = inp
            for _, fn in block_parts:
                y = fn(y)
            torch.testing.assert_close(y.reshape(inp.shape), block(inp).reshape(inp.shape))
    with pytest.raises(SystemExit, match="--parts knows LipsFormer and timm's Swin blocks, not ResNet"):
        script.block_parts(timm.create_model("resnet18"), torch.randn(1, 3, 32, 32))
    for wrong in (["--matrix"], ["--compile"], ["--amp", "bf16"], ["--profile", "3"]):
        with pytest.raises(SystemExit) as stop:
            script.main(["--parts", *wrong])
        assert stop.value.code == 2 and "error: --parts times the eager fp32 blocks" in capsys.readouterr().err


TIMM_CHECKOUT = os.environ.get("LIPSFORMER_TIMM_CHECKOUT")


@pytest.mark.skipif(not TIMM_CHECKOUT, reason="LIPSFORMER_TIMM_CHECKOUT names no pytorch-image-models checkout")
def test_loop_benchmark_runs_train_py_and_timms_train_py_on_one_recipe(tmp_path):
    """benchmarks/loop.py's swin_t setting shrunk to a tiny model and one round of one epoch on 16 images: both
    programs train, and the printed figures are theirs (docs/speed.md names the timm commit)."""
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop.py"), "--timm", TIMM_CHECKOUT,
                           "--settings", "swin_t", "--rounds", "1", "--epochs", "1", "--images", "16",
                           "--workers", "0", "--json", str(out), "--set", "img_size=32", "model_kwargs.embed_dim=16",
                           "model_kwargs.depths=1,1,1,1", "model_kwargs.num_heads=1,2,4,8",
                           "model_kwargs.window_size=2"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["swin_t"]
    (ours,), (timm_rate,) = result["ours"], result["timm"]
    assert ours > 0 and timm_rate > 0 and result["ratio"] == pytest.approx(ours / timm_rate)
    assert [e["samples"] for p in ("ours", "timm") for e in result["epochs"][p]] == [16, 16]
    assert result["ms_per_batch"]["ours"]["step"] > 0 and result["ms_per_batch"]["timm"]["data"] > 0
    assert "swin_t" in proc.stdout and "img/s" in proc.stdout


def test_the_loop_benchmark_times_our_step_and_bookkeeping_through_the_run_phase_hook(tmp_path):
    """benchmarks/loop.py's run of train.py alone (the half that needs no timm checkout): every batch of the epoch
    is counted, and the run's ``phase`` hook gives the step and the bookkeeping after each update their own time."""
    from helpers import RUN, write_config
    config = write_config(tmp_path, **RUN)  # one epoch of 24 images in batches of 4
    result = tmp_path / "ours.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop.py"), "--worker", "ours", "--result",
                           str(result), "--threads", "1", "--", "--config", str(config)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(result.read_text())
    (epoch,) = got["epochs"]
    assert got["code"] == 0 and (epoch["batches"], epoch["samples"]) == (6, 24)
    assert epoch["step"] > 0 and epoch["after"] > 0
