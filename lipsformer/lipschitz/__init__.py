"""The Lipschitz toolkit: certified upper bounds (``bounds``), measured lower bounds (``estimate``) and per-image
certificates with an attack to check them (``certify``)."""
from .bounds import LipschitzReport, lipschitz_report
from .layer_bounds import conv_bound, conv_operator_norm, gelu_bound, matrix_norm
from .registry import (Bound, NoBoundError, Row, module_bound, register_bound, register_kernel_bound,
                       register_residual_bound, register_rows)
from .certify import certified_accuracy, certified_radius, pgd_l2, pixel_lipschitz, predict_certified
from .estimate import ball, jacobian_norm, maximize_difference_quotient, maximize_jacobian_norm
from .invert import ContractiveL2Attention, Inverse, InvertibleResidual, branch_bound, invert

__all__ = ["Bound", "ContractiveL2Attention", "Inverse", "InvertibleResidual", "LipschitzReport", "NoBoundError", "Row",
           "ball", "branch_bound", "certified_accuracy", "certified_radius", "conv_bound", "conv_operator_norm",
           "gelu_bound", "invert", "jacobian_norm", "lipschitz_report", "matrix_norm", "maximize_difference_quotient",
           "maximize_jacobian_norm", "module_bound", "pgd_l2", "pixel_lipschitz", "predict_certified", "register_bound",
           "register_kernel_bound", "register_residual_bound", "register_rows"]
