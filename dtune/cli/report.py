"""``dtune bench``, ``dtune profile`` and ``dtune report``: measure the tuned kernels and show the evidence.

:func:`register` adds the three commands to the main typer app (``dtune.cli.main``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)

KernelOpt = Annotated[
    str,
    typer.Option(
        "--kernel",
        "-k",
        help="Kernel: {chunk,fused_recurrent}_{delta_rule,gated_delta_rule,kda}, e.g. chunk_kda.",
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


WRONG = 0.1  # a relative RMS error this large is a wrong output, not rounding


def _fmt(x: Any, spec: str = ".3f") -> str:
    if isinstance(x, float) and math.isnan(x):
        return "–"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def _fail(message: str) -> NoReturn:
    err_console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code=2)


def bench(
    kernel: KernelOpt,
    config: ConfigOpt = None,
    baselines: Annotated[
        str,
        typer.Option(
            "--baselines", help="Comma-separated baselines to time beside the tuned config: default,fla,torch."
        ),
    ] = "default,fla,torch",
    seq_lens: Annotated[
        str | None, typer.Option("--seq-lens", help="Comma-separated sequence lengths T (decode kernels: 1).")
    ] = None,
    head_dims: Annotated[str | None, typer.Option("--head-dims", help="Comma-separated head dims (K = V).")] = None,
    heads: Annotated[str | None, typer.Option("--heads", help="Comma-separated numbers of heads (H = HV).")] = None,
    batch: Annotated[
        str | None, typer.Option("--batch", help="Comma-separated batch sizes B (wins over --batch-tokens).")
    ] = None,
    batch_tokens: Annotated[
        int | None, typer.Option("--batch-tokens", help="Tokens per call: B = N // T for each T (chunk default 32768).")
    ] = None,
    dtype: DtypeOpt = "bf16",
    out: OutOpt = None,
    as_json: JsonOpt = False,
    graph: Annotated[
        bool, typer.Option("--graph", help="Also time fused-recurrent decode (T = 1) under CUDA-graph replay.")
    ] = False,
    rounds: Annotated[
        int | None, typer.Option("--rounds", help="Interleaved rounds per shape (default 3 on a GPU, 1 on the CPU).")
    ] = None,
    interpret: InterpretOpt = False,
) -> None:
    """Time the tuned config against the untuned default, flash-linear-attention and the PyTorch reference."""
    _maybe_interpret(interpret)
    from dtune import bench as b
    from dtune.inputs import dtype_from_name
    from dtune.kernels import get_kernel

    try:
        dt = dtype_from_name(dtype)
        want = [s.strip() for s in baselines.split(",") if s.strip()]
        get_kernel(kernel)  # an unknown name fails here, listing the known ones
        on_gpu = _on_gpu()
        grid = b.make_grid(
            kernel,
            on_gpu,
            b.parse_ints(seq_lens),
            b.parse_ints(head_dims),
            b.parse_ints(heads),
            b.parse_ints(batch),
            batch_tokens,
        )
        if config is not None and not any((seq_lens, head_dims, heads, batch, batch_tokens)):
            grid = b.tuned_grid_here(config, kernel, dt, on_gpu) or grid  # the shapes the config was tuned on
        status = err_console.status("benchmarking", spinner="dots") if not as_json else None
        if status:
            status.start()
        try:
            result = b.run_bench(
                kernel,
                grid,
                dt,
                want,
                config,
                rounds=rounds,
                graph=graph,
                progress=(lambda s: status.update(f"benchmarking {s}")) if status else None,
            )
        finally:
            if status:
                status.stop()
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as exc:
        _fail(str(exc))
    out_dir = out or b.default_out_dir(config)
    csv_path, json_path = b.write(result, out_dir)
    if as_json:
        rows = json.loads(result.frame.to_json(orient="records"))
        typer.echo(json.dumps({"rows": rows, "notes": result.notes, "csv": str(csv_path), "json": str(json_path)}))
        return
    table = Table(title=f"dtune bench: {kernel} ({dtype})")
    for col in ("shape", "impl", "mode", "median ms", "×default", "×fla", "GB/s", "TFLOP/s", "rel err", "note"):
        table.add_column(col, justify="right" if col not in ("shape", "impl", "mode", "note") else "left")
    for r in result.frame.itertuples(index=False):
        table.add_row(
            f"B{r.B} T{r.T} H{r.H} D{r.K}",
            str(r.impl),
            str(r.mode),
            _fmt(r.median_ms, ".4f") + ("" if r.meaningful else "*"),
            _fmt(r.speedup_vs_default, ".2f"),
            _fmt(r.speedup_vs_fla, ".2f"),
            _fmt(r.gbs, ".0f"),
            _fmt(r.tflops, ".1f"),
            _fmt(r.error_o, ".1e"),
            str(r.note)[:60],
        )
    console.print(table)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if not result.frame["meaningful"].all():
        console.print("* not meaningful: timed on the CPU under Triton's interpreter")
    wrong = result.frame[result.frame["error_o"] > WRONG]
    for r in wrong.drop_duplicates("impl").itertuples(index=False):
        console.print(
            f"[red]warning:[/red] {r.impl} is off the float64 reference (rel. error {r.error_o:.1e}) at B{r.B} T{r.T}"
        )
    console.print(f"wrote {csv_path} and {json_path}")


def _maybe_interpret(interpret: bool) -> None:
    """Select Triton's interpreter: must happen before triton is imported (the imports below are lazy)."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"


