"""Host cost of one call: the CPU time an op's default call spends before its launches are queued, dtune next to fla.

Usage (one CUDA GPU, from the checkout's root):
    python benchmarks/host_cost.py [--calls 200] [--repeats 15] [--ops fused_recurrent_kda,...] [--cases decode-B1,...]
    python benchmarks/host_cost.py --interpret      (CPU, Triton's interpreter, tiny shapes: a dry run of every step)

For every op (the six of dtune.ops and fla.ops' namesakes, fla-core) and case (bf16, H = HV = 16, K = V = 128, an
initial state in and the final state out, as a model's layer calls them; ``--heads`` and ``--hv-ratio`` set H and
HV / H, e.g. ``--heads 2 --hv-ratio 2`` for Qwen3-Next's Gated DeltaNet at tensor parallelism 8):

  prefill         B = 1, T = 2048
  prefill-varlen  4 sequences of 512, 300, 1000, 236 tokens packed (cu_seqlens, int64; the same tensor every call,
                  as the layers of a model share it: dtune reads it once, fla caches its index tables per tensor)
  decode-B1       T = 1, B = 1 (the state of the previous step in, the next one out)
  decode-B32      T = 1, B = 32
  prefill-8k      B = 1, T = 8192 (only when ``--cases`` names it)
  prefill-32k     B = 1, T = 32768 (only when ``--cases`` names it: the GPU's time decides its loop_us)

the default call (``dtune.ops.<op>(q, k, v, [g,] beta, initial_state=..., output_final_state=True, cu_seqlens=...)``;
fla's with the same arguments by keyword; ``dtune-cached`` / ``dtune-uncached``: dtune's with its launch cache on /
off, ``DTUNE_LAUNCH_CACHE=1`` / ``0``, :mod:`dtune.kernels.launches`) is timed three ways, after three warm-up calls
(compiles, fla's autotuning):

* ``host_us``: the CPU time per call to queue its launches. The GPU is first made busy with ``torch.cuda._sleep``
  (long enough to cover the whole batch), then N calls are made back to back and timed with ``time.perf_counter``;
  an event recorded after the sleep must still be pending when the last call returns. Then no call can have waited
  for the GPU (a host sync would have waited for the sleep), and the GPU was never the bottleneck: the time is the
  host's alone. When the event has completed, the batch is retried with a longer sleep and fewer calls (a full
  launch queue also blocks); if it still completes, the call waits for the GPU (``waits`` = True: a host sync) and
  ``host_us`` is the isolated time below.
* ``isolated_us``: one call between two ``torch.cuda.synchronize()`` (the clock stops before the second), median:
  host time including any sync's round trip on an idle GPU.
* ``loop_us``: N calls back to back with one synchronize at the end, per call: what an eager decode loop sees
  (the larger of host and GPU time per call).

``--layer-options``: every call as fla's layers make it (raw q, k, gate and beta; ``use_qk_l2norm_in_kernel``,
``use_gate_in_kernel`` with ``A_log`` and ``dt_bias``, ``use_beta_sigmoid_in_kernel``; DeltaNet: the l2norm and the
sigmoid), and two more contestants: ``dtune-kernels``, the options inside the kernels whatever the call's length
(dtune's default call takes the passes above the lengths of :func:`dtune.options.in_kernel_pays`), and
``dtune-passes``, the same options as separate passes before dtune's call (:meth:`dtune.options.Options.apply`), so
the options inside the kernels are timed against the passes they replace.

``--training``: the chunk ops' training step instead (inputs that require grad, the default call under autograd, then
``torch.autograd.grad`` of the output and the final state: the forward's and the backward's launches; dtune's and
fla's), at the prompt cases: where a short-sequence step (fine-tuning, tensor-parallel heads) is the host's.

``--launches`` (CUDA): per launch of dtune's call, the host time of Triton's ``kernel[grid](...)`` against its argument
binding alone and against the compiled kernel's own launch (launches_<op>_<case>.txt): how much of a call is Triton's
dispatch.

Writes under $OUT (default ./out): host_cost.csv (one row per op, case and implementation) and, for dtune's decode-B1
calls (and every case of the chunk ops), profile_<op>.txt / profile_<op>_<case>.txt (cProfile of 200 calls, by own
time: where dtune's host time goes). Prints a table last:
dtune's and fla's host_us side by side and fla / dtune (above 1: dtune queues its launches faster).

Run time on one H200: about a minute of measurement, plus every first call's compile (dtune's and fla's, and fla's
autotuning: a few minutes on a cold Triton cache); ``--ops`` / ``--cases`` split it.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import functools
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPS = (
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
)


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    T: int
    seq_lens: tuple[int, ...] | None = None


GPU_CASES = (
    Case("prefill", 1, 2048),
    Case("prefill-varlen", 1, 0, (512, 300, 1000, 236)),
    Case("decode-B1", 1, 1),
    Case("decode-B32", 32, 1),
)
# on request only (--cases): a long prompt, where the GPU's time is the call's (loop_us)
EXTRA_CASES = (Case("prefill-8k", 1, 8192), Case("prefill-32k", 1, 32768))
CPU_CASES = (
    Case("prefill", 1, 16),
    Case("prefill-varlen", 1, 0, (5, 11)),
    Case("decode-B1", 1, 1),
    Case("decode-B4", 4, 1),
)
COLUMNS = [
    "op", "case", "mode", "impl", "B", "T", "N", "H", "HV", "K", "dtype", "host_us", "isolated_us", "loop_us", "calls",
]  # fmt: skip
COLUMNS += ["repeats", "waits", "meaningful", "note"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="CPU dry run under Triton's interpreter, tiny shapes")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed batch (decode; prefill: a quarter)")
    ap.add_argument("--repeats", type=int, default=15, help="timed batches per op and case (median)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    ap.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    ap.add_argument("--no-fla", action="store_true", help="time dtune only")
    ap.add_argument("--heads", type=int, default=16, help="query/key heads H (default 16; the interpreter: 1)")
    ap.add_argument("--hv-ratio", type=int, default=1, help="value heads per key head, HV = H * ratio (default 1)")
    ap.add_argument("--launches", action="store_true", help="per launch: Triton's path against the compiled launch")
    ap.add_argument("--layer-options", action="store_true", help="fla layers' in-kernel options on every call")
    ap.add_argument("--training", action="store_true", help="the chunk ops' training step (forward and gradients)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    return ap.parse_args(argv)


def build_inputs(op: str, case: Case, interpret: bool, heads: int = 16, hv_ratio: int = 1) -> dict[str, Any]:
    """The op's inputs for ``case`` (bf16, ``heads`` heads, ``heads · hv_ratio`` value heads, K = V = 128 on the GPU;
    fp32, H = 1, K = V = 16 under the interpreter, value heads as on the GPU)."""
    import torch
    from dtune.kernels import get_kernel

    from dtune.measure.inputs import make_inputs
    from dtune.shape import Gate, Shape

    H, D = (1, 16) if interpret else (heads, 128)
    gate = Gate(get_kernel(op).gate)
    n = len(case.seq_lens) if case.seq_lens else case.B
    shape = Shape(case.B, case.T, H, H * hv_ratio, D, D, n, gate, case.seq_lens is not None)
    dtype, device = (torch.float32, "cpu") if interpret else (torch.bfloat16, "cuda")
    x = make_inputs(shape, dtype, device, seed=1, seq_lens=list(case.seq_lens) if case.seq_lens else None)
    if x["cu_seqlens"] is not None:
        x["cu_seqlens"] = x["cu_seqlens"].long()  # fla's type; dtune takes int32 or int64
    x["scale"] = D**-0.5
    x["output_final_state"] = True
    return x


def layer_options(x: dict[str, Any]) -> dict[str, Any]:
    """fla's layers' options for these inputs (made raw: q, k unnormalised, the gate and beta pre-activation), by
    fla's keyword names."""
    import torch

    x["q"].mul_(4.0)
    x["k"].mul_(4.0)
    x["beta"].copy_(torch.randn_like(x["beta"]))
    opts: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    if x["g"] is not None:
        HV, per = x["v"].shape[2], x["g"][0, 0].numel()
        x["g"].copy_(torch.randn_like(x["g"]))
        opts |= {"use_gate_in_kernel": True, "A_log": torch.randn(HV, device=x["g"].device)}
        opts["dt_bias"] = torch.randn(per, device=x["g"].device)
    return opts


