"""Evaluate a LipsFormer on ImageNet val, ImageNet-ReaL or ImageNet-v2.

    python eval.py --model lipsformer_swin_t --pretrained --data-dir /data/imagenet --dataset imagenet
    python eval.py --model lipsformer_swin_t --checkpoint output/run --use-ema --data-dir /data/imagenet \\
        --dataset imagenet_real --real-labels real.json --predictions preds.csv --output results.json
    python eval.py --checkpoint output/run --data-dir digits/val --dataset imagenet_v2 \\
        --certify-eps 0.1 0.25 0.5 --attack-eps 0.1 0.25 0.5 --predictions preds.csv
    python eval.py --checkpoint output/sweep --data-dir /data/imagenet --output table.csv   # each run, sorted by top-1
    python eval.py --model lipsformer_swin_t swin_tiny_patch4_window7_224 --pretrained --data-dir /data/imagenet
    accelerate launch eval.py ... (every image is counted once across processes)
"""
import os
import sys
from pathlib import Path

from lipsformer.cli import ArgumentParser, command, data_path, json_value, path
from lipsformer.data import EVAL_DATASETS
from lipsformer.engine.evaluate import DEFAULT_MAX_BAD_FRACTION, evaluate_model, percent, write_predictions
from lipsformer.engine.evaluate_many import evaluate_many, format_table, row, several
from lipsformer.lipschitz.certify import parse_eps
from lipsformer.writer import output_file, write_csv, write_json

TABLES = (".json", ".csv")  # what --output writes, by its extension
FILES = {"--predictions": ((".csv",), "name a .csv file (one row per image)"),
         "--output": (TABLES, "name a .json or .csv file (its extension says which is written)")}  # what each writes


