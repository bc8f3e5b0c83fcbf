"""Datasets on top of timm.data: image folders (ImageNet layout) and any timm dataset name.

The digits demo data lives in :mod:`lipsformer.data.digits` (needs scikit-learn).
"""
from .datasets import SafeImageDataset, collate_skip_failed, create_dataset, create_loader_transform

__all__ = ["SafeImageDataset", "collate_skip_failed", "create_dataset", "create_loader_transform"]
