"""train.py: config validation, a step on folder data, exact resume, bad images, divergence, two processes."""
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from conftest import reset_accelerate
from helpers import (ROOT, TINY_MODEL, TINY_RUN, TRAIN, call, make_folder, make_wds,
                     read_metrics, torchrun, write_config)

from lipsformer.engine.checkpoint import latest_checkpoint
from lipsformer.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


# -- config -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("lrr=0.1", "unknown config key(s): lrr"),
    ("epochs=1.5", "epochs must be of type int"),
    ("lr=fast", "lr must be a number"),
    ("betas=[0.9]", "betas must be a list of 2 values"),
    ("mixed_precision=fp8", "mixed_precision must be one of"),
    ("batch_size=0", "batch_size must be at least 1"),
    ("on_nonfinite=ignore", "on_nonfinite must be one of"),
    ("ema_decay=1.0", "ema_decay must be in [0, 1)"),
])
def test_config_rejects_bad_keys_and_types_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "lipsformer_cswin_t.yaml", [override])
    assert message in str(err.value)


def test_config_file_with_unknown_key_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: lipsformer_swin_t\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(path)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_load_and_name_a_registered_model(path):
    import timm
    cfg = load_config(path)
    assert cfg.model in timm.list_models("lipsformer_*")
    assert cfg.warmup_epochs == 0


def test_paper_recipe_in_configs():
    t = load_config(ROOT / "configs" / "lipsformer_cswin_t.yaml")
    b = load_config(ROOT / "configs" / "lipsformer_swin_b.yaml")
    large = load_config(ROOT / "configs" / "lipsformer_swin_l.yaml")
    assert (t.lr, t.weight_decay, t.ema_decay, t.drop_path, t.global_batch, t.epochs) == \
        (2e-3, 0.05, 0.99984, 0.2, 2048, 300)
    assert (b.lr, b.weight_decay, b.ema_decay, b.drop_path) == (1e-3, 0.1, 0.99992, 0.5)
    assert large.betas == (0.9, 0.99)
    assert (t.label_smoothing, t.mixup, t.cutmix, t.aa, t.reprob) == (0.1, 0.8, 1.0, "rand-m9-mstd0.5-inc1", 0.25)


def test_accumulation_is_derived_from_global_batch():
    cfg = load_config(None, ["global_batch=2048", "batch_size=128"])
    assert cfg.accumulation_steps(8) == 2 and cfg.accumulation_steps(16) == 1
    with pytest.raises(ConfigError, match="not a multiple"):
        cfg.accumulation_steps(3)


def test_an_epochs_short_last_accumulation_window_updates_with_its_batches_mean_gradient():
    """3 batches an epoch, 2 accumulated per update: the second update holds one batch, and (as in timm's train.py)
    its gradient is that batch's own, not half of it. SGD at lr 1 makes the update the gradient itself."""
    from types import SimpleNamespace
    from accelerate import Accelerator
    from lipsformer.engine.step import StepTally
    from lipsformer.engine.train import _train_step
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(6, 5), torch.randint(0, 3, (6,)))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(5, 3)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                                   torch.utils.data.DataLoader(data, batch_size=2))
    run = SimpleNamespace(accelerator=accelerator, model=model, mixup=None, optimizer=optimizer,
                          criterion=torch.nn.functional.cross_entropy, cfg=SimpleNamespace(clip_grad=None),
                          state=SimpleNamespace(batch_in_epoch=0))
    meter = SimpleNamespace(tally=StepTally("cpu", window=4))
    for images, targets in loader:
        before = [p.detach().clone() for p in model.parameters()]
        _train_step(run, meter, images, targets, epoch=0)
        run.state.batch_in_epoch += 1
    assert meter.tally.updates == 2
    last = torch.nn.Linear(5, 3)
    last.load_state_dict(dict(zip(("weight", "bias"), before)))
    torch.nn.functional.cross_entropy(last(images), targets).backward()
    for p, q, b in zip(model.parameters(), last.parameters(), before):
        torch.testing.assert_close(b - p.detach(), q.grad)


