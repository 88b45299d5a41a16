"""Helpers shared by the command modules: list options, error reporting, consoles."""

from __future__ import annotations

import os
from typing import NoReturn

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True)


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


def fail(message: str, code: int = 2) -> NoReturn:
    """Print an error (on stderr) and exit with ``code``."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def use_interpreter() -> None:
    """Run Triton kernels under the interpreter: must happen before triton is imported by the kernels."""
    os.environ["TRITON_INTERPRET"] = "1"
