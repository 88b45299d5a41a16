"""The training step of record: dtune's chunk ops as a training loop calls them, against fla (and FlashQLA for Gated
DeltaNet), forward under autograd and backward, with gradient errors and peak memory.

Usage (one CUDA GPU, from the checkout's root; fla-core installed, flash-qla for the FlashQLA rows:
benchmarks/install_flashqla.sh):
    python benchmarks/training_step.py [--kernels chunk_delta_rule,chunk_gated_delta_rule,chunk_kda] [--dims 64,128]
        [--shapes 1024,4096,16384,32768] [--peers fla,flashqla] [--rounds 3] [--budget-s 570]
    python benchmarks/training_step.py --interpret      (CPU, Triton's interpreter, tiny shapes: a dry run)

The step (per kernel, head dim D = K = V, shape; bf16, H = 16, B = --batch-tokens // T, so T = 32768 is B = 1):
inputs that require grad (q, k, v, g, beta, the initial state; log gates down to -5), the op's default call under
autograd with the final state (dtune: ``dtune.ops.<op>(q, k, v, [g,] beta, scale=, initial_state=h0,
output_final_state=True)``, its shipped configs as the ops pick them; fla: ``fla.ops.*.<op>`` on fla's Triton path, for
chunk_kda also its safe_gate mode; FlashQLA: ``flash_qla.chunk_gated_delta_rule``, Gated DeltaNet at D = 128), then
``torch.autograd.grad`` of (o, final state) from fixed random gradients. Steps:

0. Warm-up, in child processes: dtune's steps compiled without launching, one process per (kernel, D, shape), at most
   --jobs at a time; each peer's steps run once per shape in a process of its own (fla compiles and autotunes, about
   1-2 minutes per kernel and head dim on a cold cache; FlashQLA JIT-compiles on the host, about 45 s forward and 60 s
   backward), while the GPU does nothing else that lasts (dtune's children only compile). Triton's on-disk cache,
   fla's cached autotuning (FLA_CACHE_RESULTS) and TileLang's cache then serve the main process, and later runs on the
   same machine.
1. Per shape: each contestant's output and gradients against autograd through the chunked reference in float64
   (float32 with chunk 16 where the float64 graph would pass --ref-max-gib; errors left out beyond), relative RMS;
   the peak memory of a step above what was allocated before it (saved intermediates, workspaces, gradients); then
   --rounds interleaved rounds (each contestant in turn) of CUDA-event medians with the L2 flushed: the median of the
   rounds' medians, their spread ((max - min) / median) and the rounds' medians themselves.
2. Under $OUT (default ./out): bench.csv and bench.json (dtune bench's columns: kernel chunk_*_bwd, mode fwd+bwd, so
   that ``dtune report $OUT`` draws it; plus each gradient's error, the reference's dtype, the rounds), rewritten after
   every shape; summary.txt, the table printed last.

Budget: --budget-s for all of it (the GPU machine allows 10 minutes a command). The warm-up is waited for (what it
does not finish the first calls would pay, one compile at a time); a shape that no longer fits (about 20 s each, warm)
is skipped and says so. On a cold cache fla's autotuning dominates: split the grid across calls (--kernels, --dims),
a later call on the same machine finds the caches warm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from dtune.kernels import get_kernel  # noqa: E402

from dtune.measure.baselines import build_impls  # noqa: E402
from dtune.measure.bench import COLUMNS, add_speedups, peak_mb  # noqa: E402
from dtune.measure.error import rel_rms_error  # noqa: E402
from dtune.measure.grad import StepResult, op_kwargs, reference_bytes, reference_step, step_call  # noqa: E402
from dtune.measure.harness import op_run  # noqa: E402
from dtune.measure.timing import time_call  # noqa: E402
from dtune.provenance import git_commit  # noqa: E402
from dtune.shape import Gate, Shape  # noqa: E402

KERNELS = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda")
GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
EXTRA = ["reference", *(f"err_{g}" for g in GRADS.values()), "round_ms", "spread_pct", "ref_s"]
SHAPE_S = 20.0  # seconds one warm shape takes (reference, errors, peak, rounds of up to four contestants): the budget
REF_F32_CHUNK = 16  # the float32 reference's chunk: exp(γ_i)·exp(−γ_j) of 16 steps of log decay ≥ −5 stays finite


def out_dir(path: str | None) -> Path:
    out = Path(path or os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def parse_shapes(text: str, tokens: int, heads: int, dims: list[int], gate: Gate) -> list[Shape]:
    """``"1024,4096,1x32768"``: a T (B = tokens // T) or a ``BxT`` item each, at every head dim."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        b, _, t = item.rpartition("x")
        T = int(t)
        B = int(b) if b else max(1, tokens // T)
        out += [Shape(B, T, heads, heads, d, d, gate=gate) for d in dims]
    return out


def dtune_forward(op: str) -> Callable[[dict[str, Any]], Any]:
    """dtune's op as a training loop calls it: the public op, default keywords, the initial and final state."""
    import dtune.ops

    fn = getattr(dtune.ops, op)
    gated = get_kernel(op).gate != "none"

    def forward(x: dict[str, Any]) -> Any:
        gates = (x["g"], x["beta"]) if gated else (x["beta"],)
        return fn(
            x["q"], x["k"], x["v"], *gates, scale=x["scale"], initial_state=x["initial_state"],
            output_final_state=x["output_final_state"],
        )  # fmt: skip

    return forward


def dtune_configs(op: str, p: Shape, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """The configs dtune's call runs (the store's, as the op picks them): their JSON and where they came from."""
    from dtune.store import tuned_config

    found = {name: tuned_config(name, p, dtype, device) for name in (op, op + "_bwd")}
    full = {
        "fwd": get_kernel(op).check_config(p.K, p.V, found[op]),
        "bwd": get_kernel(op + "_bwd").check_config(p.K, p.V, found[op + "_bwd"]),
    }
    where = ", ".join(f"{k}: {'shipped' if found[n] else 'default'}" for k, n in (("fwd", op), ("bwd", op + "_bwd")))
    return json.dumps(full, sort_keys=True), where


def contestants(
    op: str, p: Shape, dtype: torch.dtype, device: torch.device, peers: list[str]
) -> tuple[list[tuple[str, Callable[[dict[str, Any]], Callable[[], StepResult]], str, str, str]], list[str]]:
    """``(name, make(inputs) -> step, config, config_source, note)`` for dtune and every peer that runs here, and
    the notes of those that do not."""
    config, where = dtune_configs(op, p, dtype, device)
    forward = dtune_forward(op)
    out = [("tuned", lambda x: step_call(forward, x), config, where, "dtune's default call")]
    impls, notes = build_impls(op + "_bwd", peers, None, "", device.type == "cuda", p, dtype)
    out += [(i.name, i.make, "", i.config_source, i.note) for i in impls if i.name != "tuned"]
    return out, notes


# ---- 0. warm-up ------------------------------------------------------------------------------------------------------


def warm(what: str, a: argparse.Namespace) -> None:
    """(Child process.) ``dtune:OP:D:BxT``: build, without launching, every kernel of dtune's step there (its shipped
    configs); ``PEER:OP:D,...`` (fla, flashqla): run that peer's steps once per shape (compiles, autotuning, JIT)."""
    from dtune.tune.trials import compile_without_launch

    t0 = time.monotonic()
    device = torch.device("cpu" if a.interpret else "cuda")
    dtype = torch.float32 if a.interpret else torch.bfloat16
    kind, _, spec = what.partition(":")
    if kind == "dtune":
        op, d, bt = spec.split(":")
        B, T = (int(v) for v in bt.split("x"))
        p = Shape(B, T, a.heads, a.heads, int(d), int(d), gate=Gate(get_kernel(op).gate))
        x = op_run(op + "_bwd", p, dtype, device).inputs
        with compile_without_launch():
            step_call(dtune_forward(op), x)()
        print(f"warm dtune {op} D{d} B{B} T{T}: {time.monotonic() - t0:.0f} s", flush=True)
        return
    for item in spec.split(","):
        op, d = item.split(":")
        gate = Gate(get_kernel(op).gate)
        for p in parse_shapes(a.shapes, a.batch_tokens, a.heads, [int(d)], gate):
            x = op_run(op + "_bwd", p, dtype, device).inputs
            found, notes = contestants(op, p, dtype, device, [kind])
            for name, make, *_ in found[1:]:
                t1 = time.monotonic()
                try:
                    make(x)()
                    torch.cuda.synchronize()
                except Exception as exc:  # reported again, with its row, by the main process
                    print(f"warm {name} {op} D{d}: {first_line(exc)}", flush=True)
                print(f"warm {name} {op} D{d} B{p.B} T{p.T}: {time.monotonic() - t1:.0f} s", flush=True)
            for n in notes:
                print(f"warm: {n}", flush=True)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"warm {kind}: {time.monotonic() - t0:.0f} s", flush=True)


class Warmup:
    """The warm-up processes: one per peer (started first: fla's autotuning is the longest; FlashQLA's JIT compiles on
    the host, its few launches do not disturb fla's timings) and dtune's compiles, at most ``jobs`` of them at a time
    (the rest start as others finish, while :meth:`wait` waits)."""

    def __init__(self, a: argparse.Namespace, kernels: list[str], dims: list[int]) -> None:
        base = [sys.executable, __file__, "--shapes", a.shapes, "--batch-tokens", str(a.batch_tokens)]
        base += ["--heads", str(a.heads), "--peers", a.peers] + (["--interpret"] if a.interpret else [])
        self.jobs = a.jobs
        self.running: list[tuple[subprocess.Popen[bytes], str]] = []
        self.waiting: list[tuple[list[str], str]] = []
        for op in kernels:
            for p in parse_shapes(a.shapes, a.batch_tokens, a.heads, dims, Gate(get_kernel(op).gate)):
                what = f"dtune:{op}:{p.K}:{p.B}x{p.T}"
                self.waiting.append(([*base, "--warm", what], what))
        for peer in peers(a) if not a.interpret else []:
            what = f"{peer}:" + ",".join(f"{op}:{d}" for op in kernels for d in dims)
            self.running.append((subprocess.Popen([*base, "--warm", what]), what))
        self._fill()

    def _fill(self) -> None:
        compiling = sum(1 for proc, what in self.running if what.startswith("dtune:") and proc.poll() is None)
        while self.waiting and compiling < self.jobs:
            cmd, what = self.waiting.pop(0)
            self.running.append((subprocess.Popen(cmd), what))
            compiling += 1

    def wait(self, seconds: float) -> None:
        """Wait for all of it for at most ``seconds``; then stop what still runs: its compiles so far stay cached,
        the main process builds the rest on first use."""
        end = time.monotonic() + max(0.0, seconds)
        while time.monotonic() < end:
            self._fill()
            if not self.waiting and all(proc.poll() is not None for proc, _ in self.running):
                return
            time.sleep(0.5)
        for proc, what in self.running:
            if proc.poll() is None:
                print(f"warm-up {what} still running: stopped (budget)", flush=True)
                proc.kill()
                proc.wait()
        if self.waiting:
            print(f"warm-up: {len(self.waiting)} compile process(es) not started (budget)", flush=True)
        self.waiting.clear()


# ---- 1. measure ------------------------------------------------------------------------------------------------------


def reference(x: dict[str, Any], p: Shape, max_gib: float) -> tuple[StepResult | None, str]:
    """The truth of a step: float64 autograd through the chunked reference, or float32 (chunk 16) where float64's
    graph would pass ``max_gib``; ``(None, why)`` beyond."""
    from dtune.kernels.reference import chunk_reference

    est = reference_bytes(p) / 2**30
    if est <= max_gib:
        return reference_step(x), "float64"
    if est / 2 <= max_gib:

        def forward(xs: dict[str, Any]) -> Any:
            return chunk_reference(**op_kwargs(xs), chunk_size=REF_F32_CHUNK, dtype=torch.float32)

        return step_call(forward, x, torch.float32)(), "float32"
    return None, f"no errors: the reference's graph would hold ~{est:.0f} GiB (--ref-max-gib {max_gib:g})"


def errors(got: StepResult, ref: StepResult) -> dict[str, float]:
    out = {"error_o": rel_rms_error(got.o, ref.o)}
    for name, label in GRADS.items():
        a, b = got.grads.get(name), ref.grads.get(name)
        out[f"err_{label}"] = rel_rms_error(a, b) if a is not None and b is not None else math.nan
    grads = [v for k, v in out.items() if k.startswith("err_d") and not math.isnan(v)]
    out["error_grad"] = max(grads) if grads else math.nan
    return out


def measure(op: str, p: Shape, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every contestant's rows at one shape: errors, peak memory, interleaved rounds."""
    kernel = op + "_bwd"
    run = op_run(kernel, p, dtype, device)
    x = run.inputs
    found, notes = contestants(op, run.shape, dtype, device, peers(a))
    for n in notes:
        NOTES.setdefault(n, None)
    t0 = time.monotonic()
    ref, ref_kind = (None, "errors off (--no-errors)") if a.no_errors else reference(x, run.shape, a.ref_max_gib)
    ref_s = time.monotonic() - t0
    rows: dict[str, dict[str, Any]] = {}
    calls: dict[str, Callable[[], StepResult]] = {}
    for name, make, config, where, note in found:
        row: dict[str, Any] = {"impl": name, "config": config, "config_source": where, "note": note}
        row["reference"] = ref_kind
        try:
            step = make(x)
            t1 = time.perf_counter()
            got = step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row["first_call_s"] = time.perf_counter() - t1
            if ref is not None:
                row |= errors(got, ref)
            del got
            row["peak_mb"] = peak_mb(step, device)
            calls[name] = step
        except Exception as exc:  # a contestant that fails keeps its row, with the error's first line
            row["note"] = first_line(exc)
            traceback.print_exc()
        rows[name] = row
    del ref
    rounds: dict[str, list[float]] = {name: [] for name in calls}
    iqrs: dict[str, list[float]] = {name: [] for name in calls}
    repeats: dict[str, int] = {name: 0 for name in calls}
    for _ in range(a.rounds):
        for name, step in list(calls.items()):
            try:
                t = time_call(step, device)
            except Exception as exc:
                rows[name]["note"] = first_line(exc)
                del calls[name]
                continue
            rounds[name].append(t.median_ms)
            iqrs[name].append(t.iqr_ms)
            repeats[name] += t.repeats
    s, w = run.shape, run.work
    out = []
    for name, row in rows.items():
        ms_list = rounds.get(name, [])
        ms = statistics.median(ms_list) if ms_list else math.nan
        row |= {
            "kernel": kernel, "mode": "fwd+bwd", "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
            "B": s.B, "T": s.T, "H": s.H, "HV": s.HV, "K": s.K, "V": s.V, "N": s.N,
            "median_ms": ms, "min_ms": min(ms_list) if ms_list else math.nan,
            "iqr_ms": statistics.median(iqrs[name]) if iqrs.get(name) else math.nan,
            "repeats": repeats.get(name, 0), "meaningful": device.type == "cuda",
            "gbs": w.gbs(ms), "tflops": w.tflops(ms), "flops": w.flops, "bytes": w.bytes, "device": str(device),
            "round_ms": ";".join(f"{v:.4f}" for v in ms_list),
            "spread_pct": 100 * (max(ms_list) - min(ms_list)) / ms if len(ms_list) > 1 else math.nan,
            "ref_s": ref_s,
        }  # fmt: skip
        out.append(row)
    del x, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


NOTES: dict[str, None] = {}  # notes on contestants that cannot run, each once


def note_row(op: str, p: Shape, note: str) -> dict[str, Any]:
    """dtune's row at a shape that was not measured, saying why."""
    shape = {"B": p.B, "T": p.T, "H": p.H, "HV": p.HV, "K": p.K, "V": p.V, "N": p.N}
    return {"kernel": op + "_bwd", "impl": "tuned", "mode": "fwd+bwd", **shape, "note": note}


def peers(a: argparse.Namespace) -> list[str]:
    return [s.strip() for s in a.peers.split(",") if s.strip()]


def frame_of(rows: list[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    for col in [*COLUMNS, *EXTRA]:
        if col not in frame.columns:
            frame[col] = math.nan
    frame = add_speedups(frame)
    frame["commit"] = git_commit()
    return frame[[*COLUMNS, *EXTRA]]


def write(rows: list[dict[str, Any]], out: Path) -> pd.DataFrame:
    """bench.csv and bench.json, all rows so far (a run cut short keeps what it measured)."""
    frame = frame_of(rows)
    frame.to_csv(out / "bench.csv", index=False)
    frame.to_json(out / "bench.json", orient="records", indent=1)
    return frame


# ---- 2. the table ----------------------------------------------------------------------------------------------------


def table(frame: pd.DataFrame) -> str:
    """Per kernel, head dim and shape: dtune against fla's fastest mode (and FlashQLA): medians with the rounds'
    spread, ×, peak MiB, the largest gradient error and dtune's worst gradient error over fla's on the same one."""

    def f(v: Any, spec: str) -> str:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    head = ["kernel", "D", "shape", "dtune ms (spread)", "fla ms", "×fla", "flashqla ms", "×flashqla",
            "peak MiB dtune/fla", "grad err dtune / fla", "worst grad ×fla", "note"]  # fmt: skip
    lines = [head]
    for key, grp in frame.groupby(["kernel", "K", "B", "T"], sort=False):
        kernel, K, B, T = key
        by = {r["impl"]: r for r in grp.to_dict("records")}
        me = by.get("tuned", {})
        fla_rows = [r for n, r in by.items() if n in ("fla", "fla_fast") and pd.notna(r.get("median_ms"))]
        fla = min(fla_rows, key=lambda r: r["median_ms"]) if fla_rows else {}
        fq = by.get("flashqla", {})
        worst = math.nan
        if fla:
            ratios = [me.get(c, math.nan) / fla[c] for c in EXTRA if c.startswith("err_d") and fla.get(c)]
            worst = max((r for r in ratios if not math.isnan(r)), default=math.nan)
        ms = me.get("median_ms", math.nan)
        notes = [str(r.get("note")) for r in by.values() if pd.isna(r.get("median_ms")) and r.get("note")]
        lines.append([
            str(kernel).removesuffix("_bwd"), f"{K}", f"B{B} T{T}",
            f(ms, ".3f") + (f" ({f(me.get('spread_pct'), '.1f')}%)" if pd.notna(me.get("spread_pct")) else ""),
            f(fla.get("median_ms"), ".3f") + (" (safe_gate)" if fla.get("impl") == "fla_fast" else ""),
            f(fla.get("median_ms", math.nan) / ms, ".2f"),
            f(fq.get("median_ms"), ".3f"), f(fq.get("median_ms", math.nan) / ms, ".2f"),
            f"{f(me.get('peak_mb'), '.0f')}/{f(fla.get('peak_mb'), '.0f')}",
            f"{f(me.get('error_grad'), '.1e')} / {f(fla.get('error_grad'), '.1e')}",
            f(worst, ".2f"), "; ".join(notes)[:80],
        ])  # fmt: skip
    width = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in lines)


# ---- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated chunk ops (default: all three)")
    ap.add_argument("--dims", default=None, help="head dims D = K = V (default 64,128; --interpret 16)")
    ap.add_argument("--shapes", default=None, help="T (B = --batch-tokens // T) or BxT items (default "
                    "1024,4096,16384,32768; --interpret 40)")  # fmt: skip
    ap.add_argument("--batch-tokens", type=int, default=None, help="B·T (default 32768; --interpret 80)")
    ap.add_argument("--heads", type=int, default=None, help="H = HV (default 16; --interpret 2)")
    ap.add_argument("--peers", default="fla,flashqla", help="baselines beside dtune: fla, flashqla (or none: '')")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; --interpret 1)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="all of it, warm-up included (default 570)")
    ap.add_argument("--ref-max-gib", type=float, default=40.0, help="float64 reference graph size beyond which the "
                    "reference is float32 (twice that: no errors; default 40)")  # fmt: skip
    ap.add_argument("--no-errors", action="store_true", help="leave the gradient errors out (time only)")
    ap.add_argument("-j", "--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 3)),
                    help="dtune's warm-up compile processes at a time")  # fmt: skip
    ap.add_argument("--no-warm", action="store_true", help="no warm-up processes (compile on first use)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./out)")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # child process: see warm()
    a = ap.parse_args()
    a.dims = a.dims or ("16" if a.interpret else "64,128")
    a.shapes = a.shapes or ("40" if a.interpret else "1024,4096,16384,32768")
    a.batch_tokens = a.batch_tokens or (80 if a.interpret else 32768)
    a.heads = a.heads or (2 if a.interpret else 16)
    a.rounds = a.rounds or (1 if a.interpret else 3)
    if a.warm:
        warm(a.warm, a)
        return
    if not a.interpret and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --interpret for a dry run on the CPU)")
    end = time.monotonic() + a.budget_s
    kernels = [k.strip() for k in a.kernels.split(",") if k.strip()]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(f"--kernels: {', '.join(unknown)} not among {', '.join(KERNELS)}")
    dims = [int(d) for d in a.dims.split(",")]
    device = torch.device("cpu" if a.interpret else "cuda")
    dtype = torch.float32 if a.interpret else torch.bfloat16  # bf16 dots are garbage under the interpreter
    out = out_dir(a.out)
    grid = [(op, p) for op in kernels for p in parse_shapes(a.shapes, a.batch_tokens, a.heads, dims,
                                                           Gate(get_kernel(op).gate))]  # fmt: skip
    print(f"torch {torch.__version__}, {len(grid)} shapes, OUT={out}, budget {a.budget_s:.0f} s", flush=True)
    warmup = None if a.no_warm else Warmup(a, kernels, dims)
    rows: list[dict[str, Any]] = []
    try:
        if warmup is not None:
            warmup.wait(end - time.monotonic() - SHAPE_S)  # what it does not finish, the first calls would pay
        print(f"warm-up done, {end - time.monotonic():.0f} s left", flush=True)
        for op, p in grid:
            if end - time.monotonic() < SHAPE_S:
                rows.append(note_row(op, p, "skipped: budget"))
                continue
            t0 = time.monotonic()
            try:
                rows += measure(op, p, a, device, dtype)
            except Exception as exc:  # e.g. out of memory: the shape's row says so, the others run
                traceback.print_exc()
                rows.append(note_row(op, p, first_line(exc)))
            write(rows, out)
            print(f"{op} D{p.K} B{p.B} T{p.T}: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        if warmup is not None:
            warmup.wait(0)
        frame = write(rows, out) if rows else None
        text = "\n".join([
            "== training step: forward under autograd + backward, median ms of interleaved rounds (spread), "
            "peak MiB above the inputs, largest gradient error (rel. RMS vs the reference) ==",
            table(frame) if frame is not None else "(no rows)",
            *(f"note: {n}" for n in NOTES),
        ])  # fmt: skip
        (out / "summary.txt").write_text(text + "\n")
        print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