def dtune_call(op: str, x: dict[str, Any], opts: dict[str, Any] | None = None) -> Callable[[], Any]:
    """The default call, as a user writes it (positional tensors, keywords after); with fla's ``opts`` as dtune's
    ``options=``."""
    from dtune import ops
    from dtune.options import Options

    fn = getattr(ops, op)
    gates = () if x["g"] is None else (x["g"],)
    q, k, v, beta, h0, cu = x["q"], x["k"], x["v"], x["beta"], x["initial_state"], x["cu_seqlens"]
    options = None if opts is None else Options(**opts)
    return lambda: fn(q, k, v, *gates, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, options=options)


def dtune_kernels_call(op: str, x: dict[str, Any], opts: dict[str, Any]) -> Callable[[], Any]:
    """dtune's call with fla's ``opts`` applied inside the kernels whatever its length (the limits of
    :func:`dtune.options.in_kernel_pays` lifted for the call)."""
    import dtune.options as options_module

    call = dtune_call(op, x, opts)
    limits = ("IN_KERNEL_MAX_TOKENS", "IN_KERNEL_MAX_TOKENS_KDA", "IN_KERNEL_MAX_SEQ_LEN")

    def forced() -> Any:
        saved = [getattr(options_module, n) for n in limits]
        for n in limits:
            setattr(options_module, n, 1 << 62)
        try:
            return call()
        finally:
            for n, v in zip(limits, saved, strict=True):
                setattr(options_module, n, v)

    return forced


