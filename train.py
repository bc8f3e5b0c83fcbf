"""Train a LipsFormer with the paper's no-warmup recipe.

    accelerate launch train.py --config configs/lipsformer_cswin_t.yaml --data-dir /data/imagenet
    python train.py --config configs/demo_digits.yaml --set epochs=5 lr=1e-3
    python train.py --config ... --output-dir output/run --resume auto

Exit codes: 0 done; 1 a runtime fault; 2 bad input (config, data, a checkpoint that cannot be used); 3 stopped
(divergence, unreadable data, a failed write); 75 preempted (SIGTERM or SIGUSR1: the step in progress was finished
and checkpointed; requeue the job with --resume auto; examples/slurm/ does).
"""
import argparse
import sys

from accelerate import PartialState

from lipsformer.data import TransformError
from lipsformer.engine.checkpoint import SaveFailed
from lipsformer.engine.config import ConfigError, load_config
from lipsformer.engine.processes import ends_processes
from lipsformer.engine.finetune import WeightsUnavailable
from lipsformer.engine.train import Preempted, TooManyBadSamples, TrainingDiverged, train
from lipsformer.lipschitz.constraints import BoundUnreachable
from lipsformer.weights import CheckpointError

PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, try again; the batch scripts requeue on it


@ends_processes
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Train a LipsFormer (Accelerate; no warmup).")
    parser.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--data-dir", help="folder with train/ and val/ (sets data_dir)")
    parser.add_argument("--output-dir", help="where checkpoints, metrics and curves go (sets output_dir)")
    parser.add_argument("--resume", help="'auto' (newest checkpoint in the output folder) or a checkpoint folder")
    parser.add_argument("--lipschitz-target", type=float,
                        help="keep the certified network bound under this value (sets lipschitz_target)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set lr=1e-3 epochs=10")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.data_dir:
        overrides.append(f"data_dir={args.data_dir}")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    if args.lipschitz_target is not None:
        overrides.append(f"lipschitz_target={args.lipschitz_target}")
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        summary = train(cfg, resume=args.resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, FileNotFoundError) as e:  # a checkpoint to resume from that cannot be used
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WeightsUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (TrainingDiverged, TooManyBadSamples, FileExistsError, BoundUnreachable, SaveFailed) as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except TransformError as e:  # a bug in the augmentation, not a bad image: nothing after the last checkpoint
        print(f"stopped: {e.line}; the newest checkpoint is the last one written before it", file=sys.stderr)
        return 3
    except Preempted as e:
        if PartialState().is_main_process:
            print(f"preempted: {e} (exit code {PREEMPTED}: requeue)", file=sys.stderr)
        return PREEMPTED
    if PartialState().is_main_process:  # one line for the run, not one per process
        print(f"done: {summary['epochs']} epochs, {summary['step']} steps | best top-1 {summary['best_top1']:.2f}% "
              f"({summary['best']}) | last weights {summary['last']} | last checkpoint {summary['checkpoint']} | "
              f"curves {summary['curves']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
