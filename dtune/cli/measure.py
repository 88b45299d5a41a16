"""``dtune bench`` and ``dtune profile``: measure the tuned kernels (parsing and printing; the work is in
:mod:`dtune.measure`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from dtune.cli.common import (
    ConfigOpt,
    DecaysOpt,
    DtypeOpt,
    FinalStateOpt,
    HvRatioOpt,
    InitialStateOpt,
    InterpretOpt,
    JsonOpt,
    KernelOpt,
    OutOpt,
    check_decays,
    check_env_config,
    err,
    fail,
    fmt,
    int_list,
    note,
    out_dir,
    print_rows,
    resolve_dtype,
    use_interpreter,
)
from dtune.cli.common import out as console


def bench(
    kernel: KernelOpt,
    config: ConfigOpt = None,
    baselines: Annotated[
        str,
        typer.Option(
            "--baselines",
            help="Comma-separated baselines to time beside the tuned config (dtune's default call): check_gate (the "
            "same call with check_gate=True, gated kernels), default, fla (its Triton path), flashqla (FlashQLA's "
            "Gated DeltaNet, where it runs; skipped with its reason elsewhere), torch.",
        ),
    ] = "check_gate,default,fla,flashqla,torch",
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
    dtype: DtypeOpt = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
    graph: Annotated[
        bool, typer.Option("--graph", help="Also time fused-recurrent decode (T = 1) under CUDA-graph replay.")
    ] = False,
    rounds: Annotated[
        int | None, typer.Option("--rounds", help="Interleaved rounds per shape (default 3 on a GPU, 1 on the CPU).")
    ] = None,
    packed_seqs: Annotated[
        str | None,
        typer.Option(
            "--packed-seqs",
            help="Time one packed variable-length batch of these sequence lengths (cu_seqlens; comma-separated) per "
            "head dim and heads instead of the --seq-lens x --batch grid (its tuned config is the bucket of B = number "
            "of sequences, T = their mean length).",
        ),
    ] = None,
    hv_ratio: HvRatioOpt = 1,
    models: Annotated[
        str | None,
        typer.Option(
            "--models",
            help="Instead of a shape grid: the buckets these models (names in dtune/models.toml, comma-separated, or "
            "all) call the kernel with at each tensor-parallel degree: prefill, the packed batch, the training step, "
            "decode (tiny shapes of the same head ratio under --interpret).",
        ),
    ] = None,
    tp: Annotated[
        str | None, typer.Option("--tp", help="With --models: these tensor-parallel degrees (default: the file's).")
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            help="fwd: the op's forward; fwd+bwd: its training step (forward with inputs that require grad, then the "
            "gradients), for the tuned backward config (the same as -k <kernel>_bwd).",
        ),
    ] = "fwd",
    initial_state: InitialStateOpt = True,
    final_state: FinalStateOpt = True,
    decays: DecaysOpt = "strong",
    record: Annotated[
        bool,
        typer.Option(
            "--record",
            help="Write each bucket's side-by-side medians (dtune with its own entry, fla, FlashQLA) into the --config "
            "file as side_by_side_ms, which the fla backend's speed rule reads, as each shape finishes; the file must "
            "be for this GPU.",
        ),
    ] = False,
    interpret: InterpretOpt = False,
) -> None:
    """Time the tuned config against the untuned default, flash-linear-attention and the PyTorch reference."""
    use_interpreter(interpret)
    from dtune.inputs import dtype_from_name, interpreting
    from dtune.kernels import get_kernel
    from dtune.measure import bench as b
    from dtune.measure.configs import ConfigSource
    from dtune.measure.grids import make_grid
    from dtune.measure.inputs import Workload
    from dtune.shape import Gate, ShapeGrid, packed_and_grouped

    lens, dims, nheads = (
        int_list(v, o) for v, o in ((seq_lens, "--seq-lens"), (head_dims, "--head-dims"), (heads, "--heads"))
    )
    batches = int_list(batch, "--batch")
    check_env_config()
    check_decays(decays)
    target = _record_target(config) if record else None
    dtype = resolve_dtype(dtype, [kernel], interpreting())
    dest = out_dir(out or b.default_out_dir(config), "output folder")
    try:
        dt = dtype_from_name(dtype)
        want = [s.strip() for s in baselines.split(",") if s.strip()]
        spec = get_kernel(kernel)  # an unknown name fails here, listing the known ones
        if mode not in ("fwd", "fwd+bwd"):
            raise ValueError(f"--mode must be fwd or fwd+bwd, got {mode!r}")
        if mode == "fwd+bwd" and not spec.backward:
            if spec.backward_kernel is None:
                raise ValueError(f"{kernel} has no backward: --mode fwd+bwd needs a chunk kernel")
            kernel = spec.backward_kernel  # the training step, timed for the backward's tuned config
            spec = get_kernel(kernel)
        on_gpu = b.default_device().type == "cuda"
        if models is not None:
            if any((seq_lens, head_dims, heads, batch, batch_tokens, packed_seqs)) or hv_ratio != 1:
                raise ValueError(
                    "--models gives the shapes: drop --seq-lens, --head-dims, --heads, --batch, --batch-tokens, "
                    "--packed-seqs and --hv-ratio"
                )
            runs = _model_runs(kernel, models, tp, dtype)
        else:
            if tp is not None:
                raise ValueError("--tp goes with --models")
            grid = make_grid(kernel, on_gpu, lens, dims, nheads, batches, batch_tokens)
            if config is not None and not any((seq_lens, head_dims, heads, batch, batch_tokens)):
                # No shape asked for: the shapes the config was tuned on.
                grid = ConfigSource.load(config).tuned_grid(kernel, dt, on_gpu, Gate(spec.gate)) or grid
            packed = int_list(packed_seqs, "--packed-seqs")
            if packed is not None or hv_ratio != 1:
                grid = ShapeGrid(explicit=tuple(packed_and_grouped(grid.shapes(Gate(spec.gate)), packed, hv_ratio)))
            runs = [(grid, None if packed is None else tuple(packed))]
        status = err.status("benchmarking", spinner="dots") if not as_json else None
        recorded: list[str] = []
        done: list[b.BenchResult] = []  # the runs finished (a packed batch is a run of its own)

        def shape_done(partial: b.BenchResult) -> None:  # each finished shape on disk at once: a stopped run keeps it
            so_far = b.combine([*done, partial])
            b.write(so_far, dest)
            if target is not None:
                recorded[:] = _record(target, so_far.frame, rounds)

        if status:
            status.start()
        try:
            for grid, packed_run in runs:
                done.append(
                    b.run_bench(
                        kernel,
                        grid,
                        dt,
                        want,
                        config,
                        rounds=rounds,
                        graph=graph,
                        progress=(lambda s: status.update(f"benchmarking {s}")) if status else None,
                        workload=Workload(initial_state, final_state, packed_run, decays),
                        shape_done=shape_done,
                    )
                )
        finally:
            if status:
                status.stop()
        result = b.combine(done)
    except ValueError as exc:
        fail(str(exc))
    csv_path, json_path = b.write(result, dest)
    if as_json:
        rows = json.loads(result.frame.to_json(orient="records"))
        doc = {"rows": rows, "notes": result.notes, "csv": str(csv_path), "json": str(json_path)}
        typer.echo(json.dumps(doc | ({"recorded": recorded} if record else {})))
        return
    step = get_kernel(kernel).backward
    headers = ["shape", "impl", "mode", "median ms", "×default", "×fla", "GB/s", "TFLOP/s", "rel err"]
    headers += ["grad err"] if step else []
    headers += ["peak MB", "note"]
    rows = [
        [
            f"B{r.B} T{r.T} H{r.H} D{r.K}",
            str(r.impl),
            str(r.mode),
            fmt(r.median_ms, ".4f") + ("" if r.meaningful else "*"),
            fmt(r.speedup_vs_default, ".2f"),
            fmt(r.speedup_vs_fla, ".2f"),
            fmt(r.gbs, ".0f"),
            fmt(r.tflops, ".1f"),
            fmt(r.error_o, ".1e"),
            *([fmt(r.error_grad, ".1e")] if step else []),
            fmt(r.peak_mb, ".0f"),
            str(r.note)[:60],
        ]
        for r in result.frame.itertuples(index=False)
    ]
    title = f"dtune bench: {kernel} ({dtype})" + (" — forward + backward" if step else "")
    print_rows(console, title, headers, rows, lead=3, left=("shape", "impl", "mode", "note"))
    for r in result.frame[result.frame["median_ms"].isna()].itertuples(index=False):
        console.print(f"[red]{r.impl} failed[/red] at B{r.B} T{r.T} H{r.H} D{r.K}: {r.note}", highlight=False)
    for text in result.notes:
        note(text)
    if not result.frame["meaningful"].all():
        console.print("* not meaningful: timed on the CPU under Triton's interpreter")
    for r in result.wrong_outputs().itertuples(index=False):
        console.print(
            f"[red]warning:[/red] {r.impl} is off the float64 reference (rel. error {r.error_o:.1e}"
            + (f", gradients {r.error_grad:.1e}" if step else "")
            + f") at B{r.B} T{r.T}"
        )
    console.print(f"wrote {csv_path} and {json_path}", highlight=False)
    if record:
        if recorded:
            console.print(f"recorded side_by_side_ms of {len(recorded)} entries in {config}", highlight=False)
        else:
            note(f"recorded nothing in {config}: no meaningful timing of an entry's own config beside a peer")


def _model_runs(kernel: str, models: str, tp: str | None, dtype: str) -> list[tuple[Any, tuple[int, ...] | None]]:
    """``--models``: the buckets the models call ``kernel`` with, as bench runs: the plain shapes, then each packed
    batch with its sequence lengths (the plan ``dtune tune-gpu --models`` tunes: :func:`dtune.tune.grid.model_plan`)."""
    from dtune.inputs import interpreting
    from dtune.shape import ShapeGrid
    from dtune.tune.grid import model_plan

    names = [n.strip() for n in models.split(",") if n.strip()]
    degrees = int_list(tp, "--tp")
    plan = model_plan(names, [kernel], {kernel: dtype}, degrees=degrees, interpret=interpreting())
    buckets = plan.buckets(kernel)
    plain = tuple(dict.fromkeys(x.shape for x in buckets if not x.packed))
    runs: list[tuple[Any, tuple[int, ...] | None]] = [(ShapeGrid(explicit=plain), None)] if plain else []
    return runs + [(ShapeGrid(explicit=(x.shape,)), x.packed) for x in buckets if x.packed]


def _record_target(config: Path | None) -> Path:
    """The tuned-config file that ``--record`` writes: given, a file, for the GPU present (times measured on one GPU
    are not another's); exit 2 otherwise, before anything is timed."""
    import torch

    from dtune.store import gpu_key, read_configs

    if config is None or not config.is_file():
        fail("--record writes into the --config file: give a tuned-config file")
    gpu = read_configs(config).gpu  # a file that cannot be read or parsed: ConfigFileError, one line naming it
    here = gpu_key(torch.device("cuda")) if torch.cuda.is_available() else "cpu"
    if gpu != here:
        fail(f"--record: {config} is for GPU {gpu!r} and this is {here!r}: its times would be another GPU's")
    return config


def _record(path: Path, frame: object, rounds: int | None) -> list[str]:
    """Write the bench's side-by-side medians into ``path`` (:func:`_record_target`'s); the entries recorded."""
    from dtune.provenance import command_line, stamp
    from dtune.tune.export import record_in_file

    how = f"side_by_side_ms: {command_line() or 'dtune bench --record'} ({stamp(f'{rounds or 3} rounds')})"
    return record_in_file(path, frame, how)


def profile(
    kernel: KernelOpt,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            help="stages: each stage of the forward timed alone (plan()), with registers, spills, shared memory; "
            "fwd, fwd+bwd (or both, comma-separated): every launch of the forward or of the training step (forward "
            "under autograd, then the backward) under the CUDA profiler, dtune's against each stage's floor, beside "
            "the peers' (--baselines); several kernels (-k a,b) and sequence lengths (--seq-len 4096,32768) per run.",
        ),
    ] = "stages",
    seq_len: Annotated[
        str | None,
        typer.Option(
            "--seq-len",
            help="Sequence length T (default 4096 on a GPU, 1 for decode kernels); --mode fwd/fwd+bwd: a comma list.",
        ),
    ] = None,
    head_dim: Annotated[int | None, typer.Option("--head-dim", help="Head dim K = V (default 128 on a GPU).")] = None,
    heads: Annotated[
        int | None, typer.Option("--heads", help="Query/key heads H (default 16 on a GPU; HV = H x --hv-ratio).")
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", help="Batch B (default 32768 // T tokens on a GPU; 32 for decode).")
    ] = None,
    hv_ratio: HvRatioOpt = 1,
    dtype: DtypeOpt = None,
    config: ConfigOpt = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="GPU profile key whose roofs to use when ceilings cannot be measured.")
    ] = None,
    ncu: Annotated[
        bool, typer.Option("--ncu", help="Also run Nsight Compute on the op (needs `ncu` on PATH).")
    ] = False,
    baselines: Annotated[
        str,
        typer.Option(
            "--baselines",
            help="--mode fwd/fwd+bwd: the peers whose launches to profile beside dtune's (fla: its Triton path, and "
            "for chunk_kda its safe_gate mode; flashqla: Gated DeltaNet at D = 128; default: dtune's untuned "
            "default); an empty string for dtune alone.",
        ),
    ] = "fla,flashqla",
    calls: Annotated[
        int | None,
        typer.Option("--calls", min=1, help="--mode fwd/fwd+bwd: profiled calls per contestant (default 10, CPU 2)."),
    ] = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
    initial_state: InitialStateOpt = True,
    final_state: FinalStateOpt = True,
    decays: DecaysOpt = "strong",
    interpret: InterpretOpt = False,
) -> None:
    """Per-stage time, registers, spills, shared memory, GB/s and TFLOP/s against measured ceilings and the floor;
    with --mode fwd / fwd+bwd, every launch of the forward or the training step and of the peers'."""
    use_interpreter(interpret)
    modes = [m.strip() for m in mode.split(",") if m.strip()]
    lens = int_list(seq_len, "--seq-len")
    check_decays(decays)
    if modes != ["stages"]:
        _profile_launches(
            kernel, modes, lens, head_dim, heads, batch, dtype, config, gpu, baselines, calls, out, as_json,
            initial_state, final_state, hv_ratio, decays,
        )  # fmt: skip
        return
    if lens is not None and len(lens) > 1:
        fail("--seq-len: --mode stages profiles one shape (the launch modes, --mode fwd,fwd+bwd, take several)")
    from dtune.gpu import get_profile
    from dtune.inputs import dtype_from_name, interpreting
    from dtune.kernels import get_kernel
    from dtune.measure import profile as pr
    from dtune.measure.bench import default_device, default_out_dir
    from dtune.measure.configs import ConfigSource
    from dtune.measure.grids import profile_shape
    from dtune.measure.inputs import Workload
    from dtune.measure.work import Roofs
    from dtune.shape import Gate

    check_env_config()
    dtype = resolve_dtype(dtype, [kernel], interpreting())
    dest = out_dir(out or default_out_dir(config), "output folder")
    try:
        dt = dtype_from_name(dtype)
        gate = Gate(get_kernel(kernel).gate)
        on_gpu = default_device().type == "cuda"
        p = profile_shape(kernel, gate, on_gpu, lens[0] if lens else None, head_dim, heads, batch, hv_ratio)
        if config is not None and not any((seq_len, head_dim, heads, batch, hv_ratio != 1)):
            # No shape asked for: the largest shape the config was tuned on.
            tuned = ConfigSource.load(config).tuned_grid(kernel, dt, on_gpu, gate)
            if tuned is not None:
                p = max(tuned.shapes(gate), key=lambda q: q.B * q.T * q.HV * q.K * q.V)
        roofs = Roofs.from_profile(get_profile(gpu)) if gpu else None
        workload = Workload(initial_state, final_state, decays=decays)
        result = pr.run_profile(kernel, p, dt, config, roofs=roofs, workload=workload)
    except (ValueError, KeyError) as exc:
        fail(str(exc))
    csv_path, json_path = pr.write(result, dest)
    ncu_msg = ""
    if ncu:
        ncu_msg = pr.run_ncu(pr.ncu_command(kernel, p, dt, json.loads(result.frame["config"].iloc[0]), dest))
    if as_json:
        rows = json.loads(result.frame.to_json(orient="records"))
        payload = {"rows": rows, "notes": result.notes, "ncu": ncu_msg, "csv": str(csv_path), "json": str(json_path)}
        typer.echo(json.dumps(payload))
        return
    r0 = result.roofs
    roof_txt = f" — roofs {r0.gbs:.0f} GB/s, {r0.tflops:.0f} TFLOP/s ({r0.source})" if r0 else ""
    shape = (
        f"B{p.B} T{p.T} H{p.H} "
        + (f"HV{p.HV} " if p.HV != p.H else "")
        + (f"D{p.K}" if p.K == p.V else f"K{p.K} V{p.V}")
    )
    headers = [
        "stage",
        "ms",
        "share",
        "regs",
        "spills",
        "smem",
        "GB/s",
        "%BW",
        "TFLOP/s",
        "%MM",
        "floor ms",
        "vs floor",
    ]
    rows = [
        [
            str(r.stage),
            fmt(r.median_ms, ".4f") + ("" if r.meaningful else "*"),
            fmt(r.share * 100, ".0f") + "%" if not math.isnan(r.share) else "",
            fmt(r.registers, ".0f"),
            fmt(r.spills, ".0f"),
            fmt(r.shared_mem, ".0f"),
            fmt(r.gbs, ".0f"),
            fmt(r.pct_bandwidth, ".0f"),
            fmt(r.tflops, ".1f"),
            fmt(r.pct_matmul, ".0f"),
            fmt(r.floor_ms, ".4f"),
            str(r.verdict),
            fmt(r.error_o, ".1e") if not math.isnan(r.error_o) else "",
        ]
        for r in result.frame.itertuples(index=False)
    ]
    title = f"dtune profile: {kernel} {shape} {dtype}{roof_txt}"
    print_rows(console, title, headers, rows, left=("stage", "vs floor"))
    for text in result.notes:
        note(text)
    wrong = result.frame["error_o"].dropna()
    if len(wrong) and float(wrong.max()) > 0.1:
        off = f"the op's output is off the float64 reference (rel. error {wrong.max():.1e})"
        console.print(f"[red]warning:[/red] {off}", highlight=False)
    if ncu_msg:
        console.print(ncu_msg, highlight=False)
    console.print(f"wrote {csv_path} and {json_path}", highlight=False)


