"""Datasets on top of timm.data: image folders (ImageNet layout), any timm dataset name, and the three
ImageNet evaluation sets (val, ReaL, v2). Every image folder is listed and read by :mod:`lipsformer.data.scanner`.

The digits demo data lives in :mod:`lipsformer.data.digits` (needs scikit-learn).
"""
from .augment import TransformError
from .classes import ClassMismatch, model_class_names, relabel
from .datasets import (DataConfigError, SafeImageDataset, collate_skip_failed, create_dataset, create_loader_transform,
                       eval_data_config)
from .imagenet_eval import EVAL_DATASETS, EvalDataset, eval_samples
from .scanner import FolderLayoutError, image_extensions, read_image, scan_classes, scan_images

__all__ = ["ClassMismatch", "DataConfigError", "EVAL_DATASETS", "EvalDataset", "FolderLayoutError", "SafeImageDataset",
           "TransformError", "collate_skip_failed", "create_dataset", "create_loader_transform", "eval_data_config",
           "eval_samples", "image_extensions", "model_class_names", "read_image", "relabel", "scan_classes",
           "scan_images"]
