"""Run under torchrun: train.py's own ``main`` (its real loop), counting per optimizer step the host reads of tensors
and the collective calls each process makes.

    torchrun --nproc_per_node 2 tests/sync_probe.py OUT_DIR [--nan-at STEP --nan-rank R] -- TRAIN.PY ARGS [-- ARGS]

Each ``--``-separated group of train.py arguments is one run, in this process, one after the other. Each process
writes ``OUT_DIR/rank_<r>.json``: per run, train.py's exit code and, per optimizer step (1-based, as train.py
counts them), the host reads (``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``bool()`` / ``float()`` / ``int()`` /
``__index__`` / formatting of a tensor: each of them waits for a GPU) and the ``torch.distributed`` collectives
(DDP's gradient all-reduce runs in its C++ reducer and is not among them; its buffer broadcast is). A step's count
runs from its first batch's ``_train_step`` (the batch fetched before it is counted with it) to the end of its
``_after_update``; what comes before an epoch's first step and after its last (evaluation, the epoch's checkpoint)
belongs to no step, and neither does torch's DataLoader iterator (sampling, and with ``workers: 0`` decoding and
collating, handle host tensors that never reach the device; Accelerate moves the batch there after it).
``--nan-at STEP --nan-rank R``: process R's images of optimizer step STEP are NaN, so its loss is not finite there.
``SYNC_PROBE_TRACE=1``: each count also records where it was made (``where``: the calling frames).
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import load_script, reset_accelerate
from torch.overrides import TorchFunctionMode
from torch.utils.data.dataloader import _BaseDataLoaderIter

import lipsformer.engine.train as loop

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
         torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__format__}
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "_broadcast_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv")
NEXT_BATCH = _BaseDataLoaderIter.__next__


class Counter(TorchFunctionMode):
    """Host reads and collectives, by the optimizer step in progress (``step``; None: outside every step)."""

    def __init__(self):
        super().__init__()
        self.step = None
        self.steps = defaultdict(lambda: dict(reads=[], collectives=[]))

    def note(self, kind: str, name: str) -> None:
        if self.step is not None:
            self.steps[self.step][kind].append(name)
            if os.environ.get("SYNC_PROBE_TRACE"):
                import traceback
                self.steps[self.step].setdefault("where", []).append(
                    name + " " + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}"
                                              for f in traceback.extract_stack()[-8:-2][::-1]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.note("reads", func.__name__)
        return func(*args, **(kwargs or {}))


def counting(nan_at: int = -1, nan_rank: int = -1) -> Counter:
    """A Counter (enter it to count host reads), with the collectives of torch.distributed counted by it and the
    loop's functions wrapped to tell it where each step begins and ends."""
    counter = Counter()
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is not None:
            def collective(*args, _real=real, _name=name, **kwargs):
                counter.note("collectives", _name)
                return _real(*args, **kwargs)
            setattr(dist, name, collective)
    one_epoch, train_step, after_update = loop.train_one_epoch, loop._train_step, loop._after_update

    def train_one_epoch(run, epoch):
        counter.step = None
        try:
            return one_epoch(run, epoch)
        finally:
            counter.step = None

    def _train_step(run, meter, images, targets, epoch):
        if counter.step is None:
            counter.step = run.state.step + 1
        if run.state.step + 1 == nan_at and run.accelerator.process_index == nan_rank:
            images = images * math.nan
        return train_step(run, meter, images, targets, epoch)

    def _after_update(run, meter, epoch, bar):
        after_update(run, meter, epoch, bar)
        last = run.state.batch_in_epoch >= len(run.train_loader)
        counter.step = None if last else run.state.step + 1

    def next_batch(self):  # torch's loader: sampling and collating host tensors that never reach the device
        step, counter.step = counter.step, None
        try:
            return NEXT_BATCH(self)
        finally:
            counter.step = step

    loop.train_one_epoch, loop._train_step, loop._after_update = train_one_epoch, _train_step, _after_update
    _BaseDataLoaderIter.__next__ = next_batch
    return counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--nan-rank", type=int, default=-1)
    split = sys.argv.index("--")
    args = parser.parse_args(sys.argv[1:split])
    runs = [[]]
    for a in sys.argv[split + 1:]:
        if a == "--":
            runs.append([])
        else:
            runs[-1].append(a)
    script = load_script("train.py")
    originals = (loop.train_one_epoch, loop._train_step, loop._after_update), {n: getattr(dist, n, None)
                                                                              for n in COLLECTIVES}
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None  # the group stays for the next run; destroyed after the last
    results = []
    for argv in runs:
        reset_accelerate()
        (loop.train_one_epoch, loop._train_step, loop._after_update), functions = originals
        for name, real in functions.items():
            if real is not None:
                setattr(dist, name, real)
        counter = counting(args.nan_at, args.nan_rank)
        with counter:
            code = script.main(argv)
        results.append(dict(exit=code, steps=counter.steps))
    Path(args.out, f"rank_{os.environ.get('RANK', 0)}.json").write_text(json.dumps(results))
    destroy()


if __name__ == "__main__":
    main()
