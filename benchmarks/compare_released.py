"""A tool users run (docs/models.md): Logits of our models against the released implementation's, on the same
weights.

    git clone https://github.com/IDEA-Research/LipsFormer /tmp/LipsFormer
    git -C /tmp/LipsFormer show 00acb80:models/cswin.py > /tmp/LipsFormer/models/cswin_00acb80.py
    python benchmarks/compare_released.py --released /tmp/LipsFormer

The released models (``models/lipsformer_swin.py``, and the CSwin code of commit 00acb80 saved as
``models/cswin_00acb80.py``) are built with random weights, saved in their own layout, loaded into ours through
``pretrained_cfg_overlay=dict(file=...)`` (timm's pretrained path and our ``checkpoint_filter_fn``), and both
run on the same batch in eval mode. Printed: the largest logit difference, with and without autograd recording
(our fused GELU functions run only when it records). Needs ``einops`` for the released CSwin code.
"""
import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)

RELEASED = {  # our model: (file under models/, constructor)
    "lipsformer_swin_t": ("lipsformer_swin.py", "LipsFormerSwin"),
    "lipsformer_cswin_t": ("cswin_00acb80.py", "CSWin_64_12211_tiny_224"),
}


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_released(released: str, name: str) -> torch.nn.Module:
    """The released implementation of our model ``name``, with its own random weights, on the CPU."""
    file, ctor = RELEASED[name]
    module = load_module(Path(released) / "models" / file)
    cuda = torch.nn.Module.cuda
    torch.nn.Module.cuda = lambda self, *a, **k: self  # the released CSwin constructor moves itself to a GPU
    try:
        return getattr(module, ctor)()
    finally:
        torch.nn.Module.cuda = cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--released", required=True, help="a checkout of IDEA-Research/LipsFormer")
    parser.add_argument("--models", nargs="+", default=list(RELEASED))
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224)
    for name in args.models:
        reference = build_released(args.released, name).eval()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "released.pth"
            torch.save({"model": reference.state_dict()}, path)
            ours = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
        with torch.no_grad():
            expected, plain = reference(x), ours(x)
        recorded = ours(x).detach()
        print(f"{name}: max |logit difference| {(expected - plain).abs().max():.2e} (no grad), "
              f"{(expected - recorded).abs().max():.2e} (autograd recording); largest |logit| "
              f"{expected.abs().max():.3f}")


if __name__ == "__main__":
    main()
