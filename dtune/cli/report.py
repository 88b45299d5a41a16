"""``dtune report``: one self-contained, offline HTML page of one or several folders (the work is in
:mod:`dtune.report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dtune.cli.common import JsonOpt, fail, out, out_file


def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="Folder(s) to report, read recursively: run folders of `dtune search` (run.json, trials.csv, "
            "study.db, tuned.json) and the bench.csv / profile.csv of `dtune bench` / `dtune profile`.",
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="HTML file to write (default: reports/<first folder's name>.html)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained, offline HTML report: dtune vs fla first (prefill, training step, decode), then sweeps,
    stages, search, sources. Folders with nothing to report: one line, exit 2."""
    from dtune.report import build_report, default_output

    for run_dir in run_dirs:
        if not run_dir.is_dir():
            fail(f"{run_dir} is not a folder" if run_dir.exists() else f"{run_dir}: no such folder")
    out_path, sections = build_report(run_dirs, out_file(output or default_output(run_dirs[0]), "report file"))
    if as_json:
        typer.echo(json.dumps({"html": str(out_path), "sections": sections}))
        return
    for name, state in sections.items():
        mark = "[green]✓[/green]" if state == "ok" else "[yellow]–[/yellow] left out:"
        out.print(f"{mark} {name}" + ("" if state == "ok" else f" {state}"), highlight=False)
    out.print(f"wrote {out_path}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
