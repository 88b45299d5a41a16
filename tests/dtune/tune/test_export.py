"""Merging exports: one GPU only; within one export the fastest entry per (kernel, dtype, bucket) wins, and a newer
export supersedes a shipped file bucket by bucket."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from dtune.kernels import get_kernel

from dtune.store import parse_configs
from dtune.tune.export import measured_by, merge_exports, record_side_by_side, supersede


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


def test_newer_export_supersedes_per_bucket() -> None:
    shipped = {**_doc("h200", ("chunk_kda", 4096, 0.5), ("chunk_kda", 1024, 0.4)), "note": "first"}
    newer = _doc("h200", ("chunk_kda", 4096, 0.9), ("chunk_delta_rule", 4096, 1.0))
    newer["entries"].append({**newer["entries"][0], "bucket": {**newer["entries"][0]["bucket"], "T": 16384}})
    newer["entries"][-1]["time_ms"] = None  # a study without a passing trial: skipped
    for e in shipped["entries"] + newer["entries"]:
        e["config"] = {"BT": 32}  # a chunk config (completed from the default when loaded)
    merged, changes = supersede(shipped, [newer], note="second")
    got = {(e["kernel"], e["bucket"]["T"]): e["time_ms"] for e in merged["entries"]}
    # the newer time replaces the shipped one even though it is slower: separate runs are not comparable
    assert got == {("chunk_kda", 4096): 0.9, ("chunk_kda", 1024): 0.4, ("chunk_delta_rule", 4096): 1.0}
    assert merged["note"] == "first; second" and len(changes) == 2
    assert any("was 0.5 ms" in c for c in changes) and any("(new)" in c for c in changes)
    assert shipped["entries"][0]["time_ms"] == 0.5  # the input is not modified
    parse_configs(merged, "merged")  # still a valid config file


def test_a_much_slower_newer_entry_keeps_the_shipped_one() -> None:
    """tune-gpu's guard (max_slowdown 1.5): a winner 1.8x slower than the shipped entry does not replace it, one
    1.4x slower does (runs are not comparable to the percent), a new bucket is added."""
    shipped = _doc("h200", ("chunk_kda", 4096, 0.5), ("chunk_kda", 1024, 0.4))
    newer = _doc("h200", ("chunk_kda", 4096, 0.9), ("chunk_kda", 1024, 0.56), ("chunk_kda", 16384, 2.0))
    merged, changes = supersede(shipped, [newer], max_slowdown=1.5)
    got = {e["bucket"]["T"]: e["time_ms"] for e in merged["entries"]}
    assert got == {4096: 0.5, 1024: 0.56, 16384: 2.0}
    assert any("kept the entry of 0.5 ms" in c for c in changes) and len(changes) == 3


def test_supersede_keeps_the_bench_of_the_same_config() -> None:
    """A newer search that re-finds an entry's config (written out with parameters added since) keeps that entry's
    side-by-side bench, which the fla backend's speed rule reads; another config drops it."""
    old_cfg = {"BT": 64, "dh_BV": 64}
    full = get_kernel("chunk_kda_bwd").check_config(64, 64, old_cfg)
    assert full != old_cfg  # the newer search writes every parameter
    bench = {"side_by_side_ms": {"dtune": 2.0, "fla": 5.0}, "peak_mb": 900.0, "measured_by": "dtune bench ..."}
    shipped = _doc("h100", ("chunk_kda_bwd", 4096, 2.1), ("chunk_kda_bwd", 1024, 1.5))
    for e in shipped["entries"]:
        e.update(config=old_cfg, **bench)
    newer = _doc("h100", ("chunk_kda_bwd", 4096, 2.05), ("chunk_kda_bwd", 1024, 1.4))
    newer["entries"][0]["config"] = full
    newer["entries"][1]["config"] = {**full, "dh_BV": 32}
    merged, changes = supersede(shipped, [newer])
    got = {e["bucket"]["T"]: e for e in merged["entries"]}
    assert got[4096]["time_ms"] == 2.05 and got[4096]["config"] == full
    assert got[4096]["side_by_side_ms"] == bench["side_by_side_ms"] and got[4096]["peak_mb"] == 900.0
    assert got[1024]["time_ms"] == 1.4 and "side_by_side_ms" not in got[1024] and "measured_by" not in got[1024]
    assert any("the same config: kept its side_by_side_ms, peak_mb, measured_by" in c for c in changes)
    # a newer search that says how it measured keeps its own words, followed by the kept bench's
    newer["entries"][0]["measured_by"] = "dtune tune-gpu --models all (H100, commit abc1234, 2026-12-07)"
    merged, _ = supersede(shipped, [newer])
    got = {e["bucket"]["T"]: e for e in merged["entries"]}
    assert got[4096]["measured_by"] == (
        "dtune tune-gpu --models all (H100, commit abc1234, 2026-12-07); before, the same config: dtune bench ..."
    )
    assert got[4096]["side_by_side_ms"] == bench["side_by_side_ms"]