def dtune_passes_call(op: str, x: dict[str, Any], opts: dict[str, Any]) -> Callable[[], Any]:
    """fla's ``opts`` as separate passes (:meth:`dtune.options.Options.apply`), then dtune's call without options."""
    from dtune import ops
    from dtune.options import Options

    fn, options = getattr(ops, op), Options(**opts)
    h0, cu = x["initial_state"], x["cu_seqlens"]

    def call() -> Any:
        q, k, g, beta, h = options.apply(x["q"], x["k"], x["g"], x["beta"], h0)
        gates = () if g is None else (g,)
        return fn(q, k, x["v"], *gates, beta, initial_state=h, output_final_state=True, cu_seqlens=cu)

    return call


def fla_call(op: str, x: dict[str, Any], opts: dict[str, Any] | None = None) -> tuple[Callable[[], Any] | None, str]:
    import inspect

    from dtune.measure.baselines import fla_forward, fla_function

    fn, why = fla_function(op)
    if fn is None:
        return None, why
    if opts:
        params = inspect.signature(fn).parameters
        takes_more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())  # (fla reads **kwargs)
        missing = [] if takes_more else sorted(set(opts) - set(params))
        if missing:
            return None, f"fla's {op} takes no {', '.join(missing)}"
        fn = functools.partial(fn, **opts)
    forward = fla_forward(fn, x["g"] is not None)
    return (lambda: forward(x)), ""


def with_grads(x: dict[str, Any]) -> dict[str, Any]:
    """``x`` with its float inputs (q, k, v, g, beta, the initial state) as leaves that require grad."""
    return {n: t.detach().clone().requires_grad_() if n in GRAD_INPUTS and t is not None else t for n, t in x.items()}


GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


