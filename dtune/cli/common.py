"""Helpers shared by the command modules: option aliases, list options, number formatting, errors, consoles."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True)

KernelOpt = Annotated[
    str,
    typer.Option(
        "--kernel",
        "-k",
        help="Kernel: {chunk,fused_recurrent}_{delta_rule,gated_delta_rule,kda}, e.g. chunk_kda, or a chunk backward "
        "(chunk_kda_bwd: timed as the op's forward + backward).",
    ),
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Input dtype: bf16, fp16 or fp32.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="tuned.json from `dtune search` (nearest bucket per shape) or a JSON config object."),
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Folder for the CSV/JSON output (default: the run folder of --config, else reports/)."),
]
InterpretOpt = Annotated[
    bool,
    typer.Option("--interpret", help="Run on the CPU under Triton's interpreter (tiny shapes; times not meaningful)."),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the rows as JSON on stdout (for scripts) instead of a table.")
]
InitialStateOpt = Annotated[
    bool,
    typer.Option(
        "--initial-state/--no-initial-state", help="The timed call reads an initial state (the default workload)."
    ),
]
FinalStateOpt = Annotated[
    bool,
    typer.Option(
        "--final-state/--no-final-state", help="The timed call writes the final state (the default workload)."
    ),
]


def int_list(value: str | None, option: str) -> tuple[int, ...] | None:
    """Parse ``"1,64,1024"``; typer.BadParameter naming the option for anything else."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    try:
        numbers = tuple(int(p) for p in parts)
    except ValueError:
        raise typer.BadParameter(
            f"expected comma-separated positive integers, got {value!r}", param_hint=option
        ) from None
    if not numbers or any(n < 1 for n in numbers):
        raise typer.BadParameter(f"expected comma-separated positive integers, got {value!r}", param_hint=option)
    return numbers


def fmt(x: Any, spec: str = ".3f") -> str:
    """A table cell: numbers in ``spec``, NaN as a dash."""
    if isinstance(x, float) and math.isnan(x):
        return "–"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print an error (on stderr) and exit with ``code``."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def use_interpreter(interpret: bool = True) -> None:
    """Run Triton kernels under the interpreter: must happen before triton is imported by the kernels."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
