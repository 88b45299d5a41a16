"""The plan of ``dtune tune-gpu`` (dtune.tune.grid): buckets from the search spaces, anchor first, the rest nearest
first, shares of the budget, the estimate, the interpreter's tiny plan, the job's record; ``[tune]`` parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtune.shape import Shape
from dtune.tune import grid
from dtune.tune.grid import Ledger, make_plan
from dtune.tune.space import RunCosts, SpaceError, load_space, parse_space
from dtune.tune.transfer import bucket_distance

ROOT = Path(__file__).resolve().parents[3]
# the chunk kernels' search costs: the default of a space without its own
RUN_START_S, BUCKET_END_S, STARTS_S = RunCosts().run_start_s, RunCosts().bucket_end_s, RunCosts().starts_s


def test_a_chunk_kernel_is_its_anchor_then_the_grid_nearest_first_then_the_packed_batch() -> None:
    plan = make_plan(["chunk_kda"], {"chunk_kda": "bf16"}, budget=90)
    anchor, rest, packed = plan.steps
    assert [s.name for s in plan.steps] == ["anchor", "grid", "packed"]
    assert [b.shape.key for b in anchor.buckets] == ["T4096-B8-H16-HV16-K128-V128"] and anchor.seconds == 90
    a = anchor.buckets[0].shape
    keys = [b.shape.key for b in rest.buckets]
    grid_keys = {s.key for s in load_space("chunk_kda").shapes.shapes()} - {a.key}
    long = {"T8192-B1-H16-HV16-K128-V128", "T32768-B1-H16-HV16-K128-V128", "T65536-B1-H16-HV16-K128-V128"}
    assert set(keys) == grid_keys | long | {"T32768-B1-H16-HV32-K128-V128"} and len(keys) == len(set(keys)) == 12
    distances = [bucket_distance(b.shape, a.bucket()) for b in rest.buckets]
    assert distances == sorted(distances) and keys[0] == "T8192-B1-H16-HV16-K128-V128"
    assert all(b.shape.N == b.shape.B for b in rest.buckets)  # B = 1 prompts are one sequence each
    assert rest.seconds == packed.seconds == round(90 * 0.34)
    (p,) = packed.buckets
    assert p.packed is not None and len(p.packed) == 16 and sum(p.packed) == 52640
    assert (p.shape.B, p.shape.N, p.shape.T, p.shape.K) == (16, 16, 3290, 128)  # as calls with cu_seqlens look it up
    assert p.key.endswith(":packed") and p.key != rest.buckets[0].key


def test_forward_kernels_come_first_and_a_backward_kernel_tunes_the_training_grid() -> None:
    kernels = ["chunk_kda_bwd", "fused_recurrent_kda", "chunk_kda", "chunk_gated_delta_rule_bwd"]
    plan = make_plan(kernels, dict.fromkeys(kernels, "bf16"), budget=60)
    assert plan.kernels == ["chunk_kda", "fused_recurrent_kda", "chunk_kda_bwd", "chunk_gated_delta_rule_bwd"]
    anchor, rest = [s for s in plan.steps if s.kernel == "chunk_kda_bwd"]
    assert anchor.name == "anchor" and len(anchor.buckets) == 1 and anchor.seconds == 90
    # T 1024 / 4096 / 16384 at D 64 and 128 (B·T = 32768) but the anchor, one long prompt; Gated DeltaNet also HV = 2H
    keys = {b.shape.key for b in rest.buckets}
    assert keys == {
        "T1024-B32-H16-HV16-K64-V64", "T4096-B8-H16-HV16-K64-V64", "T16384-B2-H16-HV16-K64-V64",
        "T1024-B32-H16-HV16-K128-V128", "T16384-B2-H16-HV16-K128-V128", "T32768-B1-H16-HV16-K128-V128",
    } and rest.seconds == 30  # fmt: skip
    gdn = [b.shape.key for s in plan.steps if s.kernel == "chunk_gated_delta_rule_bwd" for b in s.buckets]
    assert "T4096-B8-H16-HV32-K128-V128" in gdn and len(gdn) == 8
    fused = [s for s in plan.steps if s.kernel == "fused_recurrent_kda"]
    assert [b.shape.key for b in fused[0].buckets] == ["T1-B32-H16-HV16-K128-V128"]
    assert len(fused[1].buckets) == 11 and fused[0].seconds == 10 and fused[1].seconds == 5  # 60 x 0.17, 60 x 0.09
    assert grid.default_kernels()[-3:] == ["chunk_delta_rule_bwd", "chunk_gated_delta_rule_bwd", "chunk_kda_bwd"]


def test_the_estimate_is_the_budgets_plus_the_measured_costs_of_what_is_left() -> None:
    plan = make_plan(["chunk_delta_rule"], {"chunk_delta_rule": "bf16"}, budget=30)
    anchor, rest, packed = plan.steps
    assert (anchor.seconds, rest.seconds, packed.seconds) == (30, 10, 10)
    short = STARTS_S + BUCKET_END_S  # a budget under the first answers' time costs that time
    expected = 3 * RUN_START_S + 30 + BUCKET_END_S + 12 * short + short
    assert plan.tune_s() == pytest.approx(expected)
    done = {b.key: {} for b in (*anchor.buckets, *rest.buckets[:5])}
    left = RUN_START_S + 7 * short + RUN_START_S + short
    assert plan.tune_s(done) == pytest.approx(left)
    bench = 13 * grid.BENCH_SHAPE_S + grid.BENCH_PACKED_S
    assert plan.bench_s() == pytest.approx(bench) and plan.bench_s(["chunk_delta_rule"]) == 0


def test_the_interpreter_plan_keeps_its_structure_at_tiny_shapes() -> None:
    plan = make_plan(["chunk_kda"], {"chunk_kda": "fp32"}, budget=10, interpret=True)
    shapes = [b.shape for b in plan.buckets()]
    assert all(s.K == s.V == 16 and s.H == 1 and s.T <= 20 for s in shapes)
    assert len({(s.key, b.packed) for s, b in zip(shapes, plan.buckets())}) == len(shapes)  # collapsed buckets merged
    assert plan.steps[0].buckets[0].shape.key == "T9-B2-H1-HV1-K16-V16"
    assert any(s.HV == 2 * s.H for s in shapes)  # grouped value heads survive
    assert plan.steps[-1].packed == grid.TINY_PACKED and plan.dtype("chunk_kda") == "fp32"


def test_a_bad_budget_or_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="--budget"):
        make_plan(["chunk_kda"], {"chunk_kda": "bf16"}, budget=0)
    with pytest.raises(ValueError, match=r"nope"):
        make_plan(["nope"], {"nope": "bf16"})


def space_with(tune: dict[str, object]) -> dict[str, object]:
    return {
        "kernel": "fused_recurrent_kda",
        "params": {"BV": [16, 32]},
        "tolerance": {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2},
        "shapes": {"seq_lens": [1], "head_dims": [64], "heads": [4], "batch": [1, 8]},
        "tune": tune,
    }


@pytest.mark.parametrize(
    ("tune", "match"),
    [
        ({"anchor": {"T": 1}}, "anchor must be"),
        ({"anchor": {"T": 1, "D": 64, "X": 1}}, "anchor must be"),
        ({"extra": [{"T": 8}]}, r"extra\[0\]"),
        ({"extra": [{"T": 8, "B": 0}]}, "positive integer"),
        ({"bucket_share": 0}, "bucket_share"),
        ({"grid": "yes"}, "grid must be"),
        ({"budget": 3}, "unknown key"),
        ({"costs": {"run_start_s": -1}}, "costs.run_start_s"),
        ({"costs": {"startup": 3}}, "costs must be a table"),
        ({"costs": 3}, "costs must be a table"),
    ],
)
def test_a_bad_tune_section_names_the_problem(tune: dict[str, object], match: str) -> None:
    with pytest.raises(SpaceError, match=match):
        parse_space(space_with(tune), "x.toml")


def test_each_kernel_is_estimated_with_its_own_measured_costs() -> None:
    """A space's ``[tune] costs`` replace the chunk kernels' defaults in its searches' estimate (and in what fits a
    --timeout); the shipped decode spaces carry their own, far smaller (one small kernel: seconds to compile)."""
    costs = {"run_start_s": 15, "bucket_end_s": 1, "starts_s": 1.5}
    own = parse_space(space_with({"costs": costs}), "x.toml")
    (anchor, rest) = grid.kernel_steps(own, "bf16", budget=30)
    assert anchor.costs == RunCosts(15.0, 1.0, 1.5) and rest.costs == anchor.costs
    assert rest.seconds == 10 and rest.estimate_s() == pytest.approx(15 + 1 * (10 + 1))
    plain = parse_space(space_with({}), "x.toml")
    (_, rest) = grid.kernel_steps(plain, "bf16", budget=30)
    assert rest.estimate_s() == pytest.approx(RUN_START_S + max(10, STARTS_S) + BUCKET_END_S)
    decode = make_plan(["fused_recurrent_kda"], {"fused_recurrent_kda": "bf16"}, budget=15)
    (fused_anchor, fused_grid) = decode.steps
    assert fused_grid.seconds == 1 and len(fused_grid.buckets) == 11
    # measured on the H100: 10 such buckets took 33-39 s of trials a kernel; the chunk kernels' costs said 5 min
    assert 25 < fused_grid.estimate_s() < 60


def test_a_space_without_anchor_starts_from_the_grid_middle() -> None:
    space = parse_space(space_with({}), "x.toml")
    (step, rest) = grid.kernel_steps(space, "bf16", budget=30)
    assert step.buckets[0].shape.key == "T1-B8-H4-HV4-K64-V64" and [b.shape.B for b in rest.buckets] == [1]
    anchored = parse_space(space_with({"anchor": {"T": 1, "D": 64, "B": 1}, "grid": False}), "x.toml")
    assert [s.name for s in grid.kernel_steps(anchored, "bf16", 30)] == ["anchor"]


def test_the_record_round_trips_and_belongs_to_one_gpu(tmp_path: Path) -> None:
    ledger = Ledger.load(tmp_path, "h200")
    assert not ledger.done and not ledger.path.exists()
    ledger.done["chunk_kda:T4096-B8-H16-HV16-K128-V128"] = {"run": "runs/chunk_kda/anchor", "best_ms": 1.0}
    ledger.benched["chunk_kda"] = 1
    ledger.save()
    again = Ledger.load(tmp_path, "h200")
    assert again.done == ledger.done and again.benched == {"chunk_kda": 1} and again.done_of("chunk_kda") == 1
    assert again.benched_now(tmp_path) == []  # no bench folder: not benched
    (tmp_path / "bench" / "chunk_kda").mkdir(parents=True)
    assert again.benched_now(tmp_path) == ["chunk_kda"]
    with pytest.raises(ValueError, match="not this 'h100'"):
        Ledger.load(tmp_path, "h100")
    ledger.path.write_text("{")
    with pytest.raises(ValueError, match="not a tune-gpu record"):
        Ledger.load(tmp_path, "h200")


def test_the_record_adds_up_the_runs_of_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 130.0, 160.0, 500.0, 520.0])
    monkeypatch.setattr(grid.time, "monotonic", lambda: next(clock))
    first = Ledger.load(tmp_path, "h200")
    first.start_run()  # t = 100
    first.finish("chunk_kda:a", {"best_ms": 1.0})  # t = 130
    first.save()  # t = 160: the run so far, a minute
    second = Ledger.load(tmp_path, "h200")  # a re-run after --timeout
    assert second.runs == [{"started": first.runs[0]["started"], "elapsed_s": 60.0, "buckets": 1}]
    second.start_run()  # t = 500
    second.finish("chunk_kda:b", {"best_ms": 2.0})  # t = 520
    again = Ledger.load(tmp_path, "h200")
    assert [r["elapsed_s"] for r in again.runs] == [60.0, 20.0] and again.elapsed_s == 80.0
    assert [r["buckets"] for r in again.runs] == [1, 1] and list(again.done) == ["chunk_kda:a", "chunk_kda:b"]


def test_configs_in_force_sets_and_restores_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTUNE_CONFIG", "before.json")
    path = tmp_path / "h200.json"
    with grid.configs_in_force(path):  # no file yet: nothing changes
        assert os.environ["DTUNE_CONFIG"] == "before.json"
    path.write_text(json.dumps({"schema": 1, "gpu": "h200", "entries": []}))
    with grid.configs_in_force(path):
        assert os.environ["DTUNE_CONFIG"] == str(path)
    assert os.environ["DTUNE_CONFIG"] == "before.json"


def test_new_run_folders_never_reuse_an_old_one(tmp_path: Path) -> None:
    step = make_plan(["chunk_kda"], {"chunk_kda": "bf16"}).steps[1]
    first = grid.new_run_dir(tmp_path, step)
    assert first == tmp_path / "runs" / "chunk_kda" / "grid"
    first.mkdir(parents=True)
    assert grid.new_run_dir(tmp_path, step).name == "grid-2"


def test_shipped_spaces_plan_buckets_the_store_can_hold() -> None:
    kernels = grid.default_kernels()
    plan = make_plan(kernels, dict.fromkeys(kernels, "bf16"))
    for b in plan.buckets():
        assert isinstance(b.shape, Shape) and b.shape.HV % b.shape.H == 0
    assert len({b.key for b in plan.buckets()}) == len(plan.buckets())


def test_a_bucket_is_recorded_when_its_search_says_something_about_its_configs(tmp_path: Path) -> None:
    from dtune.gpu import get_profile
    from dtune.tune.summary import Reporter, ShapeSummary

    plan = make_plan(["fused_recurrent_kda"], {"fused_recurrent_kda": "bf16"}, budget=30)
    job = grid.Job(plan, get_profile("cpu"), tmp_path)
    step = plan.steps[1]
    ledger, result = Ledger.load(tmp_path, "cpu"), grid.JobResult()
    record = grid._Record(Reporter(), step, tmp_path / "runs" / "x", job, ledger, result, grid.JobReporter())
    a, b, c = (x.shape.key for x in step.buckets[:3])
    record.shape_finished(ShapeSummary("s", a, failures={"cancelled": 2, "constraint": 3}))  # out of time: again
    record.shape_finished(ShapeSummary("s", b, failures={"gate": 4}))  # nothing passes: done, no entry
    record.shape_finished(ShapeSummary("s", c, best_ms=1.0, default_ms=2.0))
    keys = [x.key for x in step.buckets[:3]]
    done = Ledger.load(tmp_path, "cpu").done
    assert list(done) == keys[1:]
    assert done[keys[1]]["failures"] == {"gate": 4}  # why the bucket has no entry, kept in tune-gpu.json
    assert [x.key for x in result.left] == keys[:1] and result.no_pass == keys[1:2]


def test_a_config_file_is_validated_before_it_is_written(tmp_path: Path) -> None:
    from dtune.store import ConfigFileError
    from dtune.tune.export import write_configs

    bad = {"kernel": "chunk_kda", "dtype": "bf16", "bucket": dict(T=64, B=1, H=1, HV=1, K=16, V=16)}
    doc = {"schema": 1, "gpu": "h200", "entries": [{**bad, "config": {"BT": 7}}]}
    path = tmp_path / "h200.json"
    with pytest.raises(ConfigFileError, match="illegal config"):
        write_configs(doc, path, "h200")
    assert not path.exists() and not list(tmp_path.iterdir())
    doc["entries"][0]["config"] = {"BT": 32}
    with pytest.raises(ConfigFileError, match=r"is for GPU .h200., but this is .h100."):
        write_configs(doc, path, "h100")
    write_configs(doc, path, "h200")
    assert json.loads(path.read_text())["entries"][0]["config"] == {"BT": 32}


def test_missing_from_drops_the_buckets_a_config_file_has_and_empty_steps() -> None:
    plan = make_plan(["chunk_delta_rule"], {"chunk_delta_rule": "bf16"}, budget=30)
    anchor, rest, packed = plan.steps
    have = [anchor.buckets[0], *rest.buckets[:3], packed.buckets[0]]
    doc = {"entries": [{"kernel": b.kernel, "dtype": "bf16", "bucket": b.shape.bucket()} for b in have]}
    doc["entries"].append({"kernel": "chunk_delta_rule", "dtype": "fp32", "bucket": rest.buckets[3].shape.bucket()})
    got = grid.missing_from(plan, doc)
    assert [s.name for s in got.steps] == ["grid"]  # the anchor and the packed batch have entries
    assert [b.key for b in got.steps[0].buckets] == [b.key for b in rest.buckets[3:]]  # an fp32 entry is no bf16 one
    assert got.steps[0].seconds == rest.seconds
    assert grid.missing_from(plan, None) == plan


@pytest.mark.parametrize("cause", ["no charting library", "nothing to report"])
def test_a_report_that_cannot_be_built_is_skipped_and_the_job_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """The configs are exported before the report: a GPU machine without plotly, or a job folder with nothing to draw,
    gets a skipped line, not a traceback after the whole job (a tune-gpu run on an H100 ended so)."""
    import sys
    from types import SimpleNamespace

    if cause == "no charting library":
        monkeypatch.setitem(sys.modules, "dtune.report", None)  # importing it raises ImportError
    skipped: list[tuple[str, str]] = []
    reporter = SimpleNamespace(skipped=lambda what, why: skipped.append((what, why)), reported=pytest.fail)
    job = SimpleNamespace(out=tmp_path, report_file=tmp_path / "report.html")
    result = grid.JobResult()
    grid._report(job, result, reporter)  # type: ignore[arg-type]
    assert result.report is None and [w for w, _ in skipped] == ["the report"]
    assert ("ImportError" if cause == "no charting library" else "NothingToReport") in skipped[0][1]
