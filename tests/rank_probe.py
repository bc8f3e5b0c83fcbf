"""Run under torchrun: build the loaders exactly as train.py does and write, per rank, which samples it drew.

Each sample's image is replaced by its dataset index, so the batches say where they came from.
"""
import json
import sys
from pathlib import Path

import torch

from lipsformer.data.datasets import SafeImageDataset
from lipsformer.config import load_config
from lipsformer.build import build_model
from lipsformer.engine.train import build_loaders, create_accelerator

SafeImageDataset.__getitem__ = lambda self, index: (torch.tensor(index), 0, "")

cfg = load_config(sys.argv[1])
accelerator = create_accelerator(cfg)
train_loader, val_loader, _ = build_loaders(cfg, build_model(cfg.model, **cfg.model_args()).model, accelerator)
drawn = {}
for epoch in range(2):
    train_loader.set_epoch(epoch)
    drawn[f"train_{epoch}"] = [i for images, _, _ in train_loader for i in images.tolist()]
drawn["val"] = [i for images, _, _ in val_loader for i in images.tolist()]
drawn["world_size"] = accelerator.num_processes
Path(sys.argv[2], f"rank_{accelerator.process_index}.json").write_text(json.dumps(drawn))
accelerator.end_training()  # the group destroyed before exit (see lipsformer.engine.processes)
