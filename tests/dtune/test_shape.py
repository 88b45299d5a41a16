"""dtune.shape: the packed and grouped-head variants of a grid's shapes (used by `dtune search` and `dtune bench`)."""

from __future__ import annotations

import pytest

from dtune.shape import Shape, packed_and_grouped


def test_packed_batch_is_bucketed_by_count_and_mean_length() -> None:
    shapes = [Shape(8, 4096, 16, 16, 128, 128), Shape(2, 16384, 16, 16, 128, 128), Shape(8, 4096, 16, 16, 64, 64)]
    out = packed_and_grouped(shapes, [100, 300, 800], 1)
    # one packed batch per head dim and heads, whatever the grid's T and B were
    assert out == [Shape(3, 400, 16, 16, 128, 128, 3), Shape(3, 400, 16, 16, 64, 64, 3)]


def test_grouped_value_heads() -> None:
    (s,) = packed_and_grouped([Shape(1, 32768, 16, 16, 128, 128)], None, 2)
    assert (s.H, s.HV, s.B, s.T) == (16, 32, 1, 32768)


@pytest.mark.parametrize(("packed", "ratio"), [([], 1), ([4, 0], 1), (None, 0)])
def test_bad_packed_batch_or_ratio(packed: list[int] | None, ratio: int) -> None:
    with pytest.raises(ValueError):
        packed_and_grouped([Shape(1, 64, 2, 2, 16, 16)], packed, ratio)
