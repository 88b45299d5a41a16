"""``dtune tune-gpu``: tune every kernel's default buckets on this GPU, export ``<gpu>.json``, bench, report
(parsing and printing; the job is :mod:`dtune.tune.grid`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dtune.cli.common import (
    DtypeOpt,
    InterpretOpt,
    err,
    fail,
    note,
    out,
    out_dir,
    print_rows,
    resolve_dtype,
    use_interpreter,
)

if TYPE_CHECKING:
    from dtune.tune.grid import Bucket, Job, JobReporter, JobResult, Plan, Step
    from dtune.tune.summary import Reporter, ShapeSummary


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def print_plan(plan: Plan, done: dict[str, Any], bench: bool, benched: list[str]) -> None:
    """The searches (buckets left / planned, seconds each, what seeds them) and the estimate, on stdout."""
    rows = []
    seen: dict[str, list[str]] = {}
    for s in plan.steps:
        left = sum(b.key not in done for b in s.buckets)
        earlier = seen.setdefault(s.kernel, [])
        seeds = "shipped configs" + (" + " + ", ".join(earlier) if earlier else "")
        rows.append([s.kernel, s.name, f"{left}/{len(s.buckets)}", str(s.seconds), minutes(s.estimate_s(left)), seeds])
        earlier.append(s.name)
    print_rows(out, "plan", ["kernel", "search", "buckets", "s each", "takes", "starts from"], rows, lead=2,
               left=("kernel", "search", "starts from"))  # fmt: skip
    tune_s = plan.tune_s(done)
    bench_s = plan.bench_s(benched) if bench else 0.0
    parts = [f"searches {minutes(tune_s)}"] + ([f"benches about {minutes(bench_s)}"] if bench else [])
    out.print(
        f"{len(plan.buckets()) - len(done)} of {len(plan.buckets())} buckets to tune; estimated "
        f"{' + '.join(parts)} = about {minutes(tune_s + bench_s)}",
        highlight=False,
    )


def make_view(progress: Progress, total: int) -> JobReporter:
    from dtune.tune.grid import JobReporter
    from dtune.tune.summary import Reporter

    console = progress.console
    overall = progress.add_task("buckets tuned", total=total)

    class View(JobReporter):
        """An overall bar of buckets, one bar per bucket against its budget, one line per finished bucket."""

        def search(self, step: Step, buckets: Any, run_dir: Path) -> Reporter:
            class Bar(Reporter):
                task: Any = None

                def shape_started(self, index: int, n: int, shape: Any, summary: ShapeSummary, budget: Any) -> None:
                    self.task = progress.add_task(f"{step.kernel} {shape.key}", total=step.seconds)

                def trial_finished(self, s: ShapeSummary) -> None:
                    best = f"{s.best_ms:.4g} ms" if s.best_ms else "–"
                    text = f"{step.kernel} {s.shape_key}  best {best}  {s.trials_run} trials"
                    progress.update(self.task, completed=min(s.elapsed_s, step.seconds), description=text)

                def shape_finished(self, s: ShapeSummary) -> None:
                    progress.remove_task(self.task)

            console.print(f"{step.kernel} {step.name}: {len(buckets)} bucket(s) -> {run_dir}", highlight=False)
            return Bar()

        def bucket_done(self, bucket: Bucket, s: ShapeSummary) -> None:
            if s.best_ms is None:
                why = ", ".join(f"{n} {reason}" for reason, n in sorted(s.failures.items(), key=lambda x: -x[1]))
                line = f"  [yellow]✗[/] {bucket.key}: no config passed the gate ({s.trials_run} trials; failed: {why})"
            else:
                speed = f" ({s.speedup:.2f}× the default)" if s.speedup else ""
                line = f"  [green]✓[/] {bucket.key}: {s.best_ms:.4g} ms{speed}, {s.trials_run} trials"
            console.print(line, highlight=False)
            progress.advance(overall)

        def skipped(self, what: str, why: str) -> None:
            console.print(f"[yellow]skipped:[/] {what}: {why}", highlight=False)

        def exported(self, path: Path, entries: int) -> None:
            progress.update(overall, description=f"buckets tuned ({entries} entries in {path.name})")

        def bench(self, kernel: str, shapes: int) -> None:
            console.print(f"bench {kernel}: {shapes} bucket(s) against the baselines", highlight=False)

        def benched(self, kernel: str, paths: Any) -> None:
            console.print(f"  wrote {', '.join(str(p) for p in paths)}", highlight=False)

        def reported(self, path: Path) -> None:
            console.print(f"report {path}", highlight=False)

    return View()


def bench_ratios(job: Job) -> dict[str, str]:
    """Per kernel, the range of the tuned config's speedup over fla's fastest mode in the job's benches."""
    import pandas as pd

    from dtune.tune.grid import BENCH

    ranges: dict[str, list[float]] = {}
    for path in sorted((job.out / BENCH).glob("*/bench.csv")):
        frame = pd.read_csv(path)
        rows = frame[(frame["impl"] == "tuned") & (frame["mode"] != "graph")]
        for kernel, x in rows.groupby("kernel")["speedup_vs_fla"]:
            ranges.setdefault(str(kernel), []).extend(float(v) for v in x.dropna())
    return {k: f"{min(v):.2f}–{max(v):.2f}×" for k, v in ranges.items() if v}


