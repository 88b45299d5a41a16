"""dtune report: every section drawn from a full run folder; absent data said, not crashed on; the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dtune.cli.main import app
from dtune.report import build_report, default_output
from tests.e2e.run_folder import make_run_folder

SECTIONS = [
    "summary",
    "speedup-T",
    "speedup-D",
    "baselines",
    "stages",
    "roofline",
    "history",
    "importance",
    "failures",
    "trials",
]


def cli() -> typer.Typer:
    return app


def test_full_run_folder_every_section_ok(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=8)
    out, sections = build_report(run, tmp_path / "r.html")
    assert list(sections) == SECTIONS
    assert all(v == "ok" for v in sections.values()), sections
    html = out.read_text(encoding="utf-8")
    assert html.count('<section id="') == len(SECTIONS)
    assert "NVIDIA H200" in html and "83e632d" in html and "triton 3.9.0" in html
    assert "BC=" in html  # best configs, compact
    assert 'class="dataframe sortable"' in html


def test_missing_data_is_said_not_crashed_on(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=3)
    for name in ("bench.csv", "profile.csv", "study.db"):
        (run / name).unlink()
    out, sections = build_report(run, tmp_path / "partial.html")
    assert sections["baselines"].startswith("no bench.csv")
    assert sections["stages"].startswith("no profile.csv")
    assert sections["roofline"].startswith("no bench.csv or profile.csv")
    assert sections["importance"].startswith("not enough trials")
    assert sections["history"] == "ok" and sections["summary"] == "ok"
    html = out.read_text(encoding="utf-8")
    assert "dtune bench --config" in html and "no study.db" in html

    empty = tmp_path / "empty-run"
    empty.mkdir()
    out, sections = build_report(empty, tmp_path / "empty.html")
    assert sections["summary"].startswith("no run.json")
    assert all(v != "ok" for v in sections.values())
    assert out.read_text(encoding="utf-8").endswith("</html>\n")


def test_few_trials_give_importance_note(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=3)
    out, sections = build_report(run, tmp_path / "few.html")
    assert sections["importance"].startswith("not enough trials")
    assert "3 complete, need 5" in out.read_text(encoding="utf-8") or "complete, need 5" in out.read_text(
        encoding="utf-8"
    )


def test_report_cli_default_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run_folder(tmp_path / "runs", trials_per_study=6)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli(), ["report", str(run), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert Path(out["html"]) == Path("reports") / "run-h200-chunk_kda.html"
    assert (tmp_path / out["html"]).stat().st_size > 1_000_000  # plotly.js is inlined
    assert default_output(run) == Path("reports/run-h200-chunk_kda.html")
    r = CliRunner().invoke(cli(), ["report", str(run), "-o", str(tmp_path / "x" / "r.html")])
    assert r.exit_code == 0 and (tmp_path / "x" / "r.html").exists() and "wrote" in r.output
    shutil.rmtree(run)
    r = CliRunner().invoke(cli(), ["report", str(run)])
    assert r.exit_code == 2 and "is not a folder" in r.output


def test_numbers_in_tables_include_inf_and_nan() -> None:
    """A gate failure records an infinite error: the trials table must still render (it raised OverflowError)."""
    from dtune.report.html import number

    assert number(3.0) == "3" and number(0.123456) == "0.1235"
    assert number(float("inf")) == "inf" and number(float("nan")) == "nan"
