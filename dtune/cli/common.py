"""Helpers shared by the command modules: option aliases, list options, number formatting, errors, consoles."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from dtune.errors import FileProblem

out = Console()
err = Console(stderr=True)
WIDE = 100  # terminal columns from which tables use their wide layout; below it, compact layouts that cut nothing

KernelOpt = Annotated[
    str,
    typer.Option(
        "--kernel",
        "-k",
        help="Kernel: {chunk,fused_recurrent}_{delta_rule,gated_delta_rule,kda}, e.g. chunk_kda, or a chunk backward "
        "(chunk_kda_bwd: timed as the op's forward + backward).",
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Input dtype: bf16, fp16 or fp32 (default bf16; under --interpret the chunk kernels default to fp32).",
    ),
]
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
DecaysOpt = Annotated[
    str,
    typer.Option(
        "--decays",
        help="The log gates timed: strong (the tuning inputs: a state forgets in a few tokens) or model (the gates of "
        "fla's Gated DeltaNet / KDA layers at initialisation, most far slower). Only work that depends on the gates' "
        "values differs (Gated DeltaNet's decay-driven skip, burn-in).",
    ),
]
HvRatioOpt = Annotated[
    int,
    typer.Option("--hv-ratio", min=1, help="Value heads per query/key head (HV = ratio x H; grouped value heads)."),
]


def print_rows(
    console: Console,
    title: str,
    headers: list[str],
    rows: list[list[str]],
    lead: int = 1,
    left: tuple[str, ...] = (),
) -> None:
    """A table when it fits ``console`` uncut; else one block per row: the first ``lead`` cells as a heading, then
    ``header value`` items wrapped between items (nothing is ever cut). ``left``: headers aligned left."""
    import textwrap

    from rich.measure import Measurement
    from rich.table import Table

    table = Table(title=escape(title))
    for h in headers:
        table.add_column(escape(h), no_wrap=True, justify="left" if h in left else "right")
    for r in rows:
        table.add_row(*(escape(c) for c in r))
    if Measurement.get(console, console.options.update_width(10_000), table).maximum <= console.width:
        console.print(table)
        return
    console.print(escape(title), style="bold", highlight=False)
    for r in rows:
        console.print(escape(" · ".join(c for c in r[:lead] if c)), highlight=False)
        items = "; ".join(f"{h} {c}" for h, c in zip(headers[lead:], r[lead:]) if c not in ("", "–"))
        for line in textwrap.wrap(items, width=max(console.width - 4, 20), initial_indent="  ", subsequent_indent="  "):
            console.print(escape(line), highlight=False, soft_wrap=True)


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


def check_decays(decays: str) -> None:
    """``--decays``: one of :data:`dtune.measure.inputs.DECAYS`, else exit 2 naming them."""
    from dtune.measure.inputs import DECAYS

    if decays not in DECAYS:
        fail(f"--decays: unknown {decays!r}; use one of {', '.join(DECAYS)}")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error (on stderr; the message is text, not markup) and exit with ``code``."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def note(message: str) -> None:
    """A visible note on stderr (the message is text, not markup)."""
    err.print(f"[yellow]note:[/] {escape(message)}", highlight=False, soft_wrap=True)


def os_error_text(e: OSError) -> str:
    """``PATH: problem`` (both paths for a rename), or the error itself when it names no file."""
    problem = e.strerror or str(e)
    if e.filename is None:
        return problem
    paths = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    return f"{paths}: {problem}"


F = TypeVar("F", bound=Callable[..., Any])


def guarded(command: F) -> F:
    """A command whose file-system and config errors end it with one line naming the path and the problem, exit 2
    (no traceback): any OSError, and the tuned-config and search-space errors (which name their file)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except OSError as e:
            fail(os_error_text(e))
        except FileProblem as e:
            fail(str(e))

    return run  # type: ignore[return-value]


def out_dir(path: Path, what: str) -> Path:
    """Create the folder a command writes into, or fail in one line naming it (``what``: "run folder", ...)."""
    if path.exists() and not path.is_dir():
        fail(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {what} {path}: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"cannot write into {what} {path}: permission denied")
    return path


def out_file(path: Path, what: str) -> Path:
    """The folder of a file a command will write must exist or be creatable; fail in one line otherwise."""
    if path.is_dir():
        fail(f"{what} {path} is a folder; give a file name")
    out_dir(path.parent, f"the folder of {what}")
    return path


def check_env_config() -> None:
    """A corrupt or unreadable ``DTUNE_CONFIG`` ends the command (exit 2) instead of being ignored."""
    from dtune.store import ENV, ConfigFileError, read_configs

    path = os.environ.get(ENV)
    if path:
        try:
            read_configs(path)
        except ConfigFileError as e:
            fail(f"{ENV}={path}: {e}")


def resolve_dtype(dtype: str | None, kernels: list[str], interpret: bool) -> str:
    """The dtype a command runs: ``--dtype`` as given, else bf16 -- except under Triton's interpreter, where a kernel
    the interpreter cannot compute in bf16 (:func:`dtune.inputs.interpreter_computes`: the chunk kernels' dots, the
    rule the ops refuse by) defaults to fp32 (with a note), and explicit bf16 is refused."""
    import torch

    from dtune.inputs import INTERPRETER_BF16, interpreter_computes
    from dtune.kernels import KERNELS

    wrong = [k for k in kernels if k in KERNELS and not interpreter_computes(KERNELS[k].family, torch.bfloat16)]
    if not (interpret and wrong):
        return dtype or "bf16"
    if dtype is None:
        note(f"{', '.join(wrong)} under the interpreter runs in fp32: {INTERPRETER_BF16} (bf16 needs a GPU)")
        return "fp32"
    if dtype == "bf16":
        fail(f"--dtype bf16 with --interpret: {INTERPRETER_BF16}; use --dtype fp32 or fp16 here, bf16 on a GPU")
    return dtype


def use_interpreter(interpret: bool = True) -> None:
    """Run Triton kernels under the interpreter: must happen before triton is imported by the kernels."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
