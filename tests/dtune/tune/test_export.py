"""Merging exports: one GPU only; within a sitting the fastest entry per (kernel, dtype, bucket) wins, and a newer
sitting supersedes a shipped file bucket by bucket."""

from __future__ import annotations

from typing import Any

import pytest

from dtune.store import parse_configs
from dtune.tune.export import merge_exports, supersede


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


def test_newer_sitting_supersedes_per_bucket() -> None:
    shipped = {**_doc("h200", ("chunk_kda", 4096, 0.5), ("chunk_kda", 1024, 0.4)), "note": "first"}
    newer = _doc("h200", ("chunk_kda", 4096, 0.9), ("chunk_delta_rule", 4096, 1.0))
    newer["entries"].append({**newer["entries"][0], "bucket": {**newer["entries"][0]["bucket"], "T": 16384}})
    newer["entries"][-1]["time_ms"] = None  # a study without a passing trial: skipped
    for e in shipped["entries"] + newer["entries"]:
        e["config"] = {"BT": 32}  # a chunk config (completed from the default when loaded)
    merged, changes = supersede(shipped, [newer], note="second")
    got = {(e["kernel"], e["bucket"]["T"]): e["time_ms"] for e in merged["entries"]}
    # the newer time replaces the shipped one even though it is slower: sittings are not comparable
    assert got == {("chunk_kda", 4096): 0.9, ("chunk_kda", 1024): 0.4, ("chunk_delta_rule", 4096): 1.0}
    assert merged["note"] == "first; second" and len(changes) == 2
    assert any("was 0.5 ms" in c for c in changes) and any("(new)" in c for c in changes)
    assert shipped["entries"][0]["time_ms"] == 0.5  # the input is not modified
    parse_configs(merged, "merged")  # still a valid config file


def test_supersede_refuses_another_gpu() -> None:
    with pytest.raises(ValueError, match="configs keep their GPU"):
        supersede(_doc("h200", ("chunk_kda", 4096, 1.0)), [_doc("h100", ("chunk_kda", 4096, 1.0))])