def test_measured_by_names_the_command_gpu_commit_and_day() -> None:
    info = {
        "kernel": "chunk_kda",
        "gpu": {"key": "h100", "name": "NVIDIA H100 SXM5 80GB"},
        "device_name": "NVIDIA H100 80GB HBM3",
        "commit": "2d7cbf2a1b2c3d4e",
        "command": "dtune search -k chunk_kda --timeout 300",
        "created": "2026-12-07T10:49:21+00:00",
    }
    assert (
        measured_by(info)
        == "dtune search -k chunk_kda --timeout 300 (NVIDIA H100 80GB HBM3, commit 2d7cbf2, 2026-12-07)"
    )
    # a run not started by dtune's CLI (no command), under the interpreter, without a commit
    bare = {**info, "command": None, "commit": None, "device_name": None, "interpret": True}
    assert measured_by(bare) == "dtune search -k chunk_kda (Triton's interpreter, NVIDIA H100 SXM5 80GB, 2026-12-07)"


def test_command_line_only_for_dtunes_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from dtune.provenance import command_line

    monkeypatch.setattr(sys, "argv", ["/usr/bin/dtune", "search", "-k", "chunk_kda", "--out", "a b"])
    assert command_line() == "dtune search -k chunk_kda --out 'a b'"
    monkeypatch.setattr(sys, "argv", ["/x/site-packages/dtune/__main__.py", "tune-gpu", "--budget", "30"])
    assert command_line() == "dtune tune-gpu --budget 30"
    monkeypatch.setattr(sys, "argv", ["/x/bin/pytest", "-k", "x"])
    assert command_line() is None


def test_supersede_refuses_another_gpu() -> None:
    with pytest.raises(ValueError, match="configs keep their GPU"):
        supersede(_doc("h200", ("chunk_kda", 4096, 1.0)), [_doc("h100", ("chunk_kda", 4096, 1.0))])


def test_export_takes_only_complete_trials_that_passed(tmp_path: Path) -> None:
    """Trials that look faster but did not pass are never exported: a PRUNED trial with a value and every passing
    attribute, a COMPLETE one that failed the gate (with and without a reason recorded), a COMPLETE one with a failure
    reason, one never gated. The winner is known by construction (trial 4), not by the code the export uses."""
    import optuna

    from dtune.gpu import get_profile
    from dtune.tune.export import build_export
    from dtune.tune.runinfo import write_run_json
    from dtune.tune.storage import study_name

    shape = {"shape_key": "T4-B1-H1-HV1-K16-V16", "B": 1, "T": 4, "H": 1, "HV": 1, "K": 16, "V": 16}
    write_run_json(
        tmp_path,
        {"kernel": "fused_recurrent_kda", "gpu": get_profile("cpu").as_dict(), "dtype": "fp32", "shapes": [shape]},
    )
    study = optuna.create_study(
        study_name=study_name("fused_recurrent_kda", "cpu", "fp32", shape["shape_key"]),
        storage=f"sqlite:///{tmp_path / 'study.db'}",
    )
    dist = {"BV": optuna.distributions.CategoricalDistribution([8, 16, 32])}
    passed = {"gate_passed": True, "reason": None}
    S = optuna.trial.TrialState
    for state, value, bv, attrs in [
        (S.COMPLETE, 2.0, 16, {**passed, "is_default": True}),  # 0: the default
        (S.PRUNED, 0.1, 8, passed),  # 1: fastest value, but pruned
        (S.COMPLETE, 0.2, 8, {"gate_passed": False, "reason": "gate"}),  # 2: failed the gate
        (S.COMPLETE, 0.3, 32, {"gate_passed": True, "reason": "runtime"}),  # 3: a failure reason
        (S.COMPLETE, 1.0, 32, passed),  # 4: the winner
        (S.FAIL, None, 8, {"gate_passed": True, "reason": None}),  # 5: failed, no value
        (S.COMPLETE, 0.15, 8, {"gate_passed": False, "reason": None}),  # 6: failed the gate, no reason recorded
        (S.COMPLETE, 0.25, 8, {"reason": None}),  # 7: never gated (no gate attribute)
    ]:
        config = {"BV": bv, "num_warps": 1, "num_stages": 1}
        study.add_trial(
            optuna.trial.create_trial(
                state=state, value=value, params={"BV": bv}, distributions=dist,
                user_attrs={**attrs, "config": config, "error_o": 1e-7, "error_s": 2e-7},
            )
        )  # fmt: skip
    (entry,) = build_export(tmp_path)["entries"]
    assert entry["config"] == {"BV": 32, "num_warps": 1, "num_stages": 1}
    assert entry["time_ms"] == 1.0 and entry["default_time_ms"] == 2.0 and entry["speedup"] == 2.0
    assert entry["trials"] == {"complete": 6, "failed": 1, "pruned": 1}
    assert entry["measured_by"].startswith("dtune search -k fused_recurrent_kda (")  # (no command in this run.json)