def print_result(job: Job, result: JobResult, done: dict[str, Any]) -> None:
    rows = []
    vs_fla = bench_ratios(job)
    for kernel in job.plan.kernels:
        planned = job.plan.buckets(kernel)
        recs = [done[b.key] for b in planned if b.key in done]
        speedups = [r["default_ms"] / r["best_ms"] for r in recs if r.get("best_ms") and r.get("default_ms")]
        failed = sum(r.get("best_ms") is None for r in recs)
        spread = f"{min(speedups):.2f}–{max(speedups):.2f}×" if speedups else "–"
        rows.append([kernel, f"{len(recs)}/{len(planned)}", str(failed), spread, vs_fla.get(kernel, "–")])
    print_rows(out, f"dtune tune-gpu: {job.gpu.key}", ["kernel", "searched", "no pass", "× default", "× fla (bench)"],
               rows, left=("kernel",))  # fmt: skip
    if job.config_file.is_file():
        ship = "" if job.interpret else f", or ship it as dtune/configs/{job.config_file.name}"
        out.print(
            f"{job.config_file}: {result.entries} tuned entries; the ops read it with "
            f"DTUNE_CONFIG={job.config_file}{ship}",
            highlight=False,
        )
    if result.report is not None:
        out.print(f"report {result.report}", highlight=False)
    took = f"took {minutes(result.elapsed_s)}"
    if result.runs > 1:
        took += f"; the job so far {minutes(result.job_elapsed_s)} in {result.runs} runs"
    out.print(took, highlight=False)


