"""dtune bench: grid, tuned-config lookup, baselines wiring, speedups, and an end-to-end run under the interpreter."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import typer
from typer.testing import CliRunner

from dtune.cli.measure import register
from dtune.measure import baselines as bl
from dtune.measure import bench as b
from dtune.measure import grids
from dtune.measure.configs import ConfigSource, config_match
from dtune.shape import Gate, Shape
from dtune.store import Entry, TunedConfigs


def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_int_list_is_the_cli_s_one_parser() -> None:
    r = CliRunner().invoke(cli(), ["bench", "--kernel", "fused_recurrent_kda", "--seq-lens", "12,x"])
    assert r.exit_code == 2 and "comma-separated" in r.output


def test_grids() -> None:
    g = grids.default_grid("chunk_kda", on_gpu=True)
    probs = grids.bench_shapes(g, Gate.CHANNEL)
    assert [(p.B, p.T, p.K) for p in probs[:3]] == [(32, 1024, 64), (8, 4096, 64), (2, 16384, 64)]
    assert len(probs) == 6 and all(p.H == 16 and p.gate is Gate.CHANNEL for p in probs)
    dec = grids.default_grid("fused_recurrent_kda", on_gpu=True).shapes(Gate.CHANNEL)
    assert sorted({(p.T, p.B) for p in dec}) == [(1, 1), (1, 32), (1, 256)]
    g = grids.make_grid("chunk_delta_rule", True, seq_lens=[2048], head_dims=[256], heads=[8], batch_tokens=8192)
    assert [(p.B, p.T, p.H, p.K) for p in g.shapes(Gate.NONE)] == [(4, 2048, 8, 256)]
    g = grids.make_grid("chunk_delta_rule", True, seq_lens=[2048], batches=[3, 5], batch_tokens=8192)
    assert sorted({p.B for p in g.shapes(Gate.NONE)}) == [3, 5]  # --batch wins over --batch-tokens
    tiny = grids.default_grid("chunk_kda", on_gpu=False).shapes(Gate.CHANNEL)
    assert max(p.T * p.K for p in tiny) <= 32 * 16


def entry(
    T: int, K: int, BV: int, H: int = 16, B: int = 1, kernel: str = "fused_recurrent_kda", dtype: str = "bf16"
) -> dict[str, Any]:
    return {
        "kernel": kernel,
        "dtype": dtype,
        "bucket": {"T": T, "B": B, "H": H, "HV": H, "K": K, "V": K},
        "config": {"BV": BV},
    }


def tuned_doc(*entries: dict[str, Any]) -> str:
    """A schema-1 tuned.json, as `dtune search` / `dtune export` write it."""
    return json.dumps({"schema": 1, "gpu": "cpu", "gpu_name": "CPU", "entries": list(entries)})


def table(*entries: dict[str, Any]) -> TunedConfigs:
    """A tuned-config table of these entries, unvalidated (as dtune.store indexes a file)."""
    return TunedConfigs(
        "cpu", "CPU", "test", [Entry(e["kernel"], e["dtype"], e["bucket"], e["config"]) for e in entries]
    )


def test_the_bench_picks_entries_by_the_store_s_bucket_rule() -> None:
    t = table(entry(1, 64, 8), entry(1, 128, 16), entry(1, 128, 32, B=256), entry(1, 128, 64, kernel="other"))
    p = Shape(B=200, T=1, H=16, HV=16, K=128, V=128, N=200, gate=Gate.CHANNEL)
    assert t.lookup("fused_recurrent_kda", "bf16", p) == {"BV": 32}
    p1 = Shape(B=1, T=1, H=16, HV=16, K=64, V=64, N=1, gate=Gate.CHANNEL)
    assert t.lookup("fused_recurrent_kda", "bf16", p1) == {"BV": 8}
    assert t.lookup("fused_recurrent_kda", "fp32", p1) is None
    assert t.lookup("chunk_kda", "bf16", p1) is None


def test_config_source(tmp_path: Path) -> None:
    p = Shape(B=1, T=1, H=2, HV=2, K=16, V=16, N=1, gate=Gate.CHANNEL)
    tuned = tmp_path / "tuned.json"
    tuned.write_text(tuned_doc(entry(1, 16, 8, H=2)))
    cfg, where = ConfigSource.load(tuned).resolve("fused_recurrent_kda", p, torch.bfloat16, torch.device("cpu"))
    assert cfg == {"BV": 8} and where == "exact: tuned.json T1-B1-H2-HV2-K16-V16" and config_match(where) == "exact"
    wider = Shape(B=4, T=1, H=2, HV=2, K=32, V=32, N=4, gate=Gate.CHANNEL)  # an untuned bucket: borrowed
    cfg, where = ConfigSource.load(tuned).resolve("fused_recurrent_kda", wider, torch.bfloat16, torch.device("cpu"))
    assert cfg == {"BV": 8} and where == "borrowed: tuned.json T1-B1-H2-HV2-K16-V16"
    assert config_match(where) == "borrowed"
    cfg, where = ConfigSource.load(tuned).resolve("chunk_kda", p, torch.bfloat16, torch.device("cpu"))
    assert cfg is None and "no entry" in where and config_match(where) == "default"
    plain = tmp_path / "cfg.json"
    plain.write_text(json.dumps({"BV": 4, "num_warps": 1}))
    cfg, where = ConfigSource.load(plain).resolve("fused_recurrent_kda", p, torch.bfloat16, torch.device("cpu"))
    assert cfg == {"BV": 4, "num_warps": 1} and where == f"given: {plain}" and config_match(where) == "given"
    cfg, where = ConfigSource().resolve("fused_recurrent_kda", p, torch.bfloat16, torch.device("cpu"))
    assert cfg is None and where.startswith("default") and config_match(where) == "default"
    assert config_match("fla default") == "" and config_match("h200.json: T=4096 B=8 H=16") == ""


def test_add_speedups_per_shape_and_mode() -> None:
    shape = {"kernel": "fused_recurrent_kda", "dtype": "bf16", "B": 32, "T": 1, "H": 16, "HV": 16, "K": 128, "V": 128}
    rows = [
        {**shape, "impl": "tuned", "mode": "eager", "median_ms": 0.040},
        {**shape, "impl": "default", "mode": "eager", "median_ms": 0.060},
        {**shape, "impl": "fla", "mode": "eager", "median_ms": 0.050},
        {**shape, "impl": "tuned", "mode": "graph", "median_ms": 0.010},
        {**shape, "impl": "default", "mode": "graph", "median_ms": 0.020},
        {**shape, "impl": "fla", "mode": "graph", "median_ms": 0.025},
        {**shape, "B": 1, "impl": "tuned", "mode": "eager", "median_ms": 0.030},
    ]
    f = b.add_speedups(pd.DataFrame(rows))
    assert f["speedup_vs_default"].round(4).tolist()[:6] == [1.5, 1.0, 1.2, 2.0, 1.0, 0.8]
    assert f["speedup_vs_fla"].round(4).tolist()[:6] == [1.25, 0.8333, 1.0, 2.5, 1.25, 1.0]
    assert math.isnan(f["speedup_vs_default"].iloc[6])  # its shape has no default row


def test_fla_call_convention_and_fast_mode() -> None:
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def fake(*args: Any, **kw: Any) -> None:
        seen.append((args, kw))

    x = {n: torch.full((1,), float(i)) for i, n in enumerate(["q", "k", "v", "beta"])}
    x |= {"g": torch.tensor([-7.0, -1.0]), "scale": 0.25, "initial_state": None, "output_final_state": True}
    bl._fla(fake, gated=False)(x)()
    bl._fla(fake, gated=True, safe_gate=True, lower_bound=-5.0)(x)()
    (args0, kw0), (args1, kw1) = seen
    # g and beta go by keyword: fla's gated fused-recurrent op has (q, k, v, g, gk, gv, beta, ...).
    assert len(args0) == 3 and kw0.pop("beta") is x["beta"]
    assert kw0 == {"scale": 0.25, "initial_state": None, "output_final_state": True, "cu_seqlens": None}
    assert len(args1) == 3 and kw1["g"].tolist() == [-5.0, -1.0]  # gates clamped to the lower bound
    assert kw1["beta"] is x["beta"]
    assert kw1["safe_gate"] is True and kw1["lower_bound"] == -5.0


def test_build_impls_names_and_unknown_baseline() -> None:
    impls, notes = bl.build_impls("chunk_kda", ["default", "fla", "torch"], {"BT": 32}, "tuned.json", on_gpu=False)
    assert [i.name for i in impls] == ["tuned", "default", "torch"]
    assert impls[0].config == {"BT": 32}
    assert notes and ("not importable" in notes[0] or "needs a CUDA GPU" in notes[0])
    with pytest.raises(ValueError, match="unknown baseline"):
        bl.build_impls("chunk_kda", ["cudnn"], None, "", on_gpu=False)


def test_bench_end_to_end_under_interpreter(tmp_path: Path) -> None:
    tuned = tmp_path / "tuned.json"
    e = entry(1, 16, 8, H=2, B=2, kernel="fused_recurrent_delta_rule", dtype="fp32")
    tuned.write_text(tuned_doc({**e, "config": {"BV": 8, "num_warps": 1}}))
    grid = grids.make_grid("fused_recurrent_delta_rule", on_gpu=False)
    res = b.run_bench("fused_recurrent_delta_rule", grid, torch.float32, ["default", "torch"], tuned, graph=True)
    assert res.frame is not None
    f = res.frame
    assert list(f.columns) == b.COLUMNS
    assert len(f) == 2 * 3  # two batch sizes x (tuned, default, torch); no graph rows without CUDA
    assert set(f["impl"]) == {"tuned", "default", "torch"} and set(f["mode"]) == {"eager"}
    assert f["median_ms"].gt(0).all() and not f["meaningful"].any()
    assert any("NOT meaningful" in n for n in res.notes) and any("--graph needs CUDA" in n for n in res.notes)
    tuned_rows = f[f["impl"] == "tuned"]
    assert (tuned_rows["config_source"].str.contains("tuned.json T1-B2-H2-HV2-K16-V16")).all()
    assert list(tuned_rows["config_match"]) == ["borrowed", "exact"]  # the grid's other batch was not tuned
    assert (f[f["impl"] != "tuned"]["config_match"] == "").all()
    assert json.loads(tuned_rows["config"].iloc[0]) == {"BV": 8, "num_warps": 1}
    d = f[f["impl"] == "default"]
    assert (d["speedup_vs_default"] == 1.0).all()
    assert f["error_o"].lt(1e-4).all(), f[["impl", "error_o"]]  # fp32 kernels and reference vs float64
    # GB/s and TFLOP/s are the roofline model over the measured time.
    row = f.iloc[0]
    assert row["gbs"] == pytest.approx(row["bytes"] / (row["median_ms"] * 1e-3) / 1e9)
    csv_path, json_path = b.write(res, tmp_path / "out")
    assert pd.read_csv(csv_path).shape == f.shape
    assert len(json.loads(json_path.read_text())) == len(f)


def test_bench_cli_json_and_default_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    (run / "tuned.json").write_text(tuned_doc())
    args = ["bench", "--kernel", "fused_recurrent_kda", "--baselines", "default", "--head-dims", "16"]
    r = CliRunner().invoke(cli(), [*args, "--batch", "1", "--config", str(run / "tuned.json"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert {row["impl"] for row in out["rows"]} == {"tuned", "default"}
    assert Path(out["csv"]) == run / "bench.csv"  # next to the run folder's tuned.json
    r = CliRunner().invoke(cli(), [*args, "--batch", "1"])
    assert r.exit_code == 0, r.output
    assert "dtune bench" in r.output and (tmp_path / "reports" / "bench.csv").exists()
    r = CliRunner().invoke(cli(), ["bench", "--kernel", "nope"])
    assert r.exit_code == 2 and "unknown kernel" in r.output


def test_a_stopped_bench_keeps_its_finished_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.csv is written as each shape finishes: a run stopped at its second shape (a time limit, Ctrl-C) leaves
    the first shape's rows on disk (and, with --record, in the config file)."""
    real = b._shape_rows
    calls: list[int] = []

    def second_shape_stops(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(b, "_shape_rows", second_shape_stops)
    out = tmp_path / "out"
    args = ["bench", "-k", "fused_recurrent_kda", "--baselines", "default", "--head-dims", "16", "--batch", "1,2"]
    r = CliRunner().invoke(cli(), [*args, "--heads", "1", "--seq-lens", "1", "--out", str(out)])
    assert r.exit_code != 0 and len(calls) == 2
    rows = pd.read_csv(out / "bench.csv")
    assert set(rows["B"]) == {1} and set(rows["impl"]) == {"tuned", "default"}


def test_bench_of_the_models_buckets(tmp_path: Path) -> None:
    """--models: the shapes the models call the kernel with (tiny ones of the same head ratio under the interpreter),
    the packed batch as a run of its own in the same table; with --mode fwd+bwd the training step's; shape options
    beside it, --tp without it, or a kernel no such model calls: one error line each."""
    base = ["bench", "--interpret", "--baselines", "", "--out", str(tmp_path), "--json"]
    r = CliRunner().invoke(cli(), [*base, "-k", "chunk_gated_delta_rule", "--models", "qwen3_next", "--tp", "1,4"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout[r.stdout.index("{") :])["rows"]
    assert {(x["H"], x["HV"]) for x in rows} == {(1, 2)}  # Qwen3-Next's grouped value heads, HV = 2H
    packed = [x for x in rows if x["N"] != x["B"]]
    assert len(packed) == 1 and len(rows) > 1 and len(pd.read_csv(tmp_path / "bench.csv")) == len(rows)
    r = CliRunner().invoke(cli(), [*base, "-k", "chunk_gated_delta_rule", "--models", "all", "--mode", "fwd+bwd"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout[r.stdout.index("{") :])["rows"]
    assert {x["kernel"] for x in rows} == {"chunk_gated_delta_rule_bwd"} and len(rows) == 1
    for args, match in [
        (["-k", "chunk_kda", "--models", "kimi_linear", "--seq-lens", "64"], "--models gives the shapes"),
        (["-k", "chunk_kda", "--tp", "2"], "--tp goes with --models"),
        (["-k", "chunk_delta_rule", "--models", "qwen3_next"], "none of chunk_delta_rule is called by qwen3_next"),
        (["-k", "chunk_kda", "--models", "nope"], "unknown model nope"),
    ]:
        r = CliRunner().invoke(cli(), [*base, *args])
        assert r.exit_code == 2 and match in " ".join(r.output.split()), r.output


def test_bench_chunk_kernel_runs_under_interpreter(tmp_path: Path) -> None:
    """Every contestant runs and is checked against the float64 reference: a chunk pipeline that writes zeros (or
    nothing) shows as a large error here, not only as a time."""
    grid = grids.make_grid("chunk_gated_delta_rule", on_gpu=False, seq_lens=[16], head_dims=[16], heads=[1])
    res = b.run_bench("chunk_gated_delta_rule", grid, torch.float32, ["default", "torch"])
    f = res.frame.set_index("impl")
    for impl in ("tuned", "default", "torch"):
        assert f.loc[impl, "median_ms"] > 0, f.loc[impl, "note"]
        assert f.loc[impl, "error_o"] < 1e-4, impl  # strong decays (log gates down to -5), fp32
    assert res.wrong_outputs().empty


def test_tuned_grid_takes_the_config_shapes() -> None:
    t = table(
        entry(4, 32, 32, H=2, B=2),
        entry(1, 16, 8, H=2, B=3),
        entry(1, 16, 8, H=2, B=3),  # a duplicate bucket is benchmarked once
        entry(1, 64, 8, dtype="fp32"),
        entry(1, 64, 8, kernel="chunk_kda"),
    )  # (an incomplete bucket never gets this far: the store rejects the file)
    source = ConfigSource(path=Path("tuned.json"), table=t)
    g = source.tuned_grid("fused_recurrent_kda", torch.bfloat16, on_gpu=True)
    assert g is not None
    assert [(p.B, p.T, p.H, p.K) for p in g.shapes(Gate.CHANNEL)] == [(3, 1, 2, 16), (2, 4, 2, 32)]
    assert source.tuned_grid("chunk_delta_rule", torch.bfloat16, on_gpu=True) is None


def test_bench_cli_uses_tuned_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default output folder, reports/, is relative to the working directory
    tuned = tmp_path / "tuned.json"
    tuned.write_text(tuned_doc(entry(3, 16, 8, H=1, B=2)))
    args = ["bench", "--kernel", "fused_recurrent_kda", "--baselines", "default", "--config", str(tuned), "--json"]
    r = CliRunner().invoke(cli(), args)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    assert {(row["B"], row["T"], row["H"], row["K"]) for row in rows} == {(2, 3, 1, 16)}
    tuned_row = next(row for row in rows if row["impl"] == "tuned")
    assert json.loads(tuned_row["config"]) == {"BV": 8}
    assert tuned_row["first_call_s"] > 0


def test_bench_cli_rejects_an_illegal_tuned_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tuned = tmp_path / "tuned.json"
    tuned.write_text(tuned_doc({**entry(1, 16, 8, H=1), "config": {"BV": 7}}))
    r = CliRunner().invoke(cli(), ["bench", "--kernel", "fused_recurrent_kda", "--config", str(tuned)])
    assert r.exit_code == 2 and "illegal config" in r.output


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy overflows on the interpreter's bf16 garbage
def test_bf16_chunk_on_the_interpreter_is_flagged() -> None:
    grid = grids.make_grid("chunk_delta_rule", on_gpu=False, seq_lens=[16], head_dims=[16], heads=[1])
    res = b.run_bench("chunk_delta_rule", grid, torch.bfloat16, ["torch"])
    assert b.INTERPRETER_BF16_DOT in res.notes
    assert res.frame.set_index("impl").loc["torch", "error_o"] < 1e-2  # the reference itself is fine in bf16 inputs
