"""Run under torchrun: train.py's loop with Accelerate's FSDP2 on CPU processes (gloo).

Accelerate turns FSDP on for accelerators only, so this forces its state to FSDP (version 2, sharded state dicts)
before anything is prepared; everything after that is the loop's own FSDP path.

    torchrun --nproc_per_node 2 tests/fsdp_train.py CONFIG [--resume CHECKPOINT]
"""
import argparse

from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import lipsformer.engine.train as loop
from lipsformer.engine.config import load_config

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("--resume")
args = parser.parse_args()
create_accelerator = loop.create_accelerator


def fsdp2_accelerator(cfg):
    accelerator = create_accelerator(cfg)
    for state in (accelerator.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                   state_dict_type="SHARDED_STATE_DICT")
    return accelerator


loop.create_accelerator = fsdp2_accelerator
loop.train(load_config(args.config), resume=args.resume)