def _bench_rows(*rows: tuple[str, str, int, int, int, str, float, bool, str, float]) -> Any:
    """A bench frame: (kernel, impl, B, T, N, mode, median_ms, meaningful, config_match, peak_mb) per row."""
    import pandas as pd

    return pd.DataFrame(
        [
            {"kernel": k, "impl": i, "dtype": "bf16", "B": B, "T": T, "H": 16, "HV": 16, "K": 64, "V": 64, "N": N,
             "mode": mode, "median_ms": ms, "meaningful": ok, "config_match": match, "peak_mb": peak}
            for k, i, B, T, N, mode, ms, ok, match, peak in rows
        ]
    )  # fmt: skip


def test_side_by_side_times_are_recorded_into_the_entries_the_bench_ran() -> None:
    """Each entry whose own config the bench timed, meaningfully and eagerly, beside a peer gets side_by_side_ms: dtune,
    fla's fastest mode, FlashQLA under fla's registry name; a packed batch by its lookup bucket; a backward entry its
    peak memory too. A borrowed config, an interpreter timing, a graph replay or no peer records nothing."""
    nan = math.nan
    doc = {
        "schema": 1,
        "gpu": "h100",
        "entries": [
            {"kernel": k, "dtype": "bf16", "bucket": {"T": T, "B": B, "H": 16, "HV": 16, "K": 64, "V": 64},
             "config": {}, "time_ms": 1.0, **extra}
            for k, T, B, extra in [
                ("chunk_gated_delta_rule", 4096, 8, {"measured_by": "dtune search ..."}),
                ("chunk_gated_delta_rule", 1024, 32, {}),  # timed with a borrowed config
                ("chunk_gated_delta_rule", 16384, 2, {}),  # timed under the interpreter
                ("chunk_gated_delta_rule", 1024, 4, {}),  # the packed batch's lookup bucket (4 sequences of 1024)
                ("chunk_gated_delta_rule_bwd", 4096, 8, {}),
                ("fused_recurrent_kda", 1, 32, {"side_by_side_ms": {"dtune": 9.0, "fla": 9.0}}),  # only graph rows
            ]
        ],
    }  # fmt: skip
    g, gb, fr = "chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd", "fused_recurrent_kda"
    frame = _bench_rows(
        (g, "tuned", 8, 4096, 8, "fwd", 0.5, True, "exact", 900.0),
        (g, "default", 8, 4096, 8, "fwd", 0.45, True, "default", nan),  # dtune's own default: not a peer
        (g, "fla", 8, 4096, 8, "fwd", 1.0, True, "", nan),
        (g, "fla_fast", 8, 4096, 8, "fwd", 0.9, True, "", nan),
        (g, "flashqla", 8, 4096, 8, "fwd", 0.4, True, "", nan),
        (g, "tuned", 32, 1024, 32, "fwd", 0.3, True, "borrowed", nan),
        (g, "fla", 32, 1024, 32, "fwd", 0.6, True, "", nan),
        (g, "tuned", 2, 16384, 2, "fwd", 5.0, False, "exact", nan),
        (g, "fla", 2, 16384, 2, "fwd", 9.0, False, "", nan),
        (g, "tuned", 1, 4096, 4, "fwd", 0.2, True, "exact", nan),
        (g, "fla", 1, 4096, 4, "fwd", nan, True, "", nan),  # fla failed: FlashQLA is the peer
        (g, "flashqla", 1, 4096, 4, "fwd", 0.25, True, "", nan),
        (gb, "tuned", 8, 4096, 8, "fwd+bwd", 2.3, True, "exact", 1435.0),
        (gb, "fla", 8, 4096, 8, "fwd+bwd", 3.9, True, "", 1879.0),
        (fr, "tuned", 32, 1, 32, "graph", 0.01, True, "exact", nan),
        (fr, "fla", 32, 1, 32, "graph", 0.02, True, "", nan),
    )
    out, lines = record_side_by_side(doc, frame, "side_by_side_ms: the bench")
    got = {(e["kernel"], e["bucket"]["T"], e["bucket"]["B"]): e for e in out["entries"]}
    anchor = got[(g, 4096, 8)]
    assert anchor["side_by_side_ms"] == {"dtune": 0.5, "fla": 0.9, "flash_qla": 0.4}
    assert anchor["measured_by"] == "dtune search ...; side_by_side_ms: the bench" and "peak_mb" not in anchor
    assert got[(g, 1024, 4)]["side_by_side_ms"] == {"dtune": 0.2, "flash_qla": 0.25}
    assert got[(gb, 4096, 8)]["side_by_side_ms"] == {"dtune": 2.3, "fla": 3.9} and got[(gb, 4096, 8)]["peak_mb"] == 1435
    for key in ((g, 1024, 32), (g, 16384, 2)):
        assert "side_by_side_ms" not in got[key] and "measured_by" not in got[key]
    assert got[(fr, 1, 32)]["side_by_side_ms"] == {"dtune": 9.0, "fla": 9.0}  # kept: graph replays are not the call
    assert len(lines) == 3
    parse_configs(out, "recorded", "h100")  # what the ops read


