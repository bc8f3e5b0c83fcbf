"""Model families; importing this registers every LipsFormer model with timm."""
from .lipsformer_cswin import LipsFormerCSwin
from .lipsformer_swin import LipsFormerSwin

__all__ = ["LipsFormerCSwin", "LipsFormerSwin"]
from . import peer  # noqa: F401  (registers torchlip_cnn, the peer baseline; its layers load when it is built)
