"""``dtune export``: a run's best gate-passing configs as tuned-config JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dtune.cli.common import fail, out, out_file


def export(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="Run folder(s) written by `dtune search` (each holds run.json); several are merged, the fastest "
            "entry per kernel, dtype and shape bucket winning.",
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Where to write the JSON (default RUN_DIR/tuned.json; needed for several)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the exported document on stdout.")] = False,
) -> None:
    """Export the best config of every study of RUN_DIRS (only COMPLETE trials that passed the gate).

    Exits 1 without writing when no study has a config that passed the gate (there is nothing to export)."""
    from dtune.tune.export import TUNED_JSON, export_document, why_empty, write_document

    if output is None and len(run_dirs) > 1:
        fail("merging several run folders needs an output file (-o)")
    try:
        doc = export_document(run_dirs)
    except ValueError as e:
        fail(str(e))
    if not doc["entries"]:
        fail("nothing to export, no file written: " + "; ".join(why_empty(d) for d in run_dirs), code=1)
    path = write_document(doc, out_file(output or run_dirs[0] / TUNED_JSON, "export file"))
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    out.print(
        f"wrote {len(doc['entries'])} entr{'y' if len(doc['entries']) == 1 else 'ies'} for {doc['gpu']} to {path}"
    )
    for entry in doc["entries"]:
        b = entry["bucket"]
        speed = f"{entry['speedup']:.2f}x" if entry.get("speedup") else "-"
        out.print(
            f"  {entry['kernel']} {entry['dtype']} T{b['T']}-B{b['B']}-H{b['H']}-HV{b['HV']}-K{b['K']}-V{b['V']}: "
            f"{json.dumps(entry['config'])}  {entry['time_ms']:.4g} ms  speedup {speed}",
            highlight=False,
        )


def register(app: typer.Typer) -> None:
    app.command("export")(export)
