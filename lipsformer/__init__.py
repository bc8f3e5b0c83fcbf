"""LipsFormer: Lipschitz-continuous vision transformers for timm.

Importing this package registers every LipsFormer model with timm::

    import lipsformer, timm
    model = timm.create_model("lipsformer_swin_t")
"""
from . import models  # noqa: F401  (registers the models)
from .models import LipsFormerCSwin, LipsFormerSwin

__version__ = "0.1.0"
__all__ = ["LipsFormerCSwin", "LipsFormerSwin", "__version__"]
