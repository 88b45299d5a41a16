"""benchmarks/fla_backend.py: a layer's launches split into the attention op's (launched by one side only) and the
rest of the layer (launched by both)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def fb() -> ModuleType:
    pytest.importorskip("fla.backends", reason="fla-core >= 0.6.0 is not installed (pip install 'dtune[fla]')")
    return load_script("fla_backend")


def test_launches_only_one_side_makes_are_the_attention_op(fb: ModuleType) -> None:
    L = fb.Launch
    launches = {
        "fla": [L("gemm", 4.0, 3), L("chunk_fwd_kernel_o", 1.5), L("causal_conv1d", 1.0), L("solve_tril", 0.5)],
        "dtune": [
            L("gemm", 4.1, 3),
            L("chunk_state_kernel", 0.6),
            L("causal_conv1d", 0.9),
            L("qk_l2norm_fwd", 0.1),
        ],
    }
    row: dict[str, Any] = {"layer": "x", "mode": "train"}
    rows: list[dict[str, Any]] = []
    fb.split_launches(row, launches, rows)
    assert row["fla_op_ms"] == pytest.approx(2.0)
    assert row["dtune_op_ms"] == pytest.approx(0.7)
    assert row["rest_ms"] == pytest.approx(5.0)
    assert row["op_speedup"] == pytest.approx(2.0 / 0.7)
    assert len(rows) == 8
    assert {r["kernel"] for r in rows if r["attention_op"]} == {
        "chunk_fwd_kernel_o", "solve_tril", "chunk_state_kernel", "qk_l2norm_fwd"
    }  # fmt: skip
