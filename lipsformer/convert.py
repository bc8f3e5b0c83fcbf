"""Convert a released-layout checkpoint (either family) or one of our training runs into a clean weight folder.

    python -m lipsformer.convert lipsformer-swin-tiny.pth --model lipsformer_swin_t --tag official_in1k
    python -m lipsformer.convert output/demo_digits --use-ema

The folder (``checkpoints/MODEL.TAG`` by default) holds ``model.safetensors`` and timm's ``config.json``
(model name, model arguments, preprocessing, and the source file with its sha256). Load it back with
``timm.create_model("local-dir:checkpoints/MODEL.TAG", pretrained=True)`` or
``timm.create_model(MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=".../model.safetensors"))``.
"""
import re
import sys
from pathlib import Path

from .build import build_model
from .cli import ArgumentParser, command, json_value, path
from .errors import UsageError
from .sources import export
from .weights import check_model_args, sha256_of, weights_fit
from .writer import output_folder

TAG = re.compile(r"[A-Za-z0-9_-]+")  # timm's pretrained tags: official_in1k, in22k_ft_in1k


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.convert", description=__doc__)
    parser.add_argument("source", type=path,
                        help="a released .pth, a weight file, a train.py output folder, or an export")
    parser.add_argument("--model", help="registered model name (needed when the source does not say)")
    parser.add_argument("--model-args", type=json_value, default={}, metavar="JSON",
                        help='model arguments the source was built with, e.g. \'{"img_size": 32}\'')
    parser.add_argument("--use-ema", action="store_true", help="take the EMA weights")
    parser.add_argument("--tag", default="converted", help="pretrained tag of the output folder's name")
    parser.add_argument("--out", type=output_folder, help="output folder (default: checkpoints/MODEL.TAG)")
    return parser


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not TAG.fullmatch(args.tag):  # it names a folder under checkpoints/: a name, never a path
        raise UsageError(f"--tag must be a name of letters, digits, '_' and '-' (the folder is "
                         f"checkpoints/MODEL.TAG), got {args.tag!r}")
    if args.out and Path(args.out).exists():  # found now, not after the weights are read
        raise UsageError(f"--out {args.out} already exists; remove it or choose another output folder")
    model, _ = build_model(args.model, args.source, use_ema=args.use_ema, **check_model_args(args.model_args))
    name = model.pretrained_cfg["architecture"]
    for line in weights_fit(model).lines():  # what the written weights hold that the source did not (adapted: ...)
        print(line)
    out = export(model, args.out or Path("checkpoints") / f"{name}.{args.tag}", source=args.source, tag=args.tag)
    print(f"model.safetensors sha256 {sha256_of(out / 'model.safetensors')}\n"  # the boundary's wrote: line names out
          f'load it with timm.create_model("local-dir:{out}", pretrained=True)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
