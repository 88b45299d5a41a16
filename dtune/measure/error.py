"""The one error metric: relative RMS error against a reference, over every element, in float64.

``‖x − ref‖ / ‖ref‖`` (Frobenius norms): the correctness gate's criterion, the benchmark's ``error_o`` column, the
tests' and the GPU sweeps' check. A shape mismatch or any NaN/Inf in ``x`` gives ``inf``: a wrong kernel, never a
small error.
"""

from __future__ import annotations

import math

import torch


def rel_rms_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ over every element, in float64 on x's device; inf if shapes differ or x has NaN/Inf."""
    if tuple(x.shape) != tuple(ref.shape):
        return math.inf
    x64 = x.detach().to(torch.float64)
    if not bool(torch.isfinite(x64).all()):
        return math.inf
    r64 = ref.detach().to(device=x64.device, dtype=torch.float64)
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-30))