def _on_gpu() -> bool:
    import torch

    from dtune.inputs import interpreting

    return torch.cuda.is_available() and not interpreting()


def profile(
    kernel: KernelOpt,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Sequence length T (default 4096 on a GPU, 1 for decode kernels).")
    ] = None,
    head_dim: Annotated[int | None, typer.Option("--head-dim", help="Head dim K = V (default 128 on a GPU).")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Heads H = HV (default 16 on a GPU).")] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", help="Batch B (default 32768 // T tokens on a GPU; 32 for decode).")
    ] = None,
    dtype: DtypeOpt = "bf16",
    config: ConfigOpt = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="GPU profile key whose roofs to use when ceilings cannot be measured.")
    ] = None,
    ncu: Annotated[
        bool, typer.Option("--ncu", help="Also run Nsight Compute on the op (needs `ncu` on PATH).")
    ] = False,
    out: OutOpt = None,
    as_json: JsonOpt = False,
    interpret: InterpretOpt = False,
) -> None:
    """Per-stage time, registers, spills, shared memory, GB/s and TFLOP/s against measured ceilings and the floor."""
    _maybe_interpret(interpret)
    import subprocess

    from dtune import bench as b
    from dtune import profile as pr
    from dtune import roofline
    from dtune.inputs import Gate, Problem, dtype_from_name
    from dtune.kernels import get_kernel

    try:
        dt = dtype_from_name(dtype)
        spec = get_kernel(kernel)
        on_gpu = _on_gpu()
        decode = spec.family == "fused_recurrent"
        T = seq_len or ((1 if decode else 4096) if on_gpu else (1 if decode else 32))
        D = head_dim or (128 if on_gpu else 16)
        H = heads or (16 if on_gpu else 2)
        B = batch or ((32 if decode else max(1, 32768 // T)) if on_gpu else 1)
        p = Problem(B=B, T=T, H=H, HV=H, K=D, V=D, N=B, gate=Gate(spec.gate))
        if config is not None and not any((seq_len, head_dim, heads, batch)):
            # No shape asked for: the largest shape the config was tuned on.
            tuned = b.tuned_grid_here(config, kernel, dt, on_gpu)
            if tuned is not None:
                p = max(tuned.problems(Gate(spec.gate)), key=lambda q: q.B * q.T * q.HV * q.K * q.V)
        roofs = None
        if gpu:
            from dtune.gpu import get_profile

            roofs = roofline.Roofs.from_profile(get_profile(gpu))
        result = pr.run_profile(kernel, p, dt, config, roofs=roofs)
    except ImportError as exc:
        _fail(f"{exc} (the GPU profiles come with dtune.gpu)")
    except (ValueError, KeyError, FileNotFoundError, json.JSONDecodeError) as exc:
        _fail(str(exc))
    out_dir = out or b.default_out_dir(config)
    csv_path, json_path = pr.write(result, out_dir)
    ncu_msg = ""
    if ncu:
        cfg = json.loads(result.frame["config"].iloc[0])
        cmd = pr.ncu_command(kernel, p, dt, cfg, out_dir)
        if not pr.ncu_available():
            ncu_msg = "Nsight Compute (`ncu`) is not on PATH; install it, then run:\n  " + " ".join(
                f"'{c}'" if " " in c or "{" in c else c for c in cmd
            )
        else:
            done = subprocess.run(cmd, capture_output=True, text=True)
            ncu_msg = f"ncu exited {done.returncode}; report {cmd[cmd.index('--export') + 1]}.ncu-rep"
            if done.returncode:
                ncu_msg += "\n" + done.stderr[-2000:]
    if as_json:
        rows = json.loads(result.frame.to_json(orient="records"))
        payload = {"rows": rows, "notes": result.notes, "ncu": ncu_msg, "csv": str(csv_path), "json": str(json_path)}
        typer.echo(json.dumps(payload))
        return
    r0 = result.roofs
    roof_txt = f" — roofs {r0.gbs:.0f} GB/s, {r0.tflops:.0f} TFLOP/s ({r0.source})" if r0 else ""
    shape = f"B{p.B} T{p.T} H{p.H} " + (f"D{p.K}" if p.K == p.V else f"K{p.K} V{p.V}")
    table = Table(title=f"dtune profile: {kernel} {shape} {dtype}{roof_txt}")
    cols = ("stage", "ms", "share", "regs", "spills", "smem", "GB/s", "%BW", "TFLOP/s", "%MM", "floor ms", "vs floor")
    for col in cols:
        table.add_column(col, justify="left" if col in ("stage", "vs floor") else "right")
    for r in result.frame.itertuples(index=False):
        table.add_row(
            str(r.stage),
            _fmt(r.median_ms, ".4f") + ("" if r.meaningful else "*"),
            _fmt(r.share * 100, ".0f") + "%" if not math.isnan(r.share) else "",
            _fmt(r.registers, ".0f"),
            _fmt(r.spills, ".0f"),
            _fmt(r.shared_mem, ".0f"),
            _fmt(r.gbs, ".0f"),
            _fmt(r.pct_bandwidth, ".0f"),
            _fmt(r.tflops, ".1f"),
            _fmt(r.pct_matmul, ".0f"),
            _fmt(r.floor_ms, ".4f"),
            str(r.verdict),
        )
    console.print(table)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if ncu_msg:
        console.print(ncu_msg)
    console.print(f"wrote {csv_path} and {json_path}")


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
    from dtune.report import build_report

    if not run_dir.is_dir():
        _fail(f"{run_dir} is not a folder")
    out_path, sections = build_report(run_dir, output)
    if as_json:
        typer.echo(json.dumps({"html": str(out_path), "sections": sections}))
        return
    for name, state in sections.items():
        mark = "[green]✓[/green]" if state == "ok" else "[yellow]–[/yellow]"
        console.print(f"{mark} {name}: {state}")
    console.print(f"wrote {out_path}")


def register(app: typer.Typer) -> None:
    """Add ``bench``, ``profile`` and ``report`` to ``app``."""
    app.command("bench")(bench)
    app.command("profile")(profile)
    app.command("report")(report)