def tune_gpu(
    kernels: Annotated[
        str | None,
        typer.Option("--kernels", "-k", help="Comma-separated kernels (default: every kernel with a search space)."),
    ] = None,
    budget: Annotated[
        float,
        typer.Option(
            help="Seconds of a chunk kernel's anchor search; every other bucket gets its space's share of it ([tune] "
            "in search_spaces/<kernel>.toml: a third for the chunk grids, 1/10 for fused-recurrent decode)."
        ),
    ] = 90.0,
    trials: Annotated[
        int | None, typer.Option(help="Also stop a bucket's search after this many trials (whichever ends first).")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds for the whole job: a search takes only the buckets that fit, a bench that does not fit is "
            "skipped; run the same command again to continue."
        ),
    ] = None,
    out_path: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Job folder (default runs/tune-<gpu>); a re-run skips its finished buckets."),
    ] = None,
    dtype: DtypeOpt = None,
    compile_ahead: Annotated[
        int | None,
        typer.Option(
            help="Trials compiled ahead in parallel (default: CPU cores - 2, at most 14; 0 with --interpret)."
        ),
    ] = None,
    devices: Annotated[
        str | None, typer.Option(help="GPUs that time trials, e.g. 0,1 (default: the visible GPU).")
    ] = None,
    trial_timeout: Annotated[
        float, typer.Option(help="Seconds one trial may take before its worker is killed.")
    ] = 120.0,
    bench: Annotated[
        bool, typer.Option("--bench/--no-bench", help="Bench every bucket against the baselines, then the report.")
    ] = True,
    baselines: Annotated[
        str, typer.Option(help="Baselines the benches time beside the tuned configs.")
    ] = "default,fla",
    rounds: Annotated[
        int | None, typer.Option(help="Bench rounds per shape (default 3 on a GPU, 1 on the CPU).")
    ] = None,
    gpu: Annotated[
        str, typer.Option(help="auto: the GPU present. Another GPU's key (see `dtune list`) only with --dry-run.")
    ] = "auto",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and the estimate; run nothing.")] = False,
    missing: Annotated[
        bool,
        typer.Option(
            "--missing",
            help="Only the buckets no shipped config tunes for this GPU: neither its own file nor that of the GPU of "
            "its kind whose configs the ops read there (an H100 reads the H200's; see `dtune list`). The others keep "
            "their entries.",
        ),
    ] = False,
    models: Annotated[
        str | None,
        typer.Option(
            help="Tune these models' buckets instead of the default grid (comma-separated names of dtune/models.toml, "
            "or all): prefill, a packed batch, the training step and decode, with their heads at each tensor-parallel "
            "degree; -k picks among their kernels."
        ),
    ] = None,
    tp: Annotated[
        str | None,
        typer.Option(help="With --models: only these tensor-parallel degrees, e.g. 1,8 (default: the file's)."),
    ] = None,
    interpret: InterpretOpt = False,
) -> None:
    """Tune every kernel's default buckets on this GPU by transfer from the shipped configs, export <gpu>.json, bench
    it against the baselines and write the report.

    Per kernel: its anchor bucket on the whole budget, then the other buckets of its default grid (and the long,
    grouped and packed ones of its space's [tune]) nearest-first, each seeded by the winners before it; with
    --models, the models' buckets instead. Prints the plan and how long it will take first. Every finished bucket is
    recorded in OUT/tune-gpu.json: run the same command again after a Ctrl-C or --timeout to continue."""
    interpret = interpret or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    use_interpreter(interpret)
    from dtune.gpu import get_profile, resolve_gpu
    from dtune.kernels import get_kernel
    from dtune.tune.grid import (
        Job,
        Ledger,
        default_kernels,
        make_plan,
        missing_from,
        model_kernels,
        model_plan,
        run_job,
    )
    from dtune.tune.space import SpaceError

    if dtype not in (None, "fp32", "fp16", "bf16"):
        raise typer.BadParameter(f"unknown dtype {dtype!r}; use fp32, fp16 or bf16", param_hint="--dtype")
    device_list = tuple(d.strip() for d in (devices or "").split(",") if d.strip())
    if devices is not None and (not device_list or not all(d.isdigit() for d in device_list)):
        raise typer.BadParameter(f"expected CUDA device indices like 0,1, got {devices!r}", param_hint="--devices")
    if tp is not None and models is None:
        raise typer.BadParameter("tensor-parallel degrees apply to --models only", param_hint="--tp")
    degrees = [d.strip() for d in (tp or "").split(",") if d.strip()]
    if tp is not None and (not degrees or not all(d.isdigit() and int(d) > 0 for d in degrees)):
        raise typer.BadParameter(f"expected positive degrees like 1,8, got {tp!r}", param_hint="--tp")
    try:
        asked = [k.strip() for k in kernels.split(",") if k.strip()] if kernels else None
        for name in asked or ():
            get_kernel(name)
        model_names = [m.strip() for m in models.split(",") if m.strip()] if models is not None else None
        names = model_kernels(model_names, asked) if model_names is not None else asked or default_kernels()
        chunk = [k for k in names if get_kernel(k).family == "chunk"]
        chunk_dtype = resolve_dtype(dtype, chunk, interpret) if chunk else dtype or "bf16"
        dtypes = {k: chunk_dtype if k in chunk else dtype or "bf16" for k in names}
        if model_names is not None:
            plan = model_plan(model_names, names, dtypes, budget, [int(d) for d in degrees], interpret)
        else:
            plan = make_plan(names, dtypes, budget, interpret)
        if gpu != "auto" and not dry_run:
            raise ValueError(
                f"--gpu {gpu}: the job tunes the GPU present (--gpu auto); another GPU only with --dry-run"
            )
        profile = get_profile(gpu) if gpu != "auto" else resolve_gpu("auto", interpret=interpret)
        job_dir = out_path or Path("runs") / f"tune-{profile.key}"
        ledger = Ledger.load(job_dir, profile.key)
        if missing:
            from dtune.store import shipped_configs

            in_force = shipped_configs(profile.key)  # its own file over its kin's: what the ops read on this GPU
            entries = [] if in_force is None else in_force.entries
            doc = {"entries": [{"kernel": e.kernel, "dtype": e.dtype, "bucket": e.bucket} for e in entries]}
            plan = missing_from(plan, doc)
    except (SpaceError, ValueError) as e:
        fail(str(e))
    if not plan.steps:
        out.print(f"every bucket of the plan has a shipped entry for {profile.key}: nothing to tune", highlight=False)
        return
    ahead = compile_ahead
    if ahead is None:  # one core left for the timing worker and one for the rest; 14 keep one H200 busy
        ahead = 0 if interpret else max(0, min(14, (os.cpu_count() or 2) - 2))
    wanted = [b.strip() for b in baselines.split(",") if b.strip()]
    job = Job(
        plan=plan,
        gpu=profile,
        out=job_dir,
        trials=trials,
        timeout=timeout,
        compile_ahead=ahead,
        devices=device_list,
        trial_timeout=trial_timeout,
        interpret=interpret,
        bench=bench,
        baselines=tuple(b for b in wanted if not (interpret and b == "fla")),  # fla needs a GPU
        rounds=rounds,
    )
    where = profile.name + (": tiny shapes, times not meaningful" if interpret else "")
    out.print(f"dtune tune-gpu on {where} -> {job_dir}", highlight=False)
    if ledger.done:
        out.print(f"{len(ledger.done)} bucket(s) already done in {ledger.path}: skipped", highlight=False)
    print_plan(plan, ledger.done, bench, ledger.benched_now(job_dir))
    if dry_run:
        return
    out_dir(job_dir, "job folder")
    todo = sum(b.key not in ledger.done for b in plan.buckets())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err) as bars:
            result = run_job(job, make_view(bars, todo))
    except ValueError as e:
        fail(str(e))
    except KeyboardInterrupt:  # between searches (a search itself stops cleanly and says so)
        err.print(f"interrupted: finished buckets are kept in {job_dir}; run the same command again to continue")
        raise typer.Exit(130) from None
    print_result(job, result, Ledger.load(job_dir, profile.key).done)
    if result.interrupted:
        err.print(f"interrupted: finished buckets are kept in {job_dir}; run the same command again to continue",
                  highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(130)
    if result.left:
        note(f"{len(result.left)} bucket(s) not tuned yet (out of --timeout or of budget): run the same command again")
    if result.no_pass:
        note(f"no config passed the gate for {', '.join(result.no_pass)}: no tuned entry for these buckets")
    if not job.config_file.is_file():
        fail("no config passed the gate in any bucket: nothing exported", code=1)


def register(app: typer.Typer) -> None:
    app.command("tune-gpu")(tune_gpu)
