"""The user's loss: log-cosh, quadratic near zero and linear far from it (robust to outliers)."""
import math

import torch
import torch.nn.functional as F


def log_cosh(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    error = outputs - target
    # log(cosh(x)) = x + softplus(-2x) - log 2, which does not overflow for large |x|.
    return (error + F.softplus(-2 * error) - math.log(2)).mean()
