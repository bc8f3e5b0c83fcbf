"""The Lipschitz toolkit: certified upper bounds (``bounds``) and measured lower bounds (``estimate``)."""
from .bounds import (Bound, LipschitzReport, NoBoundError, Row, conv_bound, conv_operator_norm, gelu_bound,
                     lipschitz_report, matrix_norm, module_bound, register_bound, register_kernel_bound,
                     register_residual_bound, register_rows)
from .estimate import ball, jacobian_norm, maximize_difference_quotient, maximize_jacobian_norm
from .invert import ContractiveL2Attention, Inverse, InvertibleResidual, branch_bound, invert

__all__ = ["Bound", "LipschitzReport", "NoBoundError", "Row", "ball", "conv_bound", "conv_operator_norm", "gelu_bound", "jacobian_norm",
           "lipschitz_report", "matrix_norm", "maximize_difference_quotient", "maximize_jacobian_norm", "module_bound", "register_bound",
           "register_kernel_bound", "register_residual_bound", "register_rows",
           "ContractiveL2Attention", "Inverse", "InvertibleResidual", "branch_bound", "invert"]
