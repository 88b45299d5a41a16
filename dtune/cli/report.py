"""``dtune report``: one self-contained, offline HTML page of a run folder (the work is in :mod:`dtune.report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dtune.cli.common import JsonOpt, fail, out, out_file


def report(
    run_dir: Annotated[
        Path, typer.Argument(help="Run folder written by `dtune search --out` (run.json, trials.csv, ...).")
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="HTML file to write (default: reports/<run-name>.html).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained, offline HTML report of a run folder."""
    from dtune.report import build_report, default_output

    if not run_dir.is_dir():
        fail(f"{run_dir} is not a folder" if run_dir.exists() else f"{run_dir}: no such folder")
    out_path, sections = build_report(run_dir, out_file(output or default_output(run_dir), "report file"))
    if as_json:
        typer.echo(json.dumps({"html": str(out_path), "sections": sections}))
        return
    for name, state in sections.items():
        mark = "[green]✓[/green]" if state == "ok" else "[yellow]–[/yellow]"
        out.print(f"{mark} {name}: {state}")
    out.print(f"wrote {out_path}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