# -- the loop ------------------------------------------------------------------------------------------
def test_one_epoch_on_folder_data_steps_the_optimizer_and_writes_everything(tmp_path):
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=1"])
    summary = train(cfg)
    run = Path(cfg.output_dir)
    assert summary["step"] == 6  # 24 images / batch 4
    assert {"config.yaml", "metrics.jsonl", "curves.png", "last.safetensors", "last_ema.safetensors",
            "best.safetensors"} <= {p.name for p in run.iterdir()}
    assert yaml.safe_load((run / "config.yaml").read_text())["lr"] == 1e-3
    epoch = [r for r in read_metrics(run) if r["kind"] == "epoch"][0]
    assert epoch["val_count"] == 11 and epoch["bad_samples"] == 0
    assert any(run.rglob("events.out.tfevents*"))
    assert latest_checkpoint(run).name == "step_000000006"
    assert len(list((run / "checkpoints").iterdir())) == 2  # keep_last
    weights = load_file(str(run / "last.safetensors"))
    import timm
    fresh = timm.create_model("lipsformer_swin_t", num_classes=4, img_size=32, **TINY_RUN["model_kwargs"])
    assert not torch.equal(weights["head.fc.weight"], fresh.state_dict()["head.fc.weight"])
    ema = load_file(str(run / "last_ema.safetensors"))  # the average, not the last weights
    assert ema.keys() == weights.keys() and not torch.equal(ema["head.fc.weight"], weights["head.fc.weight"])

    # LipsFormer Figure 5: per-stage |alpha| statistics in the epoch row equal those of the saved weights
    for i in range(4):
        alphas = torch.cat([v.abs().flatten() for k, v in weights.items()
                            if k.startswith(f"stages.{i}.") and k.endswith(".alpha")])
        assert alphas.numel() == 4 * 16 * 2 ** i  # conv res1, res2, attention, MLP: one alpha per channel each
        assert epoch[f"alpha_mean_s{i}"] == pytest.approx(alphas.mean().item(), rel=1e-6)
        assert epoch[f"alpha_std_s{i}"] == pytest.approx(alphas.std(correction=0).item(), rel=1e-5)
    assert epoch["alpha_std_s0"] > 0  # trained: no longer the constant 1/L
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(next(run.rglob("events.out.tfevents*")))).Reload()
    assert {"epoch/alpha_mean_s3", "epoch/alpha_std_s3"} <= set(events.Tags()["scalars"])


def test_existing_run_is_not_overwritten_without_resume(tmp_path):
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=1"])
    train(cfg)
    before = (Path(cfg.output_dir) / "last.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="--resume auto"):
        train(cfg)
    assert (Path(cfg.output_dir) / "last.safetensors").read_bytes() == before


def _draw_from_every_rng(img):
    """A transform that draws from the three RNGs timm's augmentations use."""
    return torch.rand(3), random.random(), float(np.random.rand())


def test_sample_augmentation_is_drawn_from_its_own_seed_in_workers_and_in_process(tmp_path):
    """Sample i of epoch e is augmented from torch / random / numpy seeded with (seed, e, i), the same seed as ever
    (so the same tensors), in a loader worker as in the main process; the main process's RNGs come back as they
    were, so the model's draws (DropPath, mixup) do not depend on the data."""
    from lipsformer.data import SafeImageDataset, create_dataset
    ds = create_dataset("", str(make_folder(tmp_path)), "train", _draw_from_every_rng, seed=3)
    assert isinstance(ds, SafeImageDataset)
    ds.set_epoch(1)
    assert ds.sample_seed(5) == ((3 * 1_000_003 + 1) * 10_000_019 + 5) % 2 ** 32  # fixed, so a resume draws alike

    def expected(i):
        seed = ds.sample_seed(i)
        torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
        return _draw_from_every_rng(None)

    want = [expected(i) for i in range(len(ds))]
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()
    in_process = [ds[i][0] for i in range(len(ds))]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), before[2]))
    in_workers = [s[0] for s in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)]
    for got in (in_process, in_workers):
        assert len(got) == len(want)
        for (t, r, n), (wt, wr, wn) in zip(got, want):
            assert torch.equal(t, wt) and r == wr and n == wn


