"""Shared test helpers. Kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import dtune.kernels.config as _kernel_config
import pytest

from dtune.measure.error import rel_rms_error as rel_err

__all__ = ["rel_err"]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launcher NaN-fills its outputs first: an element a kernel fails to write fails the test."""
    monkeypatch.setattr(_kernel_config, "POISON_OUTPUTS", True)