def training_step(forward: Callable[[], Any], x: dict[str, Any]) -> Callable[[], Any]:
    """The training step of ``forward`` (a call on ``x``'s leaves, :func:`with_grads`): the forward under autograd,
    then ``torch.autograd.grad`` of the output and the final state (their cotangents drawn once)."""
    import torch

    leaves = [x[n] for n in GRAD_INPUTS if x.get(n) is not None]
    o, s = forward()
    cotangents = (torch.randn_like(o), torch.randn_like(s))

    def step() -> Any:
        o, s = forward()
        return torch.autograd.grad((o, s), leaves, cotangents)

    return step


class Clock:
    """The GPU's sleep clock: cycles of ``torch.cuda._sleep`` per microsecond, measured once."""

    def __init__(self) -> None:
        import torch

        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        self.cycles_per_us = cycles / (a.elapsed_time(b) * 1e3)

    def sleep(self, us: float) -> None:
        import torch

        torch.cuda._sleep(int(us * self.cycles_per_us))


def _queued(call: Callable[[], Any], n: int, sleep_us: float, clock: Clock) -> tuple[float, bool]:
    """Seconds per call of ``n`` calls queued behind a sleeping GPU, and whether the GPU still slept at the end."""
    import torch

    torch.cuda.synchronize()
    clock.sleep(sleep_us)
    slept = torch.cuda.Event()
    slept.record()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    dt = time.perf_counter() - t0
    busy = not slept.query()
    torch.cuda.synchronize()
    return dt / n, busy