def robustness_line(r: dict, top1: float, steps: int, restarts: int) -> str:
    """``clean X% | certified (L = ...) at eps: Y% ... | PGD-attacked at eps: Z% ...`` of one evaluation."""
    parts = [f"clean {percent(top1)}"]
    if r["certified"]:
        why = f"; nothing certifies: {r['reason']}" if r["reason"] else ""
        accs = "  ".join(f"eps {e:g}: {a:.3f}%" for e, a in r["certified"].items())
        solver = (f", AttLip solved to tolerance in at most {max(r['solver_steps'].values())} gradient evaluations "
                  f"a block" if r["solver_steps"] else "")
        rule = (f"pairwise rule, backbone L_b = {r['backbone_lipschitz']:.4g}, " if r["rule"] == "pairwise" else
                "global rule, ")
        parts.append(f"certified ({rule}L = {r['lipschitz']:.4g} in pixel space, solver defect D = {r['defect']:.3g}"
                     f"{solver}, margins in {r['margins']} whatever --amp{why}) {accs}")
        if r["rule"] == "pairwise":
            accs = "  ".join(f"eps {e:g}: {a:.3f}%" for e, a in r["certified_global"].items())
            parts.append(f"certified by the global rule margin / (sqrt(2) L) {accs}")
    if r["attacked"]:
        accs = "  ".join(f"eps {e:g}: {a:.3f}%" for e, a in r["attacked"].items())
        parts.append(f"PGD-attacked (l2, {steps} steps, {restarts} restarts) {accs}")
    return "robustness: " + " | ".join(parts)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="eval.py", description=__doc__)
    parser.add_argument("--model", nargs="+", metavar="NAME",
                        help="registered model name (optional when the checkpoint's config names it; one name builds "
                             "every --checkpoint); with --pretrained, one or more names or timm patterns, each "
                             "evaluated")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=path, nargs="+", metavar="PATH",
                        help="weight file, train.py output folder, exported folder, or a folder of runs (one whose "
                             "sub-folders are runs or exports: each is evaluated); several are scored into one table "
                             "sorted by top-1")
    source.add_argument("--pretrained", action="store_true", help="the model's published weights (timm)")
    parser.add_argument("--data-dir", type=data_path, required=True,
                        help="imagenet / imagenet_real: the val folder (or its parent); imagenet_v2: folders 0..999")
    parser.add_argument("--dataset", default="imagenet", choices=EVAL_DATASETS)
    parser.add_argument("--real-labels", type=path, help="ReaL labels (real.json), for --dataset imagenet_real")
    parser.add_argument("--predictions", type=output_file,
                        help="write one CSV row per image: path, targets, top-5 and probabilities (one evaluation)")
    parser.add_argument("--output", type=output_file,
                        help="write the results as JSON (.json; strict: a non-finite number is null, with a "
                             "KEY_reason) or as a table of one row per evaluation (.csv)")
    parser.add_argument("--use-ema", action="store_true", help="evaluate the checkpoint's EMA weights")
    parser.add_argument("--batch-size", type=int, default=100, help="per process")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="loader workers per process")
    parser.add_argument("--amp", nargs="?", const="bf16", default="no", choices=("bf16", "fp16"),
                        help="mixed precision (bf16 unless fp16 is given)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (static shapes)")
    parser.add_argument("--channels-last", action="store_true", help="NHWC convolution weights")
    parser.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION, metavar="F",
                        help="unreadable images are skipped and counted; stop when more than this fraction "
                             "fails (training's max_bad_fraction rule)")
    parser.add_argument("--model-args", type=json_value, default={}, metavar="JSON",
                        help='model arguments for a checkpoint without a config, e.g. \'{"img_size": 32}\'')
    parser.add_argument("--img-size", type=int, help="build the model for this input size and preprocess at it "
                        "(default: the size the checkpoint or its --model-args name)")
    parser.add_argument("--crop-pct", type=float, help="center-crop fraction (default: the model's config)")
    parser.add_argument("--interpolation", choices=("bilinear", "bicubic", "nearest"),
                        help="resize interpolation (default: the model's config)")
    parser.add_argument("--certify-eps", nargs="+", default=[], metavar="EPS",
                        help="certified accuracy at these l2 radii in [0, 1] pixel space, by the pairwise rule "
                             "min_j (z_c - z_j - 2 |w_c - w_j| D_b) / (|w_c - w_j| L_b) and the global rule "
                             "(margin - 2 sqrt(2) D) / (sqrt(2) L), from float32 margins whatever --amp, L from the "
                             "Lipschitz report; --predictions gets each image's certified_radius (pairwise) and "
                             "certified_radius_global")
    parser.add_argument("--attack-eps", nargs="+", default=[], metavar="EPS",
                        help="accuracy under an l2 PGD attack of these radii in [0, 1] pixel space")
    parser.add_argument("--attack-steps", type=int, default=20, help="PGD steps per restart")
    parser.add_argument("--attack-restarts", type=int, default=3, help="PGD random restarts")
    parser.examples = {"--output": "eval.json", "--predictions": "eval.csv"}  # a new file a refusal suggests
    # the flags a mode ignores (lipsformer.cli.Ignored)
    parser.ignored_unless("--real-labels", "is read only with --dataset imagenet_real",
                          lambda args: args.dataset == "imagenet_real")
    parser.ignored_unless("--use-ema", "takes a --checkpoint's EMA weights; --pretrained weights hold one set",
                          lambda args: args.checkpoint is not None)
    parser.ignored_unless("--predictions", "writes the images of one evaluation, and several are given (--output "
                          "writes their table)", lambda args: not several(args.checkpoint, args.model))
    for flag in ("--attack-steps", "--attack-restarts"):
        parser.ignored_unless(flag, "sets the PGD attack of --attack-eps, which is not given",
                              lambda args: bool(args.attack_eps))
    return parser


