"""dtune report: the answer first, every section drawn from a full run folder; absent data left out and listed, not
crashed on; the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from dtune.cli.main import app
from dtune.report import NothingToReport, build_report, default_output
from dtune.report.data import USE_TITLES
from tests.e2e.run_folder import make_run_folder

SECTIONS = ["answer", "speedup-T", "speedup-D", "stages", "launches", "baselines", "roofline", "search", "trials"]
SECTIONS += ["environment"]


def cli() -> typer.Typer:
    return app


def test_full_run_folder_every_section_ok(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=8)
    out, sections = build_report(run, tmp_path / "r.html")
    assert list(sections) == SECTIONS
    assert all(v == "ok" for v in sections.values()), sections
    html = out.read_text(encoding="utf-8")
    assert html.count('<section id="') == len(SECTIONS)
    assert html.index('<section id="answer">') < html.index('<section id="speedup-T">')  # the answer first
    heads = [html.index(f'<p class="headline">{USE_TITLES[use]}: ') for use in ("prefill", "training", "decode")]
    assert heads == sorted(heads) and heads[-1] < html.index('id="chart-answer-')  # three answers, before the charts
    assert "Prefill (chunk forward): 1.51× (geometric mean of 8 shapes; faster on 8" in html
    assert "Training step (forward + backward): 0.74× (one shape) against flash-linear-attention" in html
    assert "Decode (fused recurrent): eager 1.09×" in html and "CUDA graphs 1.09×" in html
    assert "1 shape ran the config of an untuned bucket (†)" in html and "2 shapes ran the config" in html
    assert html.count('id="chart-answer-') == 3 and "16 packed" in html
    assert "NVIDIA H200" in html and "triton 3.9.0" in html
    assert html.count("83e632d") >= 2  # the header and the sources table say the same commit
    assert "BC=" in html  # best configs, compact
    assert 'class="dataframe sortable"' in html
    for unit in ("dtune (ms)", "fla fastest (ms)", "median (ms)", "time (ms)", "GB/s", "TFLOP/s"):
        assert unit in html, unit
    assert "Parameter importance (" in html and "<th>#1</th>" in html  # 8 trials per study: a table of the top three
    assert "Left out of this report" not in html


def test_missing_data_is_left_out_and_listed(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=3)
    for name in ("bench.csv", "profile.csv", "study.db", "launches.csv"):
        (run / name).unlink()
    out, sections = build_report(run, tmp_path / "partial.html")
    for key in ("answer", "speedup-T", "speedup-D", "baselines", "stages", "launches", "roofline"):
        assert sections[key] != "ok", key
    assert sections["baselines"].startswith("no bench.csv") and sections["stages"].startswith("no profile.csv")
    assert sections["search"] == "ok" and sections["trials"] == "ok" and sections["environment"] == "ok"
    html = out.read_text(encoding="utf-8")
    assert html.count('<section id="') == 3  # empty sections are not on the page ...
    assert '<section id="answer">' not in html and '<section id="roofline">' not in html
    assert "Left out of this report" in html and "dtune bench --config" in html  # ... but listed, with the fix
    assert "Parameter importance" not in html  # 3 trials per study: not enough

    only_run = tmp_path / "only-run-json"
    only_run.mkdir()
    shutil.copy(run / "run.json", only_run / "run.json")
    out, sections = build_report(only_run, tmp_path / "env.html")
    assert [k for k, v in sections.items() if v == "ok"] == ["environment"]  # only the list of what is missing
    html = out.read_text(encoding="utf-8")
    assert html.endswith("</html>\n") and "Left out of this report" in html


def test_nothing_to_report_is_an_error(tmp_path: Path) -> None:
    """An empty folder, or one whose files are all unreadable: NothingToReport (the CLI: one line, exit 2), no page."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NothingToReport, match=r"nothing to report in .*empty: no run\.json"):
        build_report(empty, tmp_path / "empty.html")
    assert not (tmp_path / "empty.html").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.json").write_text("{not json")
    (broken / "bench.csv").write_text("")
    (broken / "trials.csv").write_bytes(b"\x00\x01garbage,\n\xff")
    r = CliRunner().invoke(cli(), ["report", str(broken), "-o", str(tmp_path / "b.html")])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: nothing to report in")
        and "could not read: run.json" in lines[0]
    )
    assert not (tmp_path / "b.html").exists()
    r = CliRunner().invoke(cli(), ["report", str(empty)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    headers = tmp_path / "headers"  # files that parse but hold no rows: named, not taken for absent
    headers.mkdir()
    (headers / "bench.csv").write_text("kernel,impl,median_ms\n")
    with pytest.raises(NothingToReport, match=r"could not read: bench\.csv: no rows"):
        build_report(headers, tmp_path / "h.html")


def test_interpreter_times_are_flagged_and_kept_off_the_roofline(tmp_path: Path) -> None:
    run = make_run_folder(tmp_path, trials_per_study=4)
    for name in ("bench.csv", "profile.csv"):
        frame = pd.read_csv(run / name)
        frame["meaningful"] = False
        frame.to_csv(run / name, index=False)
    out, sections = build_report(run, tmp_path / "interp.html")
    assert sections["answer"] == "ok" and sections["roofline"] != "ok"
    assert out.read_text(encoding="utf-8").count("these times are NOT meaningful") >= 3


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
    assert r.exit_code == 2 and f"{run}: no such folder" in r.output


def test_numbers_in_tables_include_inf_and_nan() -> None:
    """A gate failure records an infinite error: the trials table must still render (it raised OverflowError)."""
    from dtune.report.html import number

    assert number(3.0) == "3" and number(0.123456) == "0.1235"
    assert number(float("inf")) == "inf" and number(float("nan")) == "nan"
