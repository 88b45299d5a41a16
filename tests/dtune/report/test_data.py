"""The numbers behind every chart of the report, on small hand-made frames with the real columns."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dtune.measure.work import Roofs
from dtune.report import data as d
from tests.e2e.run_folder import make_run_folder

STUDY_A = "chunk_kda:h200:bf16:T1024_D64"
STUDY_B = "chunk_kda:h200:bf16:T4096_D64"


def trial(
    study: str, T: int, D: int, n: int, state: str, ms: float, reason: str = "ok", **extra: Any
) -> dict[str, Any]:
    return {
        "study": study,
        "kernel": "chunk_kda",
        "gpu": "h200",
        "dtype": "bf16",
        "shape_key": study.rsplit(":", 1)[1],
        "B": 32768 // T,
        "T": T,
        "H": 16,
        "HV": 16,
        "K": D,
        "V": D,
        "number": n,
        "state": state,
        "reason": reason,
        "message": "",
        "time_ms": ms,
        "default_time_ms": extra.pop("default_time_ms", 1.2),
        "error_o": 1e-3 if state == "complete" else math.nan,
        "is_default": n == 0,
        "p.BT": extra.pop("BT", 64),
        "p.num_warps": extra.pop("num_warps", 4),
        **extra,
    }


@pytest.fixture()
def trials() -> pd.DataFrame:
    nan = math.nan
    return pd.DataFrame(
        [
            trial(STUDY_A, 1024, 64, 0, "complete", 1.20),
            trial(STUDY_A, 1024, 64, 1, "complete", 0.90, BT=32, num_warps=8),
            trial(STUDY_A, 1024, 64, 2, "failed", nan, "gate"),
            trial(STUDY_A, 1024, 64, 3, "complete", 0.95),
            trial(STUDY_A, 1024, 64, 4, "complete", 0.80, BT=32, num_warps=2),
            trial(STUDY_A, 1024, 64, 5, "pruned", nan, "constraint"),
            trial(STUDY_B, 4096, 64, 0, "complete", 2.00, default_time_ms=2.0),
            trial(STUDY_B, 4096, 64, 1, "failed", nan, "compile"),
            trial(STUDY_B, 4096, 64, 2, "complete", 1.60, num_warps=8, default_time_ms=2.0),
            trial(STUDY_B, 4096, 64, 3, "failed", nan, "gate", default_time_ms=2.0),
        ]
    )


def test_best_per_shape(trials: pd.DataFrame) -> None:
    best = d.best_per_shape(trials).set_index("study")
    a, b = best.loc[STUDY_A], best.loc[STUDY_B]
    assert (a["best_ms"], a["default_ms"], a["best_trial"]) == (0.80, 1.20, 4)
    assert a["speedup"] == pytest.approx(1.5)
    assert (a["complete"], a["failed"], a["pruned"]) == (4, 1, 1)
    assert json.loads(a["config"]) == {"BT": 32, "num_warps": 2}
    assert b["speedup"] == pytest.approx(1.25)
    assert (b["complete"], b["failed"], b["pruned"]) == (2, 2, 0)


def test_default_time_falls_back_to_column_without_default_trial(trials: pd.DataFrame) -> None:
    t = trials[trials["number"] != 0]
    best = d.best_per_shape(t).set_index("study")
    assert best.loc[STUDY_A, "default_ms"] == 1.2
    assert best.loc[STUDY_A, "speedup"] == pytest.approx(1.5)


def test_search_history_best_so_far(trials: pd.DataFrame) -> None:
    h = d.search_history(trials)
    a = h[h["study"] == STUDY_A]
    assert a["number"].tolist() == [0, 1, 3, 4]
    assert a["best_so_far"].tolist() == [1.20, 0.90, 0.90, 0.80]
    assert h[h["study"] == STUDY_B]["best_so_far"].tolist() == [2.0, 1.6]


def test_failures_by_reason(trials: pd.DataFrame) -> None:
    f = d.failures_by_reason(trials)
    assert list(zip(f["state"], f["reason"], f["count"])) == [
        ("failed", "gate", 2),
        ("failed", "compile", 1),
        ("pruned", "constraint", 1),
    ]
    assert d.failures_by_reason(trials[trials["state"] == "complete"]).empty


def test_trial_table_orders_columns_and_rows(trials: pd.DataFrame) -> None:
    t = d.trial_table(trials.sample(frac=1.0, random_state=1))
    assert list(t.columns[:6]) == ["study", "number", "state", "reason", "p.BT", "p.num_warps"]
    assert t["number"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert len(t) == len(trials)


def bench_rows() -> pd.DataFrame:
    base = {"kernel": "chunk_kda", "dtype": "bf16", "B": 8, "T": 4096, "H": 16, "HV": 16, "K": 128, "V": 128}
    rows = []
    for impl, ms in {"tuned": 1.0, "default": 1.5, "fla": 1.8, "fla_fast": 1.6, "torch": 12.0}.items():
        rows.append(
            {
                **base,
                "impl": impl,
                "mode": "eager",
                "median_ms": ms,
                "speedup_vs_default": 1.5 / ms,
                "speedup_vs_fla": 1.6 / ms,
                "meaningful": True,
                "flops": 9.449e10,
                "bytes": 8.06e8,
                "tflops": 9.449e10 / (ms * 1e-3) / 1e12,
            }
        )
    rows.append({**rows[-1], "impl": "default", "median_ms": math.nan, "tflops": math.nan, "T": 1024})
    return pd.DataFrame(rows)


def test_bench_times() -> None:
    f = d.bench_times(bench_rows())
    assert f["shape"].unique().tolist() == ["B8 T4096 H16 D128"]  # the untimed row is dropped
    assert f.set_index("series")["median_ms"].to_dict() == {
        "tuned": 1.0,
        "default": 1.5,
        "fla": 1.8,
        "fla_fast": 1.6,
        "torch": 12.0,
    }
    assert f.set_index("series").loc["tuned", "speedup_vs_fla"] == pytest.approx(1.6)


def test_bench_times_graph_series() -> None:
    b = bench_rows().head(2).copy()
    b.loc[1, ["impl", "mode"]] = ["tuned", "graph"]
    assert d.bench_times(b)["series"].tolist() == ["tuned", "tuned (graph)"]


def profile_rows() -> pd.DataFrame:
    base = {"kernel": "chunk_kda", "dtype": "bf16", "B": 8, "T": 4096, "H": 16, "HV": 16, "K": 128, "V": 128}
    stages = [
        ("cumsum", 0.1, 1e9, 2e8),
        ("solve", 0.3, 3e10, 2e8),
        ("output", 0.6, 6e10, 4e8),
        ("total (whole op)", 1.05, 9e10, 8e8),
    ]
    return pd.DataFrame(
        [
            {
                **base,
                "stage": s,
                "median_ms": ms,
                "flops": fl,
                "bytes": by,
                "tflops": fl / (ms * 1e-3) / 1e12,
                "registers": 96,
                "spills": 0,
                "shared_mem": 32768,
                "x_floor": 2.0,
                "verdict": "2.0× floor, memory-bound",
                "roof_gbs": 4249.0,
                "roof_tflops": 700.0,
                "roof_source": "measured",
            }
            for s, ms, fl, by in stages
        ]
    )


def test_stage_breakdown_shares() -> None:
    s = d.stage_breakdown(profile_rows())
    assert s["stage"].tolist() == ["cumsum", "solve", "output"]
    assert s["share"].round(6).tolist() == [0.1, 0.3, 0.6]
    assert s["shape"].iloc[0] == "chunk_kda B8 T4096 H16 D128"


def test_roofline_points_and_roofs(tmp_path: Path) -> None:
    pts = d.roofline_points(bench_rows(), profile_rows())
    assert pts is not None
    tuned = pts[pts["group"] == "bench: tuned"].iloc[0]
    assert tuned["intensity"] == pytest.approx(9.449e10 / 8.06e8)
    assert tuned["tflops"] == pytest.approx(94.49)
    solve = pts[pts["group"] == "profile: solve"].iloc[0]
    assert solve["intensity"] == pytest.approx(150.0)
    assert solve["tflops"] == pytest.approx(100.0)
    assert len(pts) == 5 + 4  # the untimed bench row is dropped
    assert d.roofline_points(None, None) is None

    data = d.RunData(
        path=tmp_path, run={"gpu": {"key": "h200", "hbm_gbs": 4800, "bf16_tflops": 989}}, profile=profile_rows()
    )
    roofs = d.roofs(data)
    assert [(r.gbs, r.tflops, r.source) for r in roofs] == [
        (4800.0, 989.0, "profile:h200"),
        (4249.0, 700.0, "measured"),
    ]
    lines = d.roof_lines([Roofs(4000.0, 700.0, "t")], 1.0, 1000.0)
    assert lines["intensity"].tolist() == [1.0, 175.0, 1000.0]
    assert lines["tflops"].tolist() == pytest.approx([4.0, 700.0, 700.0])


def test_tuned_frame_and_compact_config() -> None:
    tuned = {
        "entries": [
            {
                "kernel": "chunk_kda",
                "dtype": "bf16",
                "bucket": {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 128, "V": 128},
                "config": {"BT": 64, "num_warps": 4},
                "time_ms": 1.0,
                "default_time_ms": 1.3,
                "speedup": 1.3,
                "gate_error": 2e-3,
                "trials": {"complete": 40, "failed": 7, "pruned": 3},
            }
        ]
    }
    f = d.tuned_frame(tuned)
    assert f is not None
    row = f.iloc[0]
    assert (row["T"], row["K"], row["speedup"], row["complete"], row["failed"]) == (4096, 128, 1.3, 40, 7)
    assert d.compact_config(row["config"]) == "BT=64 num_warps=4"
    assert d.tuned_frame({"entries": []}) is None


def test_environment_lists_gpu_versions_commit() -> None:
    env = d.environment(
        {
            "gpu": {"name": "NVIDIA H200", "key": "h200", "cc_major": 9, "cc_minor": 0, "hbm_gbs": 4800},
            "versions": {"torch": "2.13", "triton": "3.9"},
            "commit": "abc123",
            "interpret": True,
        }
    )
    assert env["GPU"] == "NVIDIA H200 (h200, sm_90)"
    assert env["Versions"] == "torch 2.13, triton 3.9"
    assert env["Commit"] == "abc123"
    assert "NOT meaningful" in env["Interpreter"]


def test_load_run_and_importance_on_synthetic_folder(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=10)
    data = d.load_run(run)
    assert data.trials is not None and data.bench is not None and data.profile is not None and data.tuned is not None
    assert data.problems == []
    sp = d.speedups(data)
    assert sp is not None and len(sp) == 6 and (sp["speedup"] >= 1.0).all()
    imp, notes = d.param_importance(data.study_db, min_complete=5)
    assert set(imp["param"]) <= {"BT", "BC", "BV", "num_warps", "num_stages"}
    per_study = imp.groupby("study")["importance"].sum()
    assert per_study.round(6).eq(1.0).all()  # normalised
    assert len(per_study) + len(notes) == 6
    few, notes = d.param_importance(data.study_db, min_complete=100)
    assert few.empty and len(notes) == 6 and all("not enough trials" in n for n in notes)


def test_load_run_tolerates_missing_and_broken_files(tmp_path: Path) -> None:
    (tmp_path / "trials.csv").write_text("")
    (tmp_path / "run.json").write_text("{not json")
    data = d.load_run(tmp_path)
    assert data.trials is None and data.run == {} and data.study_db is None
    assert any("run.json" in p for p in data.problems)
    imp, notes = d.param_importance(None)
    assert imp.empty and notes == ["no study.db in the run folder"]


def sweep_rows() -> pd.DataFrame:
    """tuned / default / fla / fla_fast at T in {1024, 4096} x D in {64, 128}, and one D = 256 shape at T = 4096."""
    rows = []
    for T, D, tuned, default, fla, fast in [
        (1024, 64, 0.5, 0.6, 1.0, 0.8),
        (4096, 64, 1.0, 1.2, 1.5, 1.6),
        (1024, 128, 1.0, 1.1, 0.9, 0.95),
        (4096, 128, 2.0, 2.0, 2.2, 1.8),
        (4096, 256, 4.0, 4.4, 3.0, 3.2),
    ]:
        for impl, ms in {"tuned": tuned, "default": default, "fla": fla, "fla_fast": fast}.items():
            rows.append(
                {"kernel": "chunk_kda", "dtype": "bf16", "impl": impl, "mode": "eager", "B": 32768 // T, "T": T,
                 "H": 16, "HV": 16, "K": D, "V": D, "median_ms": ms, "meaningful": True}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_versus_picks_fla_fastest_mode_per_shape() -> None:
    vs, against = d.versus(sweep_rows())
    assert against == "fla" and vs is not None and len(vs) == 5
    by = vs.set_index(["T", "K"])
    assert by.loc[(1024, 64), "other"] == "fla safe_gate" and by.loc[(1024, 64), "ratio"] == pytest.approx(1.6)
    assert by.loc[(4096, 64), "other"] == "fla default" and by.loc[(4096, 64), "ratio"] == pytest.approx(1.5)
    assert by.loc[(1024, 128), "ratio"] == pytest.approx(0.9)  # fla faster: below 1
    assert by.loc[(4096, 128), "other_ms"] == 1.8
    text = d.headline(vs, "fla")
    assert "faster on 2 of 5 shapes" in text and "0.75× to 1.60×" in text
    no_fla, against = d.versus(sweep_rows().query("not impl.str.startswith('fla')", engine="python"))
    assert against == "default" and no_fla is not None
    assert no_fla.set_index(["T", "K"]).loc[(4096, 64), "ratio"] == pytest.approx(1.2)
    assert d.versus(None) == (None, "")
    assert d.versus(sweep_rows().query("impl != 'tuned'")) == (None, "")


def test_decode_columns_are_batches_and_graph_rows_their_own() -> None:
    base = {"kernel": "fused_recurrent_kda", "dtype": "bf16", "T": 1, "H": 16, "HV": 16, "K": 128, "V": 128}
    rows = [
        {**base, "impl": impl, "mode": mode, "B": B, "median_ms": ms, "meaningful": True}
        for B in (32, 256)
        for mode in ("eager", "graph")
        for impl, ms in (("tuned", 0.02 * B / 32), ("fla", 0.03 * B / 32))
    ]
    vs, _ = d.versus(pd.DataFrame(rows))
    assert vs is not None and set(vs["use"]) == {"decode"}
    grid = d.heatmap_rows(vs)
    assert sorted(set(grid["row"])) == ["fused_recurrent_kda D128", "fused_recurrent_kda D128 (graph)"]
    assert list(dict.fromkeys(grid.sort_values("col_order")["col"])) == ["B=32", "B=256"]
    plain = d.heatmap_rows(d.versus(sweep_rows())[0])  # type: ignore[arg-type]
    assert set(plain["row"]) == {"chunk_kda D64", "chunk_kda D128", "chunk_kda D256"} and set(plain["use"]) == {
        "prefill"
    }


def test_grouped_and_packed_shapes_keep_their_own_cells_and_lines() -> None:
    """One 32K prompt, the same with HV = 2H, and 16 packed prompts: the grouped one a row of its own, the packed batch
    a column of its own after the sequence lengths (not at T = 52640: it is not one prompt of that length), never
    one cell (the H200 report of 2026-11-30 first showed Gated DeltaNet's grouped-head ratio, 1.07×, in the plain 32K
    cell), and no point on a line along T."""
    base = {"kernel": "chunk_gated_delta_rule", "dtype": "bf16", "mode": "eager", "B": 1, "H": 16, "K": 128, "V": 128}
    shapes = [
        (1024, 16, 32, 0.6, 1.0),
        (32768, 16, 1, 1.0, 1.5),
        (65536, 16, 1, 2.0, 3.0),
        (32768, 32, 1, 1.8, 1.9),
        (52640, 16, 16, 1.3, 1.5),
    ]
    rows = [
        {**base, "T": T, "HV": hv, "N": n, "B": 32 if T == 1024 else 1, "impl": impl, "median_ms": ms}
        for T, hv, n, mine, fla in shapes
        for impl, ms in (("tuned", mine), ("fla", fla))
    ]
    frame = pd.DataFrame(rows)
    vs, _ = d.versus(frame)
    assert vs is not None and len(vs) == 5
    grid = d.heatmap_rows(vs)
    cells = grid.set_index(["row", "col"])["ratio"]
    assert cells[("chunk_gated_delta_rule D128", "T=32768")] == pytest.approx(1.5)
    assert cells[("chunk_gated_delta_rule D128 HV=2H", "T=32768")] == pytest.approx(1.9 / 1.8)
    assert cells[("chunk_gated_delta_rule D128", "16 packed")] == pytest.approx(1.5 / 1.3)
    order = list(dict.fromkeys(grid.sort_values("col_order")["col"]))
    assert order == ["T=1024", "T=32768", "T=65536", "16 packed"]  # the packed batch after every length
    lines = d.speedup_lines(frame, "T", "fla")
    assert set(lines["line"]) == {"chunk_gated_delta_rule D128"}  # the variants have one point each: no line
    assert list(lines["x"]) == [1024, 32768, 65536]  # and the packed batch is no point of it
    assert d.shape_label(vs[vs["N"] == 16].iloc[0]) == "B1 T52640 H16 D128 16 packed"


def test_uses_and_untuned_buckets() -> None:
    """A training step (mode fwd+bwd) and decode rows are their own uses; an untuned bucket is marked, from bench.csv's
    config_match, else from config_source (older files name the bucket the lookup took: compared with the row's)."""
    base = {"dtype": "bf16", "H": 16, "HV": 16, "K": 128, "V": 128, "meaningful": True}
    rows = []
    for kernel, mode, B, T, N, source, match in [
        ("chunk_kda", "eager", 8, 4096, 8, "h200.json: T=4096 B=8 H=16", None),  # older file: its own bucket
        ("chunk_kda", "eager", 2, 16384, 2, "h200.json: T=4096 B=8 H=16", None),  # older file: another bucket
        ("chunk_kda", "eager", 1, 52640, 16, "h200.json: T=3290 B=16 H=16", None),  # packed: mean length, sequences
        ("chunk_kda", "eager", 1, 65536, 1, "borrowed: h200.json T32768-B1-H16-HV16-K128-V128", "borrowed"),
        ("chunk_kda_bwd", "fwd+bwd", 8, 4096, 8, "store", None),  # unknown
        ("fused_recurrent_kda", "graph", 32, 1, 32, "default (no tuned config in the store)", "default"),
    ]:
        for impl, ms in (("tuned", 1.0), ("fla", 1.5)):
            row = {**base, "kernel": kernel, "mode": mode, "B": B, "T": T, "N": N, "impl": impl, "median_ms": ms}
            row["config_source"] = source if impl == "tuned" else "fla default"
            if match is not None:
                row["config_match"] = match if impl == "tuned" else ""
            rows.append(row)
    vs, against = d.versus(pd.DataFrame(rows))
    assert vs is not None and against == "fla"
    got = {(r.kernel, r.T): (r.use, r.match) for r in vs.itertuples()}
    assert got == {
        ("chunk_kda", 4096): ("prefill", "exact"),
        ("chunk_kda", 16384): ("prefill", "borrowed"),
        ("chunk_kda", 52640): ("prefill", "exact"),
        ("chunk_kda", 65536): ("prefill", "borrowed"),
        ("chunk_kda_bwd", 4096): ("training", ""),
        ("fused_recurrent_kda", 1): ("decode", "default"),
    }
    grid = d.heatmap_rows(vs)
    assert grid.set_index(["kernel", "T"])["untuned"].to_dict() == {
        ("chunk_kda", 4096): False,
        ("chunk_kda", 16384): True,
        ("chunk_kda", 52640): False,
        ("chunk_kda", 65536): True,
        ("chunk_kda_bwd", 4096): False,
        ("fused_recurrent_kda", 1): True,
    }
    training = grid[grid["use"] == "training"]
    assert training["row"].tolist() == ["chunk_kda D128"] and training["col"].tolist() == ["B8 T4096"]
    prefill = grid[grid["use"] == "prefill"]
    assert d.headline(prefill, "fla", "prefill") == (
        "Prefill (chunk forward): 1.50× (geometric mean of 4 shapes; faster on 4, 1.50× to 1.50×) against "
        "flash-linear-attention's fastest mode (above 1×: dtune faster). 2 shapes ran the config of an untuned "
        "bucket (†)."
    )
    assert d.headline(grid[grid["use"] == "decode"], "fla", "decode").startswith("Decode (fused recurrent): 1.50× (one")
    table = d.versus_table(vs, "fla")
    assert table["dtune config"].tolist() == ["exact", "borrowed", "exact", "borrowed", "–", "default"]


def test_importance_table_keeps_the_top_three() -> None:
    frame = pd.DataFrame(
        [
            {"study": STUDY_A, "param": p, "importance": v, "evaluator": "fANOVA"}
            for p, v in (("BT", 0.1), ("SEG_CHUNKS", 0.6), ("BV", 0.2), ("num_warps", 0.1))
        ]
        + [{"study": STUDY_B, "param": "BT", "importance": 1.0, "evaluator": "fANOVA"}]
    )
    t = d.importance_table(frame)
    assert t.columns.tolist() == ["study", "#1", "#2", "#3"]
    assert t.iloc[0].tolist() == ["chunk_kda T1024 D64", "SEG_CHUNKS 0.60", "BV 0.20", "BT 0.10"]
    assert t.iloc[1].tolist() == ["chunk_kda T4096 D64", "BT 1.00", "–", "–"]


def test_speedup_lines_keep_real_sweeps_only() -> None:
    by_t = d.speedup_lines(sweep_rows(), "T", "fla")
    assert list(zip(by_t["line"], by_t["x"], by_t["speedup"].round(4))) == [
        ("chunk_kda D128", 1024, 0.9),
        ("chunk_kda D128", 4096, 0.9),
        ("chunk_kda D64", 1024, 1.6),
        ("chunk_kda D64", 4096, 1.5),
    ]  # D256 has one T: no line
    by_d = d.speedup_lines(sweep_rows(), "K", "default")
    assert by_d.groupby("line")["x"].apply(list).to_dict() == {
        "chunk_kda T1024": [64, 128],
        "chunk_kda T4096": [64, 128, 256],
    }
    assert by_d.set_index(["line", "x"]).loc[("chunk_kda T4096", 256), "speedup"] == pytest.approx(1.1)
    one_t = sweep_rows().query("T == 4096")
    assert d.speedup_lines(one_t, "T", "fla").empty


def test_stage_floors_label_each_stage() -> None:
    f = d.stage_floors(profile_rows().assign(floor_ms=0.5, x_floor=2.0, bound="memory"))
    assert f["label"].tolist()[:2] == ["chunk_kda D128 T4096 · cumsum", "chunk_kda D128 T4096 · solve"]
    assert f["label"].iloc[-1] == "chunk_kda D128 T4096 · total (whole op)"
    assert f["measured_ms"].tolist() == [0.1, 0.3, 0.6, 1.05]


def test_load_run_reads_folders_recursively_with_one_commit_per_source(tmp_path: Path) -> None:
    """A results folder: run folders and bench_<kernel>/bench.csv files; commits from each file's own record."""
    root = tmp_path / "results"
    make_run_folder(root)  # run.json says commit 83e632d
    extra = root / "bench_more"
    extra.mkdir()
    sweep_rows().assign(commit="abcdef0123456789abcdef0123456789abcdef01").to_csv(extra / "bench.csv", index=False)
    old = root / "old"
    old.mkdir()
    sweep_rows().to_csv(old / "bench.csv", index=False)  # no commit recorded anywhere
    data = d.load_run(root)
    kinds = {(s.kind, s.path): s.commits for s in data.sources}
    assert kinds[("trials", "run-h200-chunk_kda/trials.csv")] == ["83e632d"]
    assert kinds[("bench", "run-h200-chunk_kda/bench.csv")] == ["83e632d"]  # the run.json beside it
    assert kinds[("bench", "bench_more/bench.csv")] == ["abcdef0"]  # the file's own column, shortened
    assert kinds[("bench", "old/bench.csv")] == [d.NOT_RECORDED]
    synthetic = len(pd.read_csv(root / "run-h200-chunk_kda" / "bench.csv"))
    assert data.bench is not None and len(data.bench) == synthetic + 2 * len(sweep_rows())
    (root / "provenance.json").write_text(json.dumps({"commits": {"old": "1234567"}, "note": "from NOTES.md"}))
    data = d.load_run(root)
    assert {(s.kind, s.path): s.commits for s in data.sources}[("bench", "old/bench.csv")] == ["1234567"]
    assert data.notes == ["results: from NOTES.md"]  # an absolute folder by its name: no build-machine paths
    assert d.commits(data) == ["83e632d", "abcdef0", "1234567"]


def test_load_run_of_several_folders(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_run_folder(a)
    b.mkdir()
    sweep_rows().to_csv(b / "bench.csv", index=False)
    data = d.load_run([a, b])
    assert data.trials is not None and data.bench is not None
    # absolute folders (e.g. a temporary one) by their name, never the machine's path
    assert set(data.bench["source"]) == {"a/run-h200-chunk_kda/bench.csv", "b/bench.csv"}
    assert all(not s.path.startswith(str(tmp_path)) for s in data.sources)
    monkey = Path("rel")  # a relative folder keeps the path as given
    assert d._root_label(monkey) == "rel" and d._root_label(tmp_path / "x") == "x"