def test_half_written_checkpoint_is_ignored(tmp_path):
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=1"])
    train(cfg)
    ckpts = Path(cfg.output_dir) / "checkpoints"
    shutil.copytree(latest_checkpoint(cfg.output_dir), ckpts / ".tmp-step_000000099")
    assert latest_checkpoint(cfg.output_dir).name == "step_000000006"


def test_corrupt_and_empty_images_are_skipped_counted_and_limited(tmp_path):
    from lipsformer.engine.train import TooManyBadSamples, train
    config = write_config(tmp_path)
    data = Path(load_config(config).data_dir)
    (data / "train" / "class_0" / "0.jpg").write_bytes(b"")  # zero-byte
    good = (data / "train" / "class_1" / "0.jpg").read_bytes()
    (data / "train" / "class_1" / "0.jpg").write_bytes(good[: len(good) // 3])  # truncated JPEG
    cfg = load_config(config, ["epochs=1", "max_bad_fraction=0.1"])
    train(cfg)
    epoch = [r for r in read_metrics(Path(cfg.output_dir)) if r["kind"] == "epoch"][0]
    assert epoch["bad_samples"] == 2

    reset_accelerate()
    strict = load_config(config, ["epochs=1", "max_bad_fraction=0.01", f"output_dir={tmp_path / 'strict'}"])
    with pytest.raises(TooManyBadSamples, match=r"2 of 24 images failed.*class_[01]/0\.jpg"):
        train(strict)


def test_non_finite_loss_stops_and_last_good_checkpoint_loads(tmp_path, capsys):
    config = write_config(tmp_path, epochs=3, lr=1e30, checkpoint_every_steps=1, mixup=0.0, cutmix=0.0,
                          label_smoothing=0.0)
    run = tmp_path / "run"
    code, _, err = call(capsys, TRAIN.main, ["--config", config])
    assert code == 3, err[-2000:]
    assert "non-finite" in err and "last good checkpoint" in err
    good = latest_checkpoint(run)
    assert good is not None and str(good) in err
    weights = load_file(str(good / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_non_finite_steps_can_be_skipped_and_counted(tmp_path, capsys):
    """Skipped steps are counted; an epoch with no finite batch loss reports its training loss as null with the
    reason (metrics.jsonl's step and epoch rows, an empty summary.csv cell, ``n/a`` on the console), not 0."""
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=2", "lr=1e30", "on_nonfinite=skip", "mixup=0", "cutmix=0"])
    summary = train(cfg)  # the first step blows the logits up; every later loss is non-finite and skipped
    rows = read_metrics(Path(cfg.output_dir))
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert summary["skipped_steps"] == epochs[1]["skipped_steps"] == 11 and epochs[0]["skipped_steps"] == 5
    assert summary["step"] == 12
    reason = "no finite batch loss in the epoch so far"
    assert epochs[0]["train_loss"] > 0 and "train_loss_reason" not in epochs[0]  # its first batch was finite
    assert (epochs[1]["train_loss"], epochs[1]["train_loss_reason"]) == (None, reason)
    steps = [r for r in rows if r["kind"] == "train" and r["epoch"] == 2]
    assert len(steps) == 6 and all((r["loss"], r["loss_reason"]) == (None, reason) for r in steps)
    assert (Path(cfg.output_dir) / "summary.csv").read_text().splitlines()[2].split(",")[:2] == ["2", ""]
    said = capsys.readouterr().out
    assert "epoch 2/2 step 12 (6/6 batches): loss n/a, lr" in said and "loss 0.0000" not in said


def test_each_rank_draws_different_samples_every_epoch(tmp_path):
    config = write_config(tmp_path, global_batch=4, batch_size=2)
    torchrun(ROOT / "tests" / "rank_probe.py", config, tmp_path)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in ("train_0", "train_1"):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert len(a) == len(b) == 12
        assert not set(a) & set(b)  # disjoint ...
        assert sorted(a + b) == list(range(24))  # ... and together every training image once
    assert ranks[0]["train_0"] != ranks[0]["train_1"]  # reshuffled each epoch
    val = ranks[0]["val"] + ranks[1]["val"]
    assert set(val) == set(range(11)) and len(val) == 12  # 11 images: one padded repeat, dropped when scored


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "resnet10t"])  # resnet10t: BatchNorm buffers
def test_ema_follows_timm_model_ema_v3_and_refuses_another_model(name):
    import timm
    from timm.utils import ModelEmaV3
    from lipsformer.engine.ema import ShardEma
    model = timm.create_model(name, num_classes=4, **(TINY_MODEL if name.startswith("lipsformer") else {}))
    ours, theirs = ShardEma(model, 0.9), ModelEmaV3(model, decay=0.9)
    x = torch.randn(2, 3, 32, 32)
    for step in range(1, 4):
        with torch.no_grad():
            model.train()(x)  # moves BatchNorm statistics
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ours.update(model, step)
        theirs.update(model, step=step)
    expected = [*theirs.module.parameters(), *(b for b in theirs.module.buffers() if b.is_floating_point())]
    assert len(ours.average) == len(expected) and all(torch.equal(a, b) for a, b in zip(ours.average, expected))
    weights = [p.clone() for p in model.parameters()]
    model.eval()
    with ours.applied(model):
        assert torch.equal(model(x), theirs.module(x))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # own weights restored
    other = timm.create_model(name, num_classes=5, **(TINY_MODEL if name.startswith("lipsformer") else {}))
    with pytest.raises(ValueError, match="no longer match"):
        ours.update(other, 4)
    with pytest.raises(ValueError, match="does not match"):
        ShardEma(other, 0.9).load_state_dict(ours.state_dict())


def test_ema_of_fsdp_shards_matches_the_whole_model_ema(tmp_path):
    """FSDP2 (``fully_shard``) on two CPU processes: Accelerate runs FSDP on GPUs only, so the EMA's sharded
    path is checked directly against an unsharded twin (see tests/fsdp_ema_probe.py)."""
    torchrun(ROOT / "tests" / "fsdp_ema_probe.py", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == ["rank_0.ok", "rank_1.ok"]


def test_two_processes_split_the_data_count_val_once_and_log_the_whole_runs_loss(tmp_path):
    """train.py on 2 processes whose batch losses differ (process r's are r + 1: tests/train_probe.py
    ``--rank-loss``): every logged training loss is the mean over both processes' batches, 1.5, not the main
    process's 1.0; the counts are every process's."""
    config = write_config(tmp_path, epochs=1, global_batch=4, batch_size=2, max_bad_fraction=0.1, log_every_steps=2)
    broken = tmp_path / "data" / "train" / "class_1" / "0.jpg"  # read by one of the processes
    broken.write_bytes(b"not an image")
    run = tmp_path / "run"
    said = torchrun(ROOT / "tests" / "train_probe.py", "--rank-loss", "--", "--config", config)
    rows = read_metrics(run)
    losses = [r["loss"] for r in rows if r["kind"] == "train"] + [r["train_loss"] for r in rows if r["kind"] == "epoch"]
    assert len(losses) == 4 and losses == [pytest.approx(1.5)] * 4, losses
    assert "loss 1.5000" in said  # the plain progress line
    # one line per event across processes, per-process facts gathered (the other process printed its own
    # "done:" and "1 of 24 images could not be read, e.g. []")
    assert said.count("done: ") == 1
    bad = [line for line in said.splitlines() if "images could not be read" in line]
    assert len(bad) == 1 and "epoch 1: 1 of 24 images could not be read" in bad[0] and str(broken) in bad[0], bad
    epoch = [r for r in read_metrics(run) if r["kind"] == "epoch"][0]
    assert epoch["processes"] == 2 and epoch["bad_samples"] == 1
    assert epoch["val_count"] == 11  # odd: the padded duplicate is not counted
    assert epoch["train_samples"] == 24  # 2 processes x 6 batches x 2 images: every image once
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000004", "step_000000006"]
    assert len(list((run / "checkpoints" / "step_000000006").glob("random_states_*.pkl"))) == 2  # one per rank
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("source", ["hfds", "wds"])
def test_hugging_face_and_webdataset_sources_train_and_evaluate_every_image(tmp_path, source):
    from lipsformer.engine.train import train
    folder = make_folder(tmp_path / "folder")
    if source == "hfds":  # a local folder through Hugging Face datasets (imagefolder: val/ becomes "validation")
        data = [f"dataset=hfds/{folder}", f"data_dir={tmp_path / 'hf_cache'}", "val_split=validation"]
    else:
        data = ["dataset=wds/tiny", f"data_dir={make_wds(folder, tmp_path / 'shards')}"]
    cfg = load_config(write_config(tmp_path), ["epochs=1", *data])
    summary = train(cfg)
    epoch = [r for r in read_metrics(Path(cfg.output_dir)) if r["kind"] == "epoch"][0]
    assert epoch["train_samples"] == 24 and summary["step"] == 6
    assert epoch["val_count"] == 11
    assert np.isfinite(epoch["train_loss"])
    # mid-epoch resume: the first batches are read again and skipped
    resumed = train(cfg, resume=str(Path(cfg.output_dir) / "checkpoints" / "step_000000004"))
    assert resumed["step"] == 6


def test_bf16_mixed_precision_trains_on_cpu_and_fp16_is_refused_there(tmp_path, capsys):
    from lipsformer.engine.train import train
    cfg = load_config(write_config(tmp_path), ["epochs=1", "mixed_precision=bf16"])
    summary = train(cfg)
    assert summary["step"] == 6 and summary["skipped_steps"] == 0
    assert all(v.dtype == torch.float32 for v in load_file(str(Path(cfg.output_dir) / "last.safetensors")).values())
    reset_accelerate()
    code, _, err = call(capsys, TRAIN.main,
                        ["--config", write_config(tmp_path / "fp16"), "--set", "mixed_precision=fp16"])
    assert code == 2 and "fp16 needs a GPU" in err
    assert not (tmp_path / "fp16" / "run").exists()  # refused before anything was written


def test_unreadable_val_images_are_counted_not_scored_under_the_training_rule(tmp_path):
    from lipsformer.engine.evaluate import TooManyBadSamples
    from lipsformer.engine.train import train
    config = write_config(tmp_path)
    (Path(load_config(config).data_dir) / "val" / "class_0" / "0.jpg").write_bytes(b"")
    cfg = load_config(config, ["epochs=1", "max_bad_fraction=0.1", "ema_decay=null"])
    train(cfg)
    epoch = [r for r in read_metrics(Path(cfg.output_dir)) if r["kind"] == "epoch"][0]
    assert (epoch["val_count"], epoch["val_bad_samples"], epoch["bad_samples"]) == (10, 1, 0)

    reset_accelerate()
    strict = load_config(config, ["epochs=1", "ema_decay=null", f"output_dir={tmp_path / 'strict'}"])
    with pytest.raises(TooManyBadSamples, match=r"validation: 1 of 11 images failed.*class_0/0\.jpg"):
        train(strict)


def test_streamed_data_receive_the_runs_seed(tmp_path):
    from lipsformer.data import create_dataset
    shards = make_wds(make_folder(tmp_path / "folder"), tmp_path / "shards")
    for seed in (3, 11):
        ds = create_dataset("wds/tiny", str(shards), "train", None, is_training=True, batch_size=4, seed=seed)
        assert ds.reader.common_seed == seed  # shard and sample shuffling (timm ReaderWds)
