"""Shared test helpers. Kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import dtune.kernels.config as _kernel_config
import pytest
import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error ‖x − ref‖ / ‖ref‖ in float64; inf if x has NaN/Inf."""
    x64, r64 = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x64).all():
        return float("inf")
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launcher NaN-fills its outputs first: an element a kernel fails to write fails the test."""
    monkeypatch.setattr(_kernel_config, "POISON_OUTPUTS", True)
