"""Merging exports: one GPU only, the fastest entry per (kernel, dtype, bucket)."""

from __future__ import annotations

from typing import Any

import pytest

from dtune.export import merge_exports


def _doc(gpu: str, *entries: tuple[str, int, float]) -> dict[str, Any]:
    return {
        "schema": 1,
        "gpu": gpu,
        "entries": [
            {
                "kernel": k,
                "dtype": "bf16",
                "bucket": {"T": T, "B": 8, "H": 16, "HV": 16, "K": 64, "V": 64},
                "config": {"BV": 16},
                "time_ms": ms,
            }
            for k, T, ms in entries
        ],
    }


def test_fastest_entry_per_bucket_wins() -> None:
    a = _doc("h200", ("chunk_kda", 4096, 1.0), ("chunk_kda", 1024, 0.5))
    b = _doc("h200", ("chunk_kda", 4096, 0.8), ("fused_recurrent_kda", 1, 0.01))
    merged = merge_exports([a, b])
    got = {(e["kernel"], e["bucket"]["T"]): e["time_ms"] for e in merged["entries"]}
    assert got == {("chunk_kda", 4096): 0.8, ("chunk_kda", 1024): 0.5, ("fused_recurrent_kda", 1): 0.01}


def test_runs_of_different_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="different GPUs"):
        merge_exports([_doc("h200", ("chunk_kda", 4096, 1.0)), _doc("h100", ("chunk_kda", 4096, 1.0))])
