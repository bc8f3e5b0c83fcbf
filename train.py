"""Train a LipsFormer with the paper's no-warmup recipe.

    accelerate launch train.py --config configs/lipsformer_cswin_t.yaml --data-dir /data/imagenet
    python train.py --config configs/demo_digits.yaml --set epochs=5 lr=1e-3
    python train.py --config ... --output-dir output/run --resume auto
    python train.py --list-keys      (every config key with its type, default and meaning)

A preemption signal (SIGTERM or SIGUSR1) finishes and checkpoints the step in progress and exits 75: requeue the
job with --resume auto (examples/slurm/ does).
"""
import sys

from lipsformer.cli import ArgumentParser, command, data_path, is_main_process, path
from lipsformer.writer import output_folder
from lipsformer.config import describe_keys, load_config
from lipsformer.engine.train import train

# The options that set a config key, and the key each sets.
FLAG_KEYS = {"--data-dir": "data_dir", "--output-dir": "output_dir", "--lipschitz-target": "lipschitz_target"}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="train.py", description=__doc__)
    parser.add_argument("--config", type=path, help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--data-dir", type=data_path, help="folder with train/ and val/ (sets data_dir)")
    parser.add_argument("--output-dir", type=output_folder,
                        help="where checkpoints, metrics and curves go (sets output_dir)")
    parser.add_argument("--resume", type=path,
                        help="'auto' (newest checkpoint in the output folder) or a checkpoint folder")
    parser.add_argument("--lipschitz-target", type=float,
                        help="keep the certified network bound under this value (sets lipschitz_target)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set lr=1e-3 epochs=10 model_kwargs.depths=1,1,2,1 "
                             "(--list-keys lists them)")
    parser.add_argument("--list-keys", action="store_true",
                        help="print every config key with its type, default and meaning, and exit")
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "list_keys"):
            parser.ignored_unless(max(action.option_strings, key=len), "is ignored with --list-keys (it prints the "
                                  "keys and exits)", lambda args: not args.list_keys)
    return parser


def config_from_args(args):
    """The run's TrainConfig: ``--config``, then ``--set``, then the options that set a key (:data:`FLAG_KEYS`)."""
    flags = {key: (flag, getattr(args, key)) for flag, key in FLAG_KEYS.items()}
    return load_config(args.config, args.set, flags)


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_keys:
        print(describe_keys())
        return 0
    cfg = config_from_args(args)
    summary = train(cfg, resume=args.resume)
    if not is_main_process():  # one line for the run, not one per process
        return 0
    if summary.get("finished_before"):
        print(f"done already: {summary['output_dir']} finished its {summary['epochs']} epochs at step "
              f"{summary['step']} (checkpoint {summary['checkpoint']}, last weights {summary['last']}); nothing to "
              f"resume, nothing written. To train further, start a new run from its weights: --set "
              f"init_checkpoint={summary['output_dir']} output_dir=NEW_FOLDER")
        return 0
    print(f"done: {summary['epochs']} epochs, {summary['step']} steps | best top-1 {summary['best_top1']:.2f}% "
          f"({summary['best']}) | last weights {summary['last']} | last checkpoint {summary['checkpoint']} | "
          f"curves {summary['curves']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
