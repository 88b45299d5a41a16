"""``dtune tune-gpu`` end to end under the interpreter (tiny shapes, two trials a bucket): the plan and its estimate,
a job cut by --timeout and continued, the merged config file over the shipped one, the benches, the report, a
re-run that redoes nothing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from dtune.cli.main import app
from dtune.measure import bench as bench_module
from dtune.store import parse_configs
from dtune.tune import grid

runner = CliRunner()
KERNEL = "fused_recurrent_delta_rule"
# budget 600: the anchor 102 s, the other buckets 54 s each (room for a slow machine), but --trials 2 ends each
# search after two trials
JOB = ["tune-gpu", "--interpret", "-k", KERNEL, "--budget", "600", "--trials", "2"]


def test_dry_run_prints_the_plan_and_the_estimate_and_runs_nothing(tmp_path: Path) -> None:
    result = runner.invoke(app, [*JOB, "--out", str(tmp_path / "job"), "--dry-run"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "anchor" in result.stdout and "grid" in result.stdout and "starts from" in result.stdout
    # anchor 10 + 102 + 4; grid 10 + 3 x (54 + 4); benches 4 x 10
    # words, not line breaks: the console's width can be another test's (rich caches it per process)
    assert "4 of 4 buckets to tune; estimated searches 5 min + benches about 40 s = about 6 min" in (
        " ".join(result.stdout.split())
    )
    assert not (tmp_path / "job").exists()


def test_a_job_cut_by_its_timeout_continues_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job"
    shipped = tmp_path / "cpu.json"  # stands for this GPU's shipped file: one bucket the job does not tune
    other = {"kernel": KERNEL, "dtype": "bf16", "bucket": {"T": 7, "B": 3, "H": 1, "HV": 1, "K": 16, "V": 16}}
    shipped.write_text(json.dumps({"schema": 1, "gpu": "cpu", "entries": [{**other, "config": {}, "time_ms": 1.0}]}))
    monkeypatch.setattr(grid, "shipped_file", lambda gpu: shipped)

    # 150 s: the anchor's search (10 + 102 + 4 s planned) fits, then at most two of the others (10 + 58 s each)
    first = runner.invoke(app, [*JOB, "--out", str(job), "--timeout", "150", "--no-bench"], env={"COLUMNS": "120"})
    assert first.exit_code == 0, first.output
    ledger = json.loads((job / "tune-gpu.json").read_text())
    anchor_key = f"{KERNEL}:T1-B2-H1-HV1-K16-V16"
    assert anchor_key in ledger["done"] and 1 <= len(ledger["done"]) <= 3
    assert "out of --timeout" in first.output and "run the same command again" in first.output

    second = runner.invoke(app, [*JOB, "--out", str(job)], env={"COLUMNS": "120"})
    assert second.exit_code == 0, second.output
    assert "not tuned yet" not in second.output, second.output
    done = json.loads((job / "tune-gpu.json").read_text())["done"]
    assert len(done) == 4 and done[anchor_key] == ledger["done"][anchor_key]
    runs = sorted(p.parent.name for p in (job / "runs" / KERNEL).glob("*/run.json"))
    assert runs.count("anchor") == 1 and "anchor-2" not in runs  # the finished anchor was not searched again
    later = json.loads((job / "runs" / KERNEL / runs[-1] / "run.json").read_text())
    assert str(job / "runs" / KERNEL / "anchor") in later["transfer_from"]  # seeded by the earlier searches

    doc = json.loads((job / "cpu.json").read_text())
    parse_configs(doc, "cpu.json", "cpu")
    buckets = {json.dumps(e["bucket"], sort_keys=True) for e in doc["entries"]}
    assert len(doc["entries"]) == 5 and json.dumps(other["bucket"], sort_keys=True) in buckets  # shipped one kept
    bench = pd.read_csv(job / "bench" / KERNEL / "bench.csv")
    assert set(bench["impl"]) == {"tuned", "default"} and len(bench.groupby(["B", "T"])) == 4
    assert (job / "dtune-cpu-report.html").stat().st_size > 10_000
    assert "4/4" in second.stdout and "tuned entries" in second.stdout

    third = runner.invoke(app, [*JOB, "--out", str(job)], env={"COLUMNS": "120"})
    assert third.exit_code == 0, third.output
    assert "0 of 4 buckets to tune" in third.stdout and "bench " not in third.output
    assert sorted(p.parent.name for p in (job / "runs" / KERNEL).glob("*/run.json")) == runs

    # a bench stopped at its second shape (a time limit, Ctrl-C) keeps the first on disk; the ledger does not count it
    # as benched, so the next run benches the kernel again
    real, calls = bench_module._shape_rows, []

    def second_shape_stops(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    ledger_doc = json.loads((job / "tune-gpu.json").read_text())
    (job / "tune-gpu.json").write_text(json.dumps({**ledger_doc, "benched": {}}))
    shutil.rmtree(job / "bench")
    monkeypatch.setattr(bench_module, "_shape_rows", second_shape_stops)
    fourth = runner.invoke(app, [*JOB, "--out", str(job)], env={"COLUMNS": "120"})
    assert fourth.exit_code != 0 and len(calls) == 2
    kept = pd.read_csv(job / "bench" / KERNEL / "bench.csv")
    assert len(kept.groupby(["B", "T"])) == 1 and set(kept["impl"]) == {"tuned", "default"}
    assert json.loads((job / "tune-gpu.json").read_text())["benched"] == {}


def test_another_gpus_job_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tune-gpu.json").write_text(json.dumps({"schema": 1, "gpu": "h200", "done": {}}))
    result = runner.invoke(app, [*JOB, "--out", str(tmp_path), "--dry-run"])
    assert result.exit_code == 2 and "records a job on 'h200'" in result.output
    result = runner.invoke(app, ["tune-gpu", "--gpu", "h200", "--out", str(tmp_path / "other")])
    assert result.exit_code == 2 and "only with --dry-run" in result.output and not (tmp_path / "other").exists()


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_missing_plans_only_the_buckets_no_shipped_file_has(gpu: str) -> None:
    """--missing on the H100 (or the H200), which reads the other's configs where its own file lacks a bucket: the
    plan leaves out every bucket either file has (counted here from the files), so the buckets left are the ones
    nobody tuned, and the estimate follows; without --missing, the whole grid."""
    kernels = grid.default_kernels()
    full = grid.make_plan(kernels, {k: "bf16" for k in kernels}, budget=30)
    planned = {(s.kernel, "bf16", json.dumps(b.shape.bucket(), sort_keys=True)) for s in full.steps for b in s.buckets}
    tuned = {}
    for name in ("h100", "h200"):
        shipped = grid.shipped_file(name)
        assert shipped is not None
        entries = json.loads(shipped.read_text())["entries"]
        tuned[name] = planned & {(e["kernel"], e["dtype"], json.dumps(e["bucket"], sort_keys=True)) for e in entries}
    have = tuned["h100"] | tuned["h200"]
    lacking = [
        b
        for s in full.steps
        for b in s.buckets
        if (s.kernel, "bf16", json.dumps(b.shape.bucket(), sort_keys=True)) not in have
    ]
    # each file covers grid buckets the other lacks: the plan must take both files into account
    assert tuned["h100"] - tuned["h200"] and tuned["h200"] - tuned["h100"]
    env = {"COLUMNS": "120", "TRITON_INTERPRET": "0"}
    args = ["tune-gpu", "--gpu", gpu, "--dry-run", "--budget", "30", "--no-bench"]
    result = runner.invoke(app, [*args, "--missing"], env=env)
    assert result.exit_code == 0, result.output
    if lacking:
        assert f"{len(lacking)} of {len(lacking)} buckets to tune" in " ".join(result.stdout.split())
    else:  # both files together cover the grid
        assert f"every bucket of the plan has a shipped entry for {gpu}: nothing to tune" in result.stdout
    full_run = runner.invoke(app, args, env=env)
    assert f"{len(full.buckets())} of {len(full.buckets())} buckets to tune" in " ".join(full_run.stdout.split())


def test_models_plan_their_buckets_and_bad_model_options_are_named(tmp_path: Path) -> None:
    job = ["tune-gpu", "--gpu", "h200", "--dry-run", "--out", str(tmp_path / "job"), "--budget", "90"]
    env = {"COLUMNS": "160", "TRITON_INTERPRET": "0"}  # the H200's plan, not the interpreter's tiny one (as in CI)
    result = runner.invoke(app, [*job, "--models", "kimi_linear", "--tp", "1,8"], env=env)
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.replace("│", " ").split())  # the plan's cells, whatever the table's borders

    def planned(kernel: str, search: str, buckets: str) -> bool:  # a table row, or a narrow console's "a · b\n c"
        return re.search(rf"\b{kernel} (· )?{search} (buckets )?{buckets}\b", words) is not None

    assert planned("chunk_kda", "kimi_linear", "8/8") and planned("chunk_kda", "kimi_linear-packed", "2/2")
    assert planned("fused_recurrent_kda", "kimi_linear", "6/6") and planned("chunk_kda_bwd", "kimi_linear", "2/2")
    assert not planned("chunk_kda", "kimi_linear", "9/9")
    assert "18 of 18 buckets to tune" in words and "gated_delta_rule" not in words
    only = runner.invoke(app, [*job, "--models", "all", "-k", "chunk_kda_bwd"], env=env)
    assert only.exit_code == 0 and "4 of 4 buckets to tune" in " ".join(only.stdout.split()), only.output
    for args, message in [
        (["--models", "llama"], "unknown model llama"),
        (["--models", "kimi_linear", "--tp", "3"], "do not divide by the tensor-parallel degree 3"),
        (["--models", "kimi_linear", "--tp", "0"], "expected positive degrees"),
        (["--tp", "2"], "apply to --models only"),
        (["--models", "kimi_linear", "-k", "chunk_delta_rule"], "none of chunk_delta_rule is called by kimi_linear"),
    ]:
        bad = runner.invoke(app, [*job, *args])
        assert bad.exit_code == 2 and message in " ".join(bad.output.split()), (args, bad.output)


def test_a_models_job_runs_under_the_interpreter(tmp_path: Path) -> None:
    """The models' plan through the job: searched, recorded, exported (tiny shapes keep the model's head ratio)."""
    job = tmp_path / "job"
    args = ["tune-gpu", "--interpret", "--models", "qwen3_next", "--tp", "8", "-k", "fused_recurrent_gated_delta_rule",
            "--trials", "1", "--budget", "600", "--no-bench", "--out", str(job)]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    done = json.loads((job / "tune-gpu.json").read_text())["done"]
    assert sorted(done) == [
        "fused_recurrent_gated_delta_rule:T1-B1-H1-HV2-K16-V16", "fused_recurrent_gated_delta_rule:T1-B2-H1-HV2-K16-V16"
    ]  # fmt: skip
    assert all(r["run"] == "runs/fused_recurrent_gated_delta_rule/qwen3_next" for r in done.values())
    entries = json.loads((job / "cpu.json").read_text())["entries"]
    assert {(e["bucket"]["B"], e["bucket"]["HV"]) for e in entries} >= {(1, 2), (2, 2)}