def _profile_launches(
    kernels: str,
    modes: list[str],
    lens: tuple[int, ...] | None,
    head_dim: int | None,
    heads: int | None,
    batch: int | None,
    dtype: str | None,
    config: Path | None,
    gpu: str | None,
    baselines: str,
    calls: int | None,
    out: Path | None,
    as_json: bool,
    initial_state: bool,
    final_state: bool,
    hv_ratio: int = 1,
    decays: str = "strong",
) -> None:
    """``dtune profile --mode fwd,fwd+bwd``: every launch, per kernel and shape, one table each and one CSV."""
    import pandas as pd

    from dtune.gpu import get_profile
    from dtune.inputs import dtype_from_name, interpreting
    from dtune.kernels import get_kernel
    from dtune.measure import launches as la
    from dtune.measure.bench import default_device, default_out_dir
    from dtune.measure.grids import profile_shape
    from dtune.measure.inputs import Workload
    from dtune.measure.work import Roofs
    from dtune.shape import Gate

    check_env_config()
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    dtype = resolve_dtype(dtype, names, interpreting())
    dest = out_dir(out or default_out_dir(config), "output folder")
    peers = [b.strip() for b in baselines.split(",") if b.strip()]
    results = []
    try:
        bad = [m for m in modes if m not in la.MODES]
        if bad:
            raise ValueError(f"--mode: {', '.join(bad)} is not one of stages, {', '.join(la.MODES)}")
        dt = dtype_from_name(dtype)
        on_gpu = default_device().type == "cuda"
        roofs = Roofs.from_profile(get_profile(gpu)) if gpu else None
        for name in names:
            op = la.op_name(name)  # an unknown name fails here, listing the known ones
            for m in modes:
                la.step_kernel(op, m)  # a mode the kernel has not (fwd+bwd of a fused-recurrent one) fails early
            gate = Gate(get_kernel(op).gate)
            for T in lens or (None,):
                p = profile_shape(op, gate, on_gpu, T, head_dim, heads, batch, hv_ratio)
                where = f"B{p.B} T{p.T}"
                status = err.status(f"profiling {op} {where}", spinner="dots") if not as_json else None
                show = (lambda s, where=where, st=status: st.update(f"profiling {s} {where}")) if status else None
                if status:
                    status.start()
                try:
                    workload = Workload(initial_state, final_state, decays=decays)
                    got = la.profile_launches(op, p, dt, modes, peers, config, None, roofs, calls, workload, show)
                finally:
                    if status:
                        status.stop()
                results.append(got)
    except (ValueError, KeyError) as exc:
        fail(str(exc))
    notes = list(dict.fromkeys(n for r in results for n in r.notes))
    result = la.LaunchResult(pd.concat([r.frame for r in results], ignore_index=True), notes, results[0].roofs)
    csv_path, json_path = la.write(result, dest)
    if as_json:
        rows = json.loads(result.frame.to_json(orient="records"))
        typer.echo(json.dumps({"rows": rows, "notes": notes, "csv": str(csv_path), "json": str(json_path)}))
        return
    for title, headers, rows in la.tables(result.frame):
        print_rows(console, title, headers, rows, lead=2, left=("launch", "stage"))
    for text in notes:
        note(text)
    if not result.frame["meaningful"].all():
        console.print("* not meaningful: timed on the CPU under Triton's interpreter")
    console.print(f"wrote {csv_path} and {json_path}", highlight=False)