def check_files(parser: ArgumentParser, args) -> None:
    """Refuse (exit 2, before any work) a file flag's path of an extension it does not write (:data:`FILES`). What
    any output may not overwrite (a run's own files, weights, the data, the other output) the parser's one check
    refuses (:meth:`lipsformer.cli.ArgumentParser.check_outputs`)."""
    for flag, (suffixes, hint) in FILES.items():
        name = getattr(args, flag[2:])
        if name is not None and Path(name).suffix.lower() not in suffixes:
            parser.error(f"{flag} {name}: {hint}")


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = args.model or []
    if not models and args.pretrained:
        parser.error("--pretrained needs --model")
    if args.checkpoint and len(models) > 1:
        parser.error("--model takes one name with --checkpoint (each checkpoint is built as it); several names are "
                     "evaluated with --pretrained")
    check_files(parser, args)
    if not 0.0 <= args.max_bad_fraction <= 1.0:
        parser.error(f"--max-bad-fraction must be in [0, 1], got {args.max_bad_fraction}")
    certify_eps = parse_eps(args.certify_eps, "--certify-eps")
    attack_eps = parse_eps(args.attack_eps, "--attack-eps")
    settings = dict(real_labels=args.real_labels, use_ema=args.use_ema, batch_size=args.batch_size, amp=args.amp,
                    workers=args.workers, model_args=args.model_args, max_bad_fraction=args.max_bad_fraction,
                    img_size=args.img_size, crop_pct=args.crop_pct, interpolation=args.interpolation,
                    certify_eps=certify_eps, attack_eps=attack_eps, attack_steps=args.attack_steps,
                    attack_restarts=args.attack_restarts, compile=args.compile, channels_last=args.channels_last)
    if several(args.checkpoint, models):
        return table(args, evaluate_many(args.checkpoint, models, args.data_dir, args.dataset, **settings))
    result, samples = evaluate_model(models[0] if models else None, args.data_dir, args.dataset,
                                     checkpoint=args.checkpoint[0] if args.checkpoint else None,
                                     pretrained=args.pretrained, **settings)
    classes, probs, names = result.pop("classes"), result.pop("probs"), result.pop("label_names")
    radius, radius_global = result.pop("radius", None), result.pop("radius_global", None)
    if not result.pop("is_main_process"):
        return 0
    excluded = f", {result['excluded']} without ReaL labels left out" if result["excluded"] else ""
    if result["unreadable"]:
        excluded += f", {result['unreadable']} unreadable skipped"
    print(f"{result['model']} on {args.data_dir} ({result['data']}): "
          f"top-1 {percent(result['top1'])}  top-5 {percent(result['top5'])}  "
          f"({result['count']} of {result['images']} images scored{excluded}; {result['seconds']:.1f} s, "
          f"{result['img_per_s']:.1f} img/s, {result['processes']} process(es))"
          + (f": {result['top1_reason']}" if result["top1"] is None else ""))
    if "robustness" in result:
        print(robustness_line(result["robustness"], result["top1"], args.attack_steps, args.attack_restarts))
    if args.predictions:
        write_predictions(args.predictions, samples, classes, probs, radius, radius_global, names)
    if args.output and Path(args.output).suffix.lower() == ".csv":
        write_csv(args.output, [row(result)])
    elif args.output:
        write_json(args.output, dict(result, data_dir=args.data_dir), reason=result.get("robustness", {}).get("reason"))
    return 0


def table(args, results: dict) -> int:
    """Print the table of several evaluations and write it to --output (the main process)."""
    if not results.pop("is_main_process"):
        return 0
    rows, skipped = results["results"], results["skipped"]
    also = f", {len(skipped)} run(s) without weights yet skipped" if skipped else ""
    print(f"{len(rows)} evaluations on {args.data_dir} ({results['data']}), sorted by top-1{also}; "
          f"{results['processes']} process(es)")
    print(format_table(rows))
    if args.output and Path(args.output).suffix.lower() == ".csv":
        write_csv(args.output, rows)
    elif args.output:
        write_json(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
