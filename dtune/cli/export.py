"""``dtune export``: a run's best gate-passing configs as tuned-config JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dtune.cli.common import fail, out


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
    """Export the best config of every study of RUN_DIRS (only COMPLETE trials that passed the gate)."""
    from dtune.tune.export import write_export

    try:
        path = write_export(run_dirs, output)
    except ValueError as e:
        fail(str(e))
    doc = json.loads(path.read_text(encoding="utf-8"))
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
