"""Evaluate a LipsFormer on ImageNet val, ImageNet-ReaL or ImageNet-v2.

    python eval.py --model lipsformer_swin_t --pretrained --data-dir /data/imagenet --dataset imagenet
    python eval.py --model lipsformer_swin_t --checkpoint output/run --use-ema --data-dir /data/imagenet \\
        --dataset imagenet_real --real-labels real.json --predictions preds.csv --output results.json
    accelerate launch eval.py ... (every image is counted once across processes)
"""
import argparse
import json
import os
import sys

from lipsformer.data import EVAL_DATASETS
from lipsformer.engine.config import ConfigError
from lipsformer.engine.evaluate import DEFAULT_MAX_BAD_FRACTION, TooManyBadSamples, evaluate_model, \
    write_predictions
from lipsformer.weights import CheckpointError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate a LipsFormer on ImageNet val, ReaL or v2.")
    parser.add_argument("--model", help="registered model name (optional when the checkpoint's config names it)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="weight file, train.py output folder, or exported folder")
    source.add_argument("--pretrained", action="store_true", help="the model's published weights (timm)")
    parser.add_argument("--data-dir", required=True,
                        help="imagenet / imagenet_real: the val folder (or its parent); imagenet_v2: folders 0..999")
    parser.add_argument("--dataset", default="imagenet", choices=EVAL_DATASETS)
    parser.add_argument("--real-labels", help="ReaL labels (real.json), for --dataset imagenet_real")
    parser.add_argument("--predictions", help="write one CSV row per image: path, targets, top-5 and probabilities")
    parser.add_argument("--output", help="write the results as JSON")
    parser.add_argument("--use-ema", action="store_true", help="evaluate the checkpoint's EMA weights")
    parser.add_argument("--batch-size", type=int, default=100, help="per process")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="loader workers per process")
    parser.add_argument("--amp", nargs="?", const="bf16", default="no", choices=("bf16", "fp16"),
                        help="mixed precision (bf16 unless fp16 is given)")
    parser.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                        help="unreadable images are skipped and counted; stop when more than this fraction "
                             "fails (training's max_bad_fraction rule)")
    parser.add_argument("--model-args", type=json.loads, default={}, metavar="JSON",
                        help='model arguments for a checkpoint without a config, e.g. \'{"img_size": 32}\'')
    args = parser.parse_args(argv)
    if not args.model and args.pretrained:
        parser.error("--pretrained needs --model")
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        parser.error(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}")
    try:
        result, samples = evaluate_model(
            args.model, args.data_dir, args.dataset, checkpoint=args.checkpoint, pretrained=args.pretrained,
            real_labels=args.real_labels, use_ema=args.use_ema, batch_size=args.batch_size, amp=args.amp,
            workers=args.workers, model_args=args.model_args, max_bad_fraction=args.max_bad_fraction)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:  # bad input: one line naming what to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TooManyBadSamples as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    classes, probs = result.pop("classes"), result.pop("probs")
    if not result.pop("is_main_process"):
        return 0
    excluded = f", {result['excluded']} without ReaL labels left out" if result["excluded"] else ""
    if result["unreadable"]:
        excluded += f", {result['unreadable']} unreadable skipped"
    print(f"{result['model']} on {args.data_dir} ({result['dataset']}): top-1 {result['top1']:.3f}%  top-5 {result['top5']:.3f}%  "
          f"({result['count']} of {result['images']} images scored{excluded}; {result['seconds']:.1f} s, "
          f"{result['img_per_s']:.1f} img/s, {result['processes']} process(es))")
    if args.predictions:
        write_predictions(args.predictions, samples, classes, probs)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(result, data_dir=args.data_dir), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
