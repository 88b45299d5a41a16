"""benchmarks/bwd_variants.py: every variant is a backward config the template accepts for each gate it runs on, and
the names are unique per gate and shape (a row of its CSV is one variant)."""

from __future__ import annotations

from types import ModuleType

import pytest
from dtune.kernels.chunk import backward as chunk_bwd

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def bv() -> ModuleType:
    return load_script("bwd_variants")


def test_every_variant_is_a_legal_backward_config(bv: ModuleType) -> None:
    seen: set[tuple[str, str, str]] = set()
    for name, cfg, shapes, gates in bv.VARIANTS:
        for gate in gates:
            if cfg is not None:
                chunk_bwd.check_config(128, 128, gate.value, cfg)  # raises on an unknown key or a broken rule
            for shape in shapes:
                assert shape in ("b8", "b1"), (name, shape)
                key = (name, gate.value, shape)
                assert key not in seen, f"variant {name!r} twice for {gate.value} at {shape}"
                seen.add(key)