def verify(
    kernels: Annotated[
        str | None,
        typer.Option("--kernel", "-k", help="Comma-separated kernels to check (default: the six forward kernels)."),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer cases (the sizes most worth a GPU's time).")] = False,
    sweep: Annotated[
        int,
        typer.Option("--sweep", help="Also N random configs per kernel from its space (run twice, bitwise)."),
    ] = 0,
    isolate: Annotated[
        bool, typer.Option("--isolate", help="Each case in its own process (a crash costs one case, not the run).")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds for all isolated cases together.")] = 600.0,
    out: OutOpt = None,
    as_json: JsonOpt = False,
    interpret: InterpretOpt = False,
) -> None:
    """Check the ops against the float64 reference: real sizes on a GPU, tiny ones under the interpreter."""
    use_interpreter(interpret)
    import pandas as pd

    from dtune.kernels import KERNELS, get_kernel
    from dtune.measure import verify as v
    from dtune.measure.bench import default_device
    from dtune.measure.tables import write_table
    from dtune.shape import Gate, Shape

    check_env_config()
    dest = out_dir(out or Path("reports"), "output folder")
    try:
        names = [k.strip() for k in kernels.split(",") if k.strip()] if kernels else [*v.RECURRENT, *v.CHUNK]
        for name in names:
            get_kernel(name)
        device = default_device()
        cases = v.default_cases(names, device.type == "cuda", quick)
        for name in names if sweep else []:
            dims = (2, 1000, 4, 8, 128, 128) if device.type == "cuda" else (1, 33, 1, 2, 16, 16)
            shape = Shape(*dims, gate=Gate(KERNELS[name].gate))
            cases += v.sweep_cases(name, sweep, shape, "bf16" if device.type == "cuda" else "fp32")
    except ValueError as exc:
        fail(str(exc))
    show = None if as_json else (lambda row: err.print(v.describe(row), highlight=False))
    if isolate:
        rows = v.run_isolated(cases, timeout)
        for row in rows:
            if show is not None:
                show(row)
    else:
        rows = v.run_cases(cases, device, show)
    frame = pd.DataFrame(rows)
    csv_path, json_path = write_table(frame, dest, "verify")
    failed = int((~frame["pass"].astype(bool)).sum()) if len(frame) else 0
    if as_json:
        typer.echo(json.dumps({"rows": json.loads(frame.to_json(orient="records")), "failed": failed}))
    else:
        console.print(
            f"{len(rows) - failed} passed, {failed} failed; wrote {csv_path} and {json_path}", highlight=False
        )
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``bench``, ``profile`` and ``verify`` to ``app``."""
    app.command("bench")(bench)
    app.command("profile")(profile)
    app.command("verify")(verify)
