"""The one error metric."""

from __future__ import annotations

import torch

from dtune.measure.error import rel_rms_error


def test_rel_rms_error() -> None:
    ref = torch.ones(4, 4)
    assert rel_rms_error(ref.clone(), ref) == 0
    bad = ref.clone()
    bad[0, 0] = float("inf")
    assert rel_rms_error(bad, ref) == float("inf")
    assert rel_rms_error(torch.ones(4, 3), ref) == float("inf")


def test_rel_rms_error_is_relative_to_the_reference() -> None:
    """‖x − ref‖ / ‖ref‖: twice the reference is 100% off, half of it 50% (not relative to x)."""
    ref = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    assert rel_rms_error(2 * ref, ref) == 1.0
    assert abs(rel_rms_error(0.5 * ref, ref) - 0.5) < 1e-12
    assert rel_rms_error(torch.full((4, 4), float("nan")), torch.ones(4, 4)) == float("inf")
