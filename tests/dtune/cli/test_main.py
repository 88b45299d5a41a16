"""The CLI through typer's CliRunner: search --interpret, export, list, --json, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from dtune.cli.main import app

runner = CliRunner()
KERNEL = "fused_recurrent_kda"


def search(tmp_path: Path, *extra: str) -> list[str]:
    return ["search", "--kernel", KERNEL, "--interpret", "--dtype", "fp32", "--out", str(tmp_path / "run"), *extra]


def test_version() -> None:
    """``dtune --version``: dtune's version and the torch and triton it runs with (as installed)."""
    from importlib import metadata

    import dtune

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith(f"dtune {dtune.__version__} (") and len(result.stdout.splitlines()) == 1
    assert f"torch {metadata.version('torch')}" in line and f"triton {metadata.version('triton')}" in line


def test_list() -> None:
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    for name in (KERNEL, "chunk_kda", "chunk_kda_bwd", "h100", "rtx4090"):
        assert name in result.stdout
    inv = json.loads(runner.invoke(app, ["list", "--json"]).stdout)
    kernels = {k["kernel"]: k for k in inv["kernels"]}
    assert kernels["chunk_kda_bwd"]["backward_of"] == "chunk_kda" and kernels["chunk_kda"]["backward_of"] is None
    assert "FUSE_DV" in kernels["chunk_kda_bwd"]["space"]["params"]
    assert kernels[KERNEL]["space"]["params"]["BV"] == [8, 16, 32, 64, 128]
    assert {g["key"] for g in inv["gpus"]} >= {"h100", "h200", "a100", "l40s", "b200", "rtx4090", "cpu"}
    models = {m["model"]: m for m in inv["models"]}  # what `dtune tune-gpu --models` takes
    assert (models["qwen3_next"]["heads"], models["qwen3_next"]["v_heads"]) == (16, 32)
    assert models["kimi_linear"]["family"] == "kda" and models["kimi_linear"]["tensor_parallel"] == [1, 2, 4, 8]
    assert "qwen3_next" in result.stdout and "kimi_linear" in result.stdout


def test_search_json_then_export(tmp_path: Path) -> None:
    result = runner.invoke(app, search(tmp_path, "--trials", "3", "--seq-lens", "1,3", "--json", "--seed", "7"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["gpu"] == "cpu" and summary["interpret"] is True and summary["trials_per_min"] > 0
    assert [s["shape_key"] for s in summary["shapes"]] == ["T1-B2-H2-HV2-K32-V32", "T3-B2-H2-HV2-K32-V32"]
    assert all(s["trials_run"] == 3 for s in summary["shapes"])
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {"run.json", "study.db", "trials.csv", "tuned.json"}
    assert len(pd.read_csv(run / "trials.csv")) == 6

    out = tmp_path / "exported.json"
    result = runner.invoke(app, ["export", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote 2 entries for cpu" in result.stdout
    doc = json.loads(out.read_text())
    assert [e["bucket"]["T"] for e in doc["entries"]] == [1, 3]
    assert json.loads(runner.invoke(app, ["export", str(run), "--json"]).stdout)["entries"] == doc["entries"]


def test_search_with_progress_and_journal(tmp_path: Path) -> None:
    journal = tmp_path / "studies.journal"
    result = runner.invoke(
        app, search(tmp_path, "--trials", "2", "--storage", f"journal:{journal}", "--strategy", "random")
    )
    assert result.exit_code == 0, result.output
    assert "timed/min" in result.stdout and "fused_recurrent_kda on cpu (fp32)" in result.stdout
    assert "strategy random" in " ".join(result.stdout.split())
    assert journal.exists() and not (tmp_path / "run" / "study.db").exists()
    doc = json.loads((tmp_path / "run" / "tuned.json").read_text())  # export found the journal through run.json
    assert len(doc["entries"]) == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--seq-lens", "1,x"], "comma-separated positive integers"),
        (["--batch", "0"], "comma-separated positive integers"),
        (["--strategy", "bayes"], "unknown strategy"),
        (["--sampler", "bayes"], "unknown sampler"),
        (["--devices", "0,x"], "CUDA device indices"),
        (["--transfer-from", "/nonexistent"], "not a run folder"),
        (["--dtype", "fp8"], "unknown dtype"),
        (["--gpu", "h900"], "unknown GPU 'h900'"),
        (["--gpu", "h100"], "labelled 'cpu'"),
        (["--space", "/nonexistent.toml"], "cannot read it"),
    ],
    ids=["seq-lens", "batch", "strategy", "sampler", "devices", "transfer", "dtype", "gpu", "gpu-mismatch", "space"],
)
def test_bad_options(tmp_path: Path, args: list[str], match: str) -> None:
    result = runner.invoke(app, search(tmp_path, *args))
    assert result.exit_code == 2
    assert match in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


def test_unknown_kernel_and_export_errors(tmp_path: Path) -> None:
    result = runner.invoke(app, ["search", "--kernel", "nope", "--interpret"])
    assert result.exit_code == 2 and "unknown kernel 'nope'" in result.output
    result = runner.invoke(app, ["export", str(tmp_path)])
    assert result.exit_code == 2 and "not a dtune run folder" in result.output


def test_export_merges_runs_of_several_kernels(tmp_path: Path) -> None:
    runs = []
    for kernel in (KERNEL, "fused_recurrent_delta_rule"):
        run = tmp_path / kernel
        args = ["search", "--kernel", kernel, "--interpret", "--dtype", "fp32", "--out", str(run)]
        result = runner.invoke(app, [*args, "--trials", "2", "--seq-lens", "1"])
        assert result.exit_code == 0, result.output
        runs.append(str(run))
    result = runner.invoke(app, ["export", *runs])
    assert result.exit_code != 0 and "needs an output file" in result.output
    merged = tmp_path / "merged.json"
    result = runner.invoke(app, ["export", *runs, "-o", str(merged)])
    assert result.exit_code == 0, result.output
    doc = json.loads(merged.read_text())
    assert sorted(e["kernel"] for e in doc["entries"]) == ["fused_recurrent_delta_rule", KERNEL]
    assert doc["gpu"] == "cpu" and doc["schema"] == 1
