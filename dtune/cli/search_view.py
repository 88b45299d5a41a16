"""What ``dtune search`` prints when it ends: the summary (a table on wide terminals, one block per shape below
:data:`~dtune.cli.common.WIDE` columns; the best config always on its own lines, never cut), what a Ctrl-C kept and
the exact command that resumes it, and why a search whose shapes have no passing config failed."""

from __future__ import annotations

import shlex
import textwrap
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dtune.cli.common import WIDE

if TYPE_CHECKING:
    from dtune.tune.summary import RunSummary, ShapeSummary


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g} ms"


def failures(s: ShapeSummary) -> str:
    return ", ".join(f"{k} {v}" for k, v in s.failures.items()) or "none"


def counts(s: ShapeSummary) -> str:
    c = s.counts
    return f"{c.get('complete', 0)} complete, {c.get('failed', 0)} failed, {c.get('pruned', 0)} pruned"


def speedup(s: ShapeSummary) -> str:
    return f"{s.speedup:.2f}× the default" if s.speedup else "–"


def config_lines(config: dict[str, Any] | None, width: int, indent: str = "    ") -> list[str]:
    """``name=value`` items wrapped to ``width`` between items (a parameter is never split)."""
    if not config:
        return [f"{indent}– (no config passed the gate)"]
    items = " ".join(f"{k}={v}" for k, v in config.items())
    return textwrap.wrap(items, width=max(width - len(indent), 20), break_long_words=False, break_on_hyphens=False,
                         initial_indent=indent, subsequent_indent=indent)  # fmt: skip


def title(run: RunSummary) -> str:
    return f"{run.kernel} on {run.gpu} ({run.dtype})" + (
        " [interpreter: times not meaningful]" if run.interpret else ""
    )


def model_hits(s: ShapeSummary) -> str:
    """How often the resource model's spill prediction matched ptxas on this shape's compiled trials."""
    return f"{s.model_hits}/{s.model_checked}" if s.model_checked else "–"


def print_summary(run: RunSummary, console: Console) -> None:
    """The end-of-search summary, laid out for ``console.width``."""
    width = console.width
    if width >= WIDE:
        table = Table(title=escape(title(run)))
        for col in ("shape", "trials c/f/p", "failures", "model hits", "default", "best", "speedup"):
            table.add_column(col, no_wrap=col != "failures", justify="right" if col in ("default", "best") else "left")
        for s in run.shapes:
            c = s.counts
            table.add_row(
                s.shape_key,
                f"{c.get('complete', 0)}/{c.get('failed', 0)}/{c.get('pruned', 0)}",
                failures(s),
                model_hits(s),
                ms(s.default_ms),
                ms(s.best_ms),
                f"{s.speedup:.2f}×" if s.speedup else "–",
            )
        console.print(table)
        for s in run.shapes:
            console.print(f"best config, {s.shape_key}:", highlight=False)
            for line in config_lines(s.best_config, width, "  "):
                console.print(escape(line), highlight=False)
        return
    console.print(escape(title(run)), highlight=False, style="bold")
    for s in run.shapes:
        lines = [
            s.shape_key,
            f"  trials     {counts(s)}",
            f"  failures   {failures(s)}",
            f"  model hits {model_hits(s)} (resource model's spill predictions right / checked)",
            f"  time       default {ms(s.default_ms)}, best {ms(s.best_ms)} ({speedup(s)})",
            "  best config",
            *config_lines(s.best_config, width),
        ]
        for line in lines:
            console.print(escape(line), highlight=False, soft_wrap=False)


def resume_command(ctx: typer.Context, run_dir: str) -> str:
    """The command line that continues this search: every option given (as parsed) with ``--out RUN --resume``."""
    words = [ctx.find_root().info_name or "dtune", ctx.info_name or "search"]
    for param in ctx.command.params:
        if getattr(param, "param_type_name", "") != "option" or param.name in ("out_dir", "resume", "as_json"):
            continue
        value = ctx.params.get(param.name or "")
        if value is None or value == param.default or (isinstance(value, (list, tuple)) and not value):
            continue
        if getattr(param, "is_flag", False):
            flags = param.opts if value else param.secondary_opts
            if flags:
                words.append(flags[0])
            continue
        longest = max(param.opts, key=len)
        for item in value if isinstance(value, (list, tuple)) else (value,):  # a repeatable option: once per value
            words += [longest, str(item)]
    words += ["--out", run_dir, "--resume"]
    return shlex.join(words)


def interrupted_message(run: RunSummary, command: str, total_shapes: int) -> list[str]:
    """What a Ctrl-C kept, and how to go on."""
    finished = sum(sum(s.counts.values()) for s in run.shapes)
    passed = sum(s.best_ms is not None for s in run.shapes)
    return [
        f"interrupted: {finished} finished trial(s) are kept in {run.storage} ({len(run.shapes)} of {total_shapes} "
        "shape(s) started); a trial still running was recorded as failed ('interrupted before the trial finished').",
        f"{run.run_dir}: trials.csv lists every finished trial; tuned.json holds the best passing config of {passed} "
        "shape(s).",
        "resume with (runs up to --trials more per shape; configs already tried are not run again):",
        f"  {command}",
    ]


def no_pass_message(run: RunSummary) -> str | None:
    """An error line when no shape has a config that passed the gate, else None."""
    if any(s.best_ms is not None for s in run.shapes):
        return None
    why = "; ".join(f"{s.shape_key}: {failures(s)}" for s in run.shapes)
    return f"no config passed the gate: tuned.json has no entry ({why}){first_message(run.run_dir)}"


def first_message(run_dir: str) -> str:
    """``; e.g. trial N: <its failure message>`` from trials.csv, or a pointer to it."""
    import pandas as pd

    path = f"{run_dir}/trials.csv"
    try:
        rows = pd.read_csv(path)
        failed = rows[(rows["state"] != "complete") & rows["message"].notna() & (rows["reason"] != "constraint")]
        first = failed.iloc[0]
    except Exception:  # no CSV, no failed row: point at the file
        return f"; see {path}"
    return f"; e.g. trial {int(first['number'])}: {first['message']} (all in {path})"


def shapes_without_pass(run: RunSummary) -> list[str]:
    return [s.shape_key for s in run.shapes if s.best_ms is None]


def print_outcome(run: RunSummary, ctx: typer.Context, run_dir: str, total_shapes: int) -> int:
    """After the summary, on stderr: what a Ctrl-C kept and how to resume (exit 130), or why no shape has a passing
    config (exit 1), or which shapes have none (a warning, exit 0). Returns the exit code."""
    from dtune.cli.common import err

    if run.interrupted:
        for line in interrupted_message(run, resume_command(ctx, run_dir), total_shapes):
            err.print(line, highlight=False, markup=False, soft_wrap=True)  # never break the command
        return 130
    no_pass = no_pass_message(run)
    if no_pass:
        err.print(f"[bold red]error:[/] {escape(no_pass)}", highlight=False, soft_wrap=True)
        return 1
    missing = shapes_without_pass(run)
    if missing:
        err.print(
            f"[yellow]warning:[/] no config passed the gate for {', '.join(missing)}: no tuned entry for these shapes",
            highlight=False,
            soft_wrap=True,
        )
    return 0