def _isolated(call: Callable[[], Any], reps: int, cuda: bool) -> float:
    import torch

    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def _loop(call: Callable[[], Any], n: int, cuda: bool) -> float:
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def measure(call: Callable[[], Any], calls: int, repeats: int, clock: Clock | None) -> dict[str, Any]:
    """``host_us``, ``isolated_us``, ``loop_us`` (see the module docstring), the batch size used and ``waits``."""
    cuda = clock is not None
    for _ in range(3 if cuda else 1):
        call()
    isolated = _isolated(call, max(5, repeats * 3) if cuda else repeats, cuda)
    loop = statistics.median(_loop(call, calls, cuda) for _ in range(max(1, repeats // 5)))
    out = {"isolated_us": isolated * 1e6, "loop_us": loop * 1e6, "calls": calls, "waits": False}
    if clock is None:  # the interpreter runs each kernel inside the call: no queue to measure
        out["host_us"] = isolated * 1e6
        return out
    n, sleep_us, busy = calls, max(3 * isolated * calls * 1e6, 2000.0), False
    for attempt in range(6):
        _, busy = _queued(call, n, sleep_us, clock)
        if busy:
            break
        if attempt % 2 == 0:
            sleep_us *= 4
        else:
            n = max(8, n // 4)
    out["calls"] = n
    if not busy:  # even a few calls behind a long sleep end after it: the call waits for the GPU
        out["host_us"], out["waits"] = isolated * 1e6, True
        return out
    samples = [_queued(call, n, sleep_us, clock) for _ in range(repeats)]
    kept = [dt for dt, b in samples if b]
    out["host_us"] = statistics.median(kept) * 1e6 if kept else isolated * 1e6
    return out


def profile(call: Callable[[], Any], path: Path, calls: int = 200) -> None:
    """cProfile of ``calls`` calls, the 25 functions with the most own time."""
    for _ in range(3):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    path.write_text(buf.getvalue())


def launch_breakdown(call: Callable[[], Any], path: Path, calls: int = 200, repeats: int = 7) -> None:
    """Per launch of one call (CUDA only): the host time of Triton's path, ``kernel[grid](...)`` (``jit``), of its
    argument binding alone (``binder``: the specialisation of every argument) and of the compiled kernel's own launch
    with the same arguments (``direct``: what a launch costs without the JIT's dispatch; TMA descriptors are encoded
    there), each the median over ``repeats`` batches of ``calls``; the call's rest is the difference."""
    import torch
    import triton
    from triton import knobs
    from triton.runtime import jit

    recorded: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any, Any]] = []
    run = jit.JITFunction.run

    def recording(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        recorded.append((self, args, dict(kwargs), grid, kernel))
        return kernel

    def per_call(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(times)

    jit.JITFunction.run = recording
    try:
        call()
    finally:
        jit.JITFunction.run = run
    whole = per_call(call)
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    stream = driver.get_current_stream(device)
    lines = [f"call: {whole:.1f} us host, {len(recorded)} launches", "kernel  args  jit_us  binder_us  direct_us"]
    total = 0.0
    for fn, args, kwargs, grid, kernel in recorded:
        binder = fn.device_caches[device][4]
        bound_kw = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug)
        bound_kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, _, _ = binder(*args, **bound_kw)
        values = list(bound.values())
        g = grid(bound) if callable(grid) else grid
        g3 = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
        jit_us = per_call(lambda: run(fn, *args, grid=grid, warmup=False, **kwargs))  # noqa: B023
        bind_us = per_call(lambda: binder(*args, **bound_kw))  # noqa: B023
        direct_us = per_call(
            lambda: kernel.run(*g3, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)  # noqa: B023
        )
        total += jit_us
        lines.append(f"{fn.fn.__name__}  {len(values)}  {jit_us:.1f}  {bind_us:.1f}  {direct_us:.1f}")
    lines.append(f"launches by Triton's path: {total:.1f} us; the call's rest: {whole - total:.1f} us")
    path.write_text("\n".join(lines) + "\n")


def table(rows: list[dict[str, Any]]) -> str:
    """dtune's and fla's host time per op and case, fla / dtune, and the loop times (``dtune-kernels`` and
    ``dtune-passes`` too when timed)."""
    by = {(r["op"], r["case"], r["impl"]): r for r in rows}
    keys = list(dict.fromkeys((r["op"], r["case"]) for r in rows))
    passes = any(r["impl"] == "dtune-passes" for r in rows)
    head = ["op", "case", "dtune us", "cached us", "uncached us", "fla us", "fla/dtune", "dtune loop", "fla loop"]
    head += ["kernels loop", "passes loop"] if passes else []
    lines = [f"{head[0]:34s} {head[1]:15s} " + " ".join(f"{h:>11s}" for h in head[2:])]

    def cell(r: dict[str, Any] | None, col: str) -> str:
        if r is None or r.get(col) is None:
            return "-"
        return f"{r[col]:.1f}" + ("*" if col == "host_us" and r["waits"] else "")

    for op, case in keys:
        impls = ("dtune", "dtune-cached", "dtune-uncached", "fla", "dtune-kernels", "dtune-passes")
        d, c, u, f, k, p = (by.get((op, case, impl)) for impl in impls)
        ratio = f"{f['host_us'] / d['host_us']:.2f}" if d and f and d.get("host_us") and f.get("host_us") else "-"
        cells = [cell(d, "host_us"), cell(c, "host_us"), cell(u, "host_us"), cell(f, "host_us"), ratio]
        cells.append(cell(d, "loop_us"))
        cells.append(cell(f, "loop_us"))
        cells += [cell(k, "loop_us"), cell(p, "loop_us")] if passes else []
        lines.append(f"{op:34s} {case:15s} " + " ".join(f"{c:>11s}" for c in cells))
    lines.append("host us: CPU time per call before its launches are queued (* the call waits for the GPU: a sync);")
    lines.append("cached / uncached: dtune's call with its launch cache on / off (DTUNE_LAUNCH_CACHE=1 / 0)")
    lines.append("loop us: per call of back-to-back calls with one synchronize at the end")
    return "\n".join(lines)


# dtune's call again with its launch cache on and off, whatever the default (dtune.kernels.launches)
LAUNCH_CACHE = {"dtune-cached": "1", "dtune-uncached": "0"}


@contextmanager
def launch_cache(value: str | None) -> Iterator[None]:
    """dtune's launch cache in mode ``value`` inside (``DTUNE_LAUNCH_CACHE``'s values; None: as dtune was imported),
    restored after."""
    if value is None:
        yield
        return
    from dtune.kernels import launches

    before = launches.set_mode(value)
    try:
        yield
    finally:
        launches.set_mode(before)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Every row so far, the file rewritten whole (through a temporary file: a kill mid-write leaves the last one)."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels
    sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = not args.interpret
    if cuda and not torch.cuda.is_available():
        print("no CUDA GPU: run with --interpret for the CPU dry run", file=sys.stderr)
        return 2
    cases: tuple[Case, ...] = CPU_CASES if args.interpret else GPU_CASES
    if args.cases:
        want = {c.strip() for c in args.cases.split(",") if c.strip()}
        cases = tuple(c for c in cases + (() if args.interpret else EXTRA_CASES) if c.name in want)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    calls, repeats = (3, 2) if args.interpret else (args.calls, args.repeats)
    clock = Clock() if cuda else None
    rows: list[dict[str, Any]] = []
    for op in ops:
        for case in cases:
            if args.training and (not op.startswith("chunk_") or case.T == 1):
                continue  # (the training step: the chunk ops, at prompt lengths)
            x = build_inputs(op, case, args.interpret, args.heads, args.hv_ratio)
            if args.training:
                x = with_grads(x)
            opts = layer_options(x) if args.layer_options else None
            impls: list[tuple[str, Callable[[], Any] | None, str]] = [("dtune", dtune_call(op, x, opts), "")]
            for name, value in LAUNCH_CACHE.items():
                impls.append((name, dtune_call(op, x, opts), f"DTUNE_LAUNCH_CACHE={value}"))
            if opts is not None:
                impls.append(("dtune-kernels", dtune_kernels_call(op, x, opts), ""))
                impls.append(("dtune-passes", dtune_passes_call(op, x, opts), ""))
            if not args.no_fla:
                fn, why = fla_call(op, x, opts) if cuda else (None, "fla needs a CUDA GPU")
                impls.append(("fla", fn, why))
            if args.training:
                impls = [(n, None if c is None else training_step(c, x), w) for n, c, w in impls]
            n_calls = calls if case.T == 1 or args.interpret else max(8, calls // 4)
            for impl, call, why in impls:
                row: dict[str, Any] = {
                    "op": op, "case": case.name, "mode": "fwd+bwd" if args.training else "fwd", "impl": impl,
                    "B": x["q"].shape[0], "T": x["q"].shape[1],
                    "N": len(case.seq_lens) if case.seq_lens else case.B, "H": x["q"].shape[2],
                    "HV": x["v"].shape[2], "K": x["q"].shape[3], "dtype": str(x["q"].dtype).removeprefix("torch."),
                    "repeats": repeats,
                    "meaningful": cuda, "note": why,
                }  # fmt: skip
                if call is not None:
                    try:
                        with launch_cache(LAUNCH_CACHE.get(impl)):
                            row.update(measure(call, n_calls, repeats, clock))
                        if impl == "dtune-cached":  # what it replayed, or why not
                            from dtune.kernels import launches

                            row["note"] = f"{why}; {launches.summary()}"
                    except Exception as exc:  # one failing contestant keeps its row, with the reason
                        row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
                rows.append(row)
                write_rows(out / "host_cost.csv", rows)  # after every row: a run cut short keeps what it measured
                print(f"{op} {case.name} {impl}: {row.get('host_us', float('nan')):.1f} us {row['note']}", flush=True)
            if impls[0][1] is not None and (case.name == "decode-B1" or op.startswith("chunk_")):
                name = f"profile_{op}.txt" if case.name == "decode-B1" else f"profile_{op}_{case.name}.txt"
                profile(impls[0][1], out / name, 200 if cuda else 3)
            if impls[0][1] is not None and args.launches and cuda:
                launch_breakdown(impls[0][1], out / f"launches_{op}_{case.name}.txt")
    write_rows(out / "host_cost.csv", rows)
    if args.interpret:
        print("Triton's interpreter runs each kernel inside the call: these times are NOT meaningful (a dry run)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
