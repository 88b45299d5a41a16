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
