"""``dtune search``: tune one kernel's launch configs on this GPU, shape by shape."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dtune.cli import common
from dtune.cli import search_view as view
from dtune.cli.common import (
    WIDE,
    FinalStateOpt,
    HvRatioOpt,
    InitialStateOpt,
    err,
    fail,
    int_list,
    out,
    resolve_dtype,
    use_interpreter,
)
from dtune.shape import packed_and_grouped

if TYPE_CHECKING:
    from dtune.shape import Shape
    from dtune.tune.search import ShapeSummary


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g} ms"


def _failures(summary: ShapeSummary) -> str:
    return ", ".join(f"{k} {v}" for k, v in summary.failures.items()) or "none"


def make_reporter(progress: Progress) -> Any:
    from dtune.tune.search import Reporter

    class RichReporter(Reporter):
        """One progress bar per shape: best so far, trials/min, failures by reason."""

        def __init__(self) -> None:
            self.task: Any = None

        def _text(self, s: ShapeSummary) -> str:
            speed = f" ({s.speedup:.2f}x)" if s.speedup else ""
            if progress.console.width < WIDE:  # the bar's line must not be cut: the summary has the rest
                return f"best {_fmt_ms(s.best_ms)}{speed} {s.trials_per_min:.1f}/min"
            return (
                f"{s.shape_key}  best {_fmt_ms(s.best_ms)}{speed}  {s.completed_per_min:.1f} timed/min  "
                f"failures: {_failures(s)}"
            )

        def shape_started(
            self, index: int, total: int, shape: Shape, summary: ShapeSummary, budget: int | None
        ) -> None:
            self.task = progress.add_task(f"[{index + 1}/{total}] {shape.key}", total=budget)

        def trial_finished(self, summary: ShapeSummary) -> None:
            progress.update(self.task, completed=summary.trials_run, description=self._text(summary))

        def shape_finished(self, summary: ShapeSummary) -> None:
            progress.update(self.task, description=self._text(summary), total=summary.trials_run)

    return RichReporter()


def search(
    ctx: typer.Context,
    kernel: Annotated[
        str, typer.Option("--kernel", "-k", help="Kernel to tune, e.g. fused_recurrent_kda (see `dtune list`).")
    ],
    gpu: Annotated[
        str, typer.Option(help="GPU profile the results are labelled with: auto (detect), or a key from `dtune list`.")
    ] = "auto",
    seq_lens: Annotated[
        str | None, typer.Option("--seq-lens", help="Sequence lengths T, comma-separated (default: the space's grid).")
    ] = None,
    head_dims: Annotated[
        str | None, typer.Option("--head-dims", help="Head dims (K = V), comma-separated (default: the space's grid).")
    ] = None,
    heads: Annotated[
        str | None, typer.Option("--heads", help="Heads (H = HV), comma-separated (default: the space's grid).")
    ] = None,
    batch: Annotated[
        str | None, typer.Option("--batch", help="Batch sizes B, comma-separated (default: the space's grid).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Activation dtype: fp32, fp16 or bf16 (default bf16; fp32 for chunk kernels with --interpret)."
        ),
    ] = None,
    trials: Annotated[
        int | None,
        typer.Option(
            help="Trials per shape that this run creates (pruned ones included; a resumed or shared study's earlier "
            "trials do not count). Default 40 when --timeout is not given either."
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds per shape (with --trials: whichever ends first); a shape whose first trial is still "
            "compiling then waits for it (at most --trial-timeout more), so no shape ends untried."
        ),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            help="Search strategy: pattern (stage-wise local search from the default, seeds and transferred configs; "
            "the default for multi-stage kernels) or an Optuna sampler: tpe (the default for one-launch kernels), "
            "cmaes, random, grid."
        ),
    ] = None,
    sampler: Annotated[
        str | None, typer.Option(hidden=True, help="Deprecated alias of --strategy (Optuna samplers only).")
    ] = None,
    seeds: Annotated[
        bool,
        typer.Option(
            "--seeds/--no-seeds",
            help="Start from the space's seeds and the shipped configs of the nearest tuned buckets too; --no-seeds "
            "starts from the template's default alone (to measure the search itself; --transfer-from still applies).",
        ),
    ] = True,
    transfer_from: Annotated[
        list[Path] | None,
        typer.Option(
            "--transfer-from",
            help="Run folder whose winners seed the nearest buckets (repeatable). The current run's earlier shapes and "
            "the shipped configs are always used (the latter unless --no-seeds).",
        ),
    ] = None,
    transfer_count: Annotated[
        int,
        typer.Option(
            help="Tuned buckets whose winners start each shape's search (nearest first; each fitted to the shape, "
            "then verbatim where that differs). 0: none."
        ),
    ] = 3,
    devices: Annotated[
        str | None,
        typer.Option(
            help="GPUs that time trials, comma-separated CUDA indices (e.g. 0,1): one timing worker each, on one "
            "study; compiles are shared (--compile-ahead). Default: one worker on the visible GPU."
        ),
    ] = None,
    resource_model: Annotated[
        bool,
        typer.Option(
            "--resource-model/--no-resource-model",
            help="Drop configs the resource model predicts to spill heavily or to overflow shared memory, before "
            "compiling (reason `predicted`).",
        ),
    ] = True,
    sanitize: Annotated[
        bool,
        typer.Option(
            "--sanitize/--no-sanitize",
            help="Run a crashed trial once more under compute-sanitizer (memcheck), when it is installed, and add "
            "its first error (kernel, line, thread, block) to the trial's message.",
        ),
    ] = True,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Optuna storage URL shared by many workers (sqlite:///f.db, postgresql://..., or journal:PATH); "
            "default: study.db in the run folder."
        ),
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue (or join) existing studies instead of refusing.")] = False,
    space: Annotated[
        Path | None, typer.Option(help="Search-space TOML of your own (default: the one shipped for the kernel).")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", "-o", help="Run folder (default runs/<kernel>-<gpu>-<timestamp>).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one machine-readable JSON summary, no progress.")
    ] = False,
    interpret: Annotated[
        bool, typer.Option(help="Run on the CPU under Triton's interpreter, small shapes; timings not meaningful.")
    ] = False,
    allow_gpu_mismatch: Annotated[
        bool, typer.Option(help="Allow --gpu to name another GPU than the one present (labels results with it).")
    ] = False,
    seed: Annotated[int, typer.Option(help="Sampler seed (give each worker joining one study its own).")] = 0,
    determinism: Annotated[
        bool, typer.Option(help="Gate also demands two bitwise-identical runs (catches races).")
    ] = False,
    trial_timeout: Annotated[
        float, typer.Option(help="Seconds one trial (compile, gate, timing) may take before its worker is killed.")
    ] = 300.0,
    timing: Annotated[
        str,
        typer.Option(
            help="How trials are timed: events (CUDA events, L2 flushed), graph (CUDA-graph replays, no launch "
            "overhead), or auto (graph for T <= 16, where launch overhead would hide the kernel, else events)."
        ),
    ] = "auto",
    compile_ahead: Annotated[
        int,
        typer.Option(
            help="Compile workers running ahead of the timing worker: trials are asked this many ahead and their "
            "kernels built in parallel (0: each trial compiles in turn)."
        ),
    ] = 0,
    hv_ratio: HvRatioOpt = 1,
    packed_seqs: Annotated[
        str | None,
        typer.Option(
            help="Tune a packed variable-length batch of these sequence lengths (cu_seqlens; comma-separated) for "
            "each head dim and heads, instead of the --seq-lens x --batch grid; it is bucketed as B = number of "
            "sequences, T = their mean length, which is how calls with cu_seqlens find their config."
        ),
    ] = None,
    max_memory: Annotated[
        float | None,
        typer.Option(
            "--max-memory",
            help="Memory ceiling in MiB: a trial whose call (for a backward kernel: the training step) allocates more "
            "at its peak than this above its inputs fails (reason `memory`) and is never exported (CUDA only).",
        ),
    ] = None,
    initial_state: InitialStateOpt = True,
    final_state: FinalStateOpt = True,
) -> None:
    """Search the fastest correct launch config of KERNEL for each shape (Optuna study per shape)."""
    interpret = interpret or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interpret:
        use_interpreter()
    from dtune.gpu import resolve_gpu
    from dtune.measure.inputs import Workload
    from dtune.tune.search import INTERPRET_SHAPES, SAMPLERS, STRATEGIES, SearchConfig, run_search
    from dtune.tune.space import SpaceError, load_space, load_space_file

    if sampler is not None:
        if sampler not in SAMPLERS:
            raise typer.BadParameter(
                f"unknown sampler {sampler!r}; use one of {', '.join(SAMPLERS)}", param_hint="--sampler"
            )
        err.print("[yellow]--sampler is deprecated: use --strategy[/]", highlight=False)
        if strategy is not None and strategy != sampler:
            raise typer.BadParameter("give --strategy or --sampler, not both", param_hint="--sampler")
        strategy = sampler
    if strategy is not None and strategy not in STRATEGIES:
        raise typer.BadParameter(
            f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}", param_hint="--strategy"
        )
    device_list: tuple[str, ...] = ()
    if devices is not None:
        device_list = tuple(d.strip() for d in devices.split(",") if d.strip())
        if not device_list or not all(d.isdigit() for d in device_list):
            raise typer.BadParameter(f"expected CUDA device indices like 0,1, got {devices!r}", param_hint="--devices")
    if dtype not in (None, "fp32", "fp16", "bf16"):
        raise typer.BadParameter(f"unknown dtype {dtype!r}; use fp32, fp16 or bf16", param_hint="--dtype")
    lists = {
        "seq_lens": int_list(seq_lens, "--seq-lens"),
        "head_dims": int_list(head_dims, "--head-dims"),
        "heads": int_list(heads, "--heads"),
        "batch": int_list(batch, "--batch"),
    }
    try:
        from dtune.plugins import load_plugins

        load_plugins()
        space_obj = load_space_file(space) if space is not None else load_space(kernel)
        if space_obj.kernel != kernel:
            fail(f"search space {space_obj.source} is for {space_obj.kernel!r}, not --kernel {kernel!r}")
        profile = resolve_gpu(gpu, allow_mismatch=allow_gpu_mismatch, interpret=interpret)
    except (SpaceError, ValueError) as e:
        fail(str(e))
    dtype = resolve_dtype(dtype, [kernel], interpret)
    base = INTERPRET_SHAPES if interpret else space_obj.shapes
    grid = base.replace(lists["seq_lens"], lists["head_dims"], lists["heads"], lists["batch"])
    shapes = grid.shapes()
    packed = int_list(packed_seqs, "--packed-seqs")
    try:
        shapes = packed_and_grouped(shapes, packed, hv_ratio)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = out_dir or Path("runs") / f"{kernel}-{profile.key}-{stamp}"
    try:
        cfg = SearchConfig(
            kernel=kernel,
            gpu=profile,
            space=space_obj,
            shapes=shapes,
            out=run_dir,
            dtype=dtype,
            trials=trials,
            timeout=timeout,
            strategy=strategy,
            seed=seed,
            storage=storage,
            resume=resume,
            interpret=interpret,
            determinism=determinism,
            trial_timeout=trial_timeout,
            timing=timing,
            compile_ahead=compile_ahead,
            workload=Workload(initial_state, final_state, tuple(packed) if packed else None),
            seeds=seeds,
            transfer_from=tuple(transfer_from or ()),
            transfer_count=transfer_count,
            devices=device_list,
            resource_model=resource_model,
            sanitize=sanitize,
            max_memory_mb=max_memory,
        )
        common.out_dir(run_dir, "run folder")
        if as_json:
            run = run_search(cfg)
        else:
            err.print(
                f"tuning [bold]{kernel}[/] for [bold]{profile.key}[/] ({dtype}), {len(cfg.shapes)} shape(s) "
                f"-> {run_dir}" + (" [yellow](interpreter: timings not meaningful)[/]" if interpret else ""),
                highlight=False,
            )
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=err) as progress:
                run = run_search(cfg, make_reporter(progress))
    except ValueError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(run.as_dict(), indent=2))
    else:
        view.print_summary(run, out)
        hit = f", resource model {100 * run.model_hit_rate:.0f}% right" if run.model_hit_rate is not None else ""
        out.print(
            f"{sum(s.trials_run for s in run.shapes)} trials ({sum(s.completed_run for s in run.shapes)} gated and "
            f"timed) in {run.elapsed_s:.1f} s ({run.completed_per_min:.1f} timed/min, strategy {run.strategy}, "
            f"{run.worker_restarts} worker restart(s){hit}); run folder {run.run_dir}",
            highlight=False,
        )
    code = view.print_outcome(run, ctx, str(run_dir), len(cfg.shapes))  # Ctrl-C: resume command; none passed: why
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("search")(search)
