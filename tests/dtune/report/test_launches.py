"""The report's per-launch section: launches.csv read with the other files, its bars and table, the section."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dtune.measure.launches import CALL
from dtune.report import data as d
from dtune.report.build import NothingToReport, build_report

from .test_data import bench_rows

SHAPE = {"kernel": "chunk_kda", "mode": "fwd+bwd", "dtype": "bf16", "B": 8, "T": 4096, "H": 16, "HV": 16, "K": 128,
         "V": 128, "N": 8, "meaningful": True}  # fmt: skip


def row(impl: str, position: int, launch: str, ms: float, stage: str = "", floor: float = math.nan) -> dict[str, Any]:
    return {**SHAPE, "impl": impl, "position": position, "launch": launch, "count": 1.0, "ms": ms, "share": 0.1,
            "stage": stage, "stage_ms": ms, "floor_ms": floor, "x_floor": ms / floor, "note": ""}  # fmt: skip


def launches() -> pd.DataFrame:
    dtune = [
        row("tuned", 1, "chunk_intra_blocks_kernel", 0.3, "fwd intra", 0.1),
        row("tuned", 2, "chunk_intra_blocks_kernel", 0.1, "fwd intra"),  # the stage's second launch
        row("tuned", 3, "chunk_bwd_dqk_kernel", 2.0, "bwd dq/dk/dv (fused)", 0.5),
        row("tuned", 4, "void at::native::fill", 0.05),  # no stage: under its own name
        row("tuned", 0, CALL, 2.6, floor=0.4),
    ]
    fla = [row("fla", i, f"fla_kernel_{i}", 0.1 * i) for i in range(1, 11)] + [row("fla", 0, CALL, 5.8, floor=0.4)]
    return pd.DataFrame(dtune + fla)


def test_segments_by_stage_for_dtune_and_largest_kernels_for_a_peer() -> None:
    assert d.LAUNCH_CALL == CALL
    bars = d.launch_segments(launches())
    assert set(bars["group"]) == {"chunk_kda D128 B8 T4096 fwd+bwd"}
    mine = bars[bars["impl"] == "tuned"].set_index("segment")
    assert mine["ms"].to_dict() == pytest.approx(
        {"fwd intra": 0.4, "bwd dq/dk/dv (fused)": 2.0, "void at::native::fill": 0.05}
    )
    assert list(mine.index) == ["fwd intra", "bwd dq/dk/dv (fused)", "void at::native::fill"]  # launch order
    assert (mine["call_ms"] == 2.6).all() and (mine["floor_ms"] == 0.4).all()
    peer = bars[bars["impl"] == "fla"]
    assert len(peer) == d.LAUNCH_SEGMENTS + 1 and peer["segment"].iloc[0] == "fla_kernel_10"  # largest first
    other = peer.set_index("segment").loc["other kernels", "ms"]
    assert other == pytest.approx(sum(0.1 * i for i in range(1, 11 - d.LAUNCH_SEGMENTS)))
    assert peer["ms"].sum() == pytest.approx(sum(0.1 * i for i in range(1, 11)))  # nothing lost


def test_launch_table_keeps_every_row_with_units() -> None:
    table = d.launch_table(launches())
    assert len(table) == len(launches())
    assert list(table.columns[:4]) == ["call", "impl", "position", "launch"]
    assert {"ms", "stage", "floor ms", "× floor", "share (%)"} <= set(table.columns)
    assert table["share (%)"].iloc[0] == 10.0


def test_the_report_reads_launches_csv_and_draws_the_section(tmp_path: Path) -> None:
    folder = tmp_path / "results" / "launches_chunk_kda"
    folder.mkdir(parents=True)
    launches().assign(commit="abcdef1").to_csv(folder / "launches.csv", index=False)
    data = d.load_run(tmp_path / "results")
    assert data.launches is not None and len(data.launches) == len(launches())
    assert any(s.kind == "launches" and s.commits == ["abcdef1"] for s in data.sources)
    out, states = build_report(tmp_path / "results", tmp_path / "r.html")
    assert states["launches"] == "ok"
    page = out.read_text()
    assert "Every launch of the forward and the training step" in page and "chunk_kda D128 B8 T4096 fwd+bwd" in page
    other = tmp_path / "bench_only"  # a folder with other results: the section says how to get it
    other.mkdir()
    bench_rows().to_csv(other / "bench.csv", index=False)
    _, states = build_report(other, tmp_path / "e.html")
    assert states["launches"].startswith("no launches.csv: run `dtune profile")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NothingToReport, match="nothing to report"):
        build_report(empty, tmp_path / "x.html")