def test_a_tune_gpu_bench_is_recorded_in_the_jobs_config_file(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from dtune.tune.grid import record_bench

    path = tmp_path / "h100.json"
    entry = {"kernel": "chunk_kda", "dtype": "bf16", "bucket": {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 64, "V": 64},
             "config": {}, "time_ms": 1.0}  # fmt: skip
    path.write_text(json.dumps({"schema": 1, "gpu": "h100", "entries": [entry]}))
    job = SimpleNamespace(config_file=path, baselines=("default", "fla"), rounds=None, gpu=SimpleNamespace(key="h100"))
    frame = _bench_rows(
        ("chunk_kda", "tuned", 8, 4096, 8, "fwd", 0.9, True, "exact", math.nan),
        ("chunk_kda", "fla", 8, 4096, 8, "fwd", 1.6, True, "", math.nan),
    )
    record_bench(job, frame)  # type: ignore[arg-type]
    (got,) = json.loads(path.read_text())["entries"]
    assert got["side_by_side_ms"] == {"dtune": 0.9, "fla": 1.6}
    assert got["measured_by"].startswith("side_by_side_ms: the bench of dtune tune-gpu beside fla (3 rounds")


def test_a_second_recording_replaces_the_first_s_account() -> None:
    """Recording again (the next shape of the same bench, or a later bench) replaces the side-by-side part of
    ``measured_by``, keeping how the entry was found; it never piles up."""
    entry = {"kernel": "chunk_kda", "dtype": "bf16", "bucket": {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 64, "V": 64},
             "config": {}, "time_ms": 1.0}  # fmt: skip
    frame = _bench_rows(
        ("chunk_kda", "tuned", 8, 4096, 8, "fwd", 0.9, True, "exact", math.nan),
        ("chunk_kda", "fla", 8, 4096, 8, "fwd", 1.6, True, "", math.nan),
    )
    for found, first in (("dtune search -k chunk_kda", "dtune search -k chunk_kda; "), ("", "")):
        doc = {"schema": 1, "gpu": "h100", "entries": [{**entry, "measured_by": found} if found else entry]}
        doc, _ = record_side_by_side(doc, frame, "side_by_side_ms: bench one")
        doc, _ = record_side_by_side(doc, frame, "side_by_side_ms: bench two")
        assert doc["entries"][0]["measured_by"] == first + "side_by_side_ms: bench two"


def test_side_by_side_times_of_another_config_are_not_recorded() -> None:
    """A bench row that records the config it ran (bench.csv's ``config``) counts only for an entry that still has that
    config (compared completed with the kernel's defaults): an older bench of a re-tuned bucket records nothing."""
    bucket = {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 64, "V": 64}
    doc = {"schema": 1, "gpu": "h100", "entries": [
        {"kernel": "chunk_kda", "dtype": "bf16", "bucket": {**bucket, "B": B}, "config": {"BT": 64, "BC": 16}}
        for B in (8, 4)
    ]}  # fmt: skip
    frame = _bench_rows(
        ("chunk_kda", "tuned", 8, 4096, 8, "fwd", 0.9, True, "exact", math.nan),
        ("chunk_kda", "fla", 8, 4096, 8, "fwd", 1.6, True, "", math.nan),
        ("chunk_kda", "tuned", 4, 4096, 4, "fwd", 0.5, True, "exact", math.nan),
        ("chunk_kda", "fla", 4, 4096, 4, "fwd", 0.8, True, "", math.nan),
    )
    full = get_kernel("chunk_kda").check_config(64, 64, {"BT": 64, "BC": 16})
    frame["config"] = [json.dumps(full), "", json.dumps({"BT": 32}), ""]
    out, lines = record_side_by_side(doc, frame, "the bench")
    got = {e["bucket"]["B"]: e for e in out["entries"]}
    assert got[8]["side_by_side_ms"] == {"dtune": 0.9, "fla": 1.6} and "side_by_side_ms" not in got[4]
    assert len(lines) == 1
