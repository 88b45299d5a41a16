"""The chunk forward's template variants on one GPU: each timed against the shipped config and fla, with per-launch
CUDA times and its bf16 error against the float64 reference.

Variants (search parameters of kernels/chunk/params.py, applied on top of the shipped H200 config of the shape's
bucket, dtune/configs/h200.json; :data:`VARIANTS` holds the ones not yet decided): ``WU = "recomputed"`` (stage 1
stores the chunk's inverse T instead of W and U, and for KDA ``P = β ⊙ K ⊙ e^γ``; the state pass forms V_new
itself), ``AQK = "recomputed"`` (A_qk formed in the state pass), ``STATE_TMA`` (the state pass's tiles by TMA
descriptors), ``STATE_LOOP = "specialized"`` (warp-specialised chunk loop).

Shapes: bf16, H = 16, K = V = 128, initial state and final state; ``B8`` = B 8, T 4096; ``B1`` = B 1, T 32768 (the
shipped configs there run the sequence-parallel state pass). ``--decays``: the log gates timed, ``strong`` (the
default, what the configs were tuned on) or ``model`` (fla's layers' gates at initialisation, most far weaker:
``dtune.measure.inputs.make_inputs``); the variants that depend on the gates' values (``SEG_DECAY``, burn-in) differ.

What is timed is the op's call, ``dtune.ops.run_kernel(kernel, ..., config=cfg)`` (with ``check_gate=False`` where
the op still defaults to checking the gate's values, which costs a read of g and a host sync per call), by CUDA
events with the L2 flushed (median of up to 50, dtune.measure.timing.time_fn), in ``--rounds`` interleaved rounds
(every row of a shape and kernel once per round; the row's time is the median of its rounds', with their spread);
fla's op the same way (its Triton path: ``FLA_FLASH_QLA=0``; chunk_kda only with ``--fla-kda``, its autotune takes
minutes), and FlashQLA's ``chunk_gated_delta_rule`` when it is importable. Per launch: CUDA time
per call from torch.profiler (mean of 10 calls) by kernel name, and their sum (``kernels``: an op call well above it
waited between its launches, for the host). Error: relative RMS (dtune.measure.error) of the
output and the final state against ``kernels.reference.chunk_reference`` in float64 on the GPU, same inputs.

Order: first every dtune config is compiled in parallel child processes (``--workers``, one small call each at the
same constexprs, so that Triton's on-disk cache holds every kernel) while the main process warms fla (its autotune,
cached on disk by fla) and FlashQLA (its JIT); then the rows are timed one after the other. Rows that would start
past ``--budget-s`` are skipped (SKIP) and the table is printed anyway.

Usage:  python benchmarks/fwd_variants.py [--shapes B8,B1] [--kernels chunk_gated_delta_rule,...] [--workers 10]
                                          [--no-fla] [--fla-kda] [--no-flashqla] [--budget-s 330] [--rounds 3]
        python benchmarks/fwd_variants.py --interpret      (a dry run on the CPU: tiny shapes, Triton's interpreter)

Results in $OUT (default ./out): fwd_variants.csv (one row per shape, kernel and variant), launches.jsonl (the
per-launch times), env.json (GPU, versions, commit); the table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["FLA_FLASH_QLA"] = os.environ.get("FLA_FLASH_QLA", "0")  # fla's Triton path (FlashQLA: a row of its own)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import torch

from dtune.measure.inputs import DECAYS

ROOT = Path(__file__).resolve().parents[1]

KERNEL_NAMES = ("chunk_gated_delta_rule", "chunk_delta_rule", "chunk_kda")
SHAPES = {"B8": (8, 4096), "B1": (1, 32768)}
TINY = {"B8": (2, 64), "B1": (1, 256)}  # --interpret
H, D = 16, 128
WU = {"WU": "recomputed"}
TMA = {"STATE_TMA": True}
GLUON = {
    **WU, **TMA, "AQK": "stored", "STATE_LAYOUT": "vk", "FUSE_OUTPUT": True, "SEG_CHUNKS": 0, "h_BV": 64,
    "h_num_stages": 2, "STATE_LOOP": "gluon",
}  # fmt: skip
ALL = KERNEL_NAMES
DN = ("chunk_delta_rule",)
GDN = ("chunk_gated_delta_rule",)
KDA = ("chunk_kda",)
# (name, overrides on the shipped config, the kernels it applies to). Variants timed before leave the list once
# decided (git history keeps them; their times are in reports/*/forward/fwd_variants*.csv).
VARIANTS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("shipped", {}, ALL),
    # DeltaNet with A_qk formed in the state pass too (stage 1 then reads no q), on the H200's entry: 0.389 against
    # 0.406 ms at B8 on an H100 (5 rounds, 2c2728f: shipped in h100.json), equal at B1; the H200 to decide.
    # Decided on the H100 (reports/h100/forward/variants/): KDA's stage 1 storing P and T instead of W and U, at key
    # tiles of 64 or 4 warps (7-48% slower), Gated DeltaNet at chunks of 64 with and without A_qk in the state pass
    # (1.6-2.6x slower)
    ("wu+aqk+tma", {**WU, "AQK": "recomputed", **TMA}, DN),
    # the sequence-parallel pass's phase 1 skipping the transitions a bound of their norm shows negligible (the shipped
    # B1 entry is segmented; at B8, unsegmented, the same config as shipped)
    # segments started by burn-in (phase 3 alone, no transitions; the shipped B1 entry is segmented, B8's is not): not
    # in the search spaces (a NaN before a segment's burn-in does not reach it); to time against the default
    ("segments by burn-in", {"SEG_START": "burnin"}, GDN),
    # the decay-driven skip off (on by default: measured on strong decays; --decays model times it on a model's gates)
    ("no decay skip", {"SEG_DECAY": False}, GDN),
    # the state pass with the output in Gluon, warp-specialised (STATE_LOOP = "gluon", kernels/chunk/state_ws.py):
    # a TMA loader warp h_num_stages chunks ahead of the compute warpgroups; unsegmented, so B8 only
    ("gluon state pass", GLUON, DN + GDN),
    ("gluon 3 deep", {**GLUON, "h_num_stages": 3}, DN + GDN),
    ("gluon h_BV 128", {**GLUON, "h_BV": 128}, DN + GDN),
    ("gluon maxnreg 128", {**GLUON, "h_maxnreg": 128}, DN + GDN),
    ("gluon BT 64", {**GLUON, "BT": 64}, GDN),
    ("gluon serial", {**GLUON, "h_OVERLAP": False}, DN + GDN),
    # ... with A_qk formed in it (mma.sync beside the state update's wgmma): stage 1 reads no q, stores no A_qk
    ("gluon aqk", {**GLUON, "AQK": "recomputed"}, DN + GDN),
    ("gluon aqk maxnreg 128", {**GLUON, "AQK": "recomputed", "h_maxnreg": 128}, DN + GDN),
    ("gluon aqk serial", {**GLUON, "AQK": "recomputed", "h_OVERLAP": False}, DN + GDN),
]


def shipped_config(kernel: str, B: int, T: int) -> dict[str, Any]:
    """The shipped H200 config of the bucket nearest (B, T, H 16, D 128), bf16."""
    from dtune.shape import Shape
    from dtune.store import read_configs

    configs = read_configs(ROOT / "dtune" / "configs" / "h200.json", "h200")
    found = configs.lookup(kernel, "bf16", Shape(B, T, H, H, D, D))
    return dict(found or {})


def configs_for(kernel: str, kind: str, interpret: bool) -> list[tuple[str, dict[str, Any]]]:
    """(variant, full config) rows of one kernel and shape, shipped first."""
    from dtune.kernels import KERNELS

    spec = KERNELS[kernel]
    base = shipped_config(kernel, *SHAPES[kind])
    if interpret:  # tiny shapes: segments of 2 chunks, BC 16 (the interpreter's bf16 dots are not checked here)
        base = {**base, "SEG_CHUNKS": 2 if base.get("SEG_CHUNKS") else 0, "h_BV": 16}
    rows = []
    for name, extra, kernels in VARIANTS:
        if kernel not in kernels:
            continue
        cfg = {**base, **extra}
        if interpret and "h_BV" in extra:
            cfg["h_BV"] = 16
        rows.append((name, spec.check_config(D if not interpret else 32, D if not interpret else 32, cfg)))
    return rows


def make_case(kernel: str, B: int, T: int, dev: str, interpret: bool, decays: str = "strong") -> dict[str, Any]:
    from dtune.kernels import KERNELS

    from dtune.measure.inputs import Workload, workload_inputs
    from dtune.shape import Gate, Shape

    h, d = (2, 32) if interpret else (H, D)
    gate = Gate(KERNELS[kernel].gate)
    shape = Shape(B, T, h, h, d, d, B, gate)
    return workload_inputs(shape, torch.float32 if interpret else torch.bfloat16, dev, Workload(decays=decays))


def op_call(kernel: str, x: dict[str, Any], cfg: dict[str, Any]) -> Callable[[], Any]:
    """The op's call as users make it; ``check_gate=False`` only while the op defaults to checking (see docstring)."""
    from dtune import ops

    sig = inspect.signature(ops.run_kernel).parameters
    extra: dict[str, Any] = {"check_gate": False} if "check_gate" in sig and sig["check_gate"].default is True else {}
    q, k, v, g, beta, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"]
    return lambda: ops.run_kernel(
        kernel, q, k, v, g, beta, scale=x["scale"], initial_state=h0, output_final_state=True, config=cfg, **extra
    )


def _compile_one(kernel: str, kind: str, cfg: dict[str, Any], interpret: bool) -> tuple[str, float]:
    """Child process: one call at a small shape with the same constexprs (T is never specialised), so that every
    kernel of ``cfg`` lands in Triton's on-disk cache. Returns ("", seconds) or (the error, seconds)."""
    t0 = time.monotonic()
    try:
        dev = "cpu" if interpret else "cuda"
        small_T = 64 if not cfg.get("SEG_CHUNKS") else 3 * cfg["SEG_CHUNKS"] * cfg["BT"]  # >= 2 segments
        x = make_case(kernel, 1, small_T if not interpret else TINY[kind][1], dev, interpret)
        op_call(kernel, x, cfg)()
        if not interpret:
            torch.cuda.synchronize()
        return "", time.monotonic() - t0
    except Exception as e:  # a config that does not build: its row records why
        return f"{type(e).__name__}: {str(e).splitlines()[-1][:300] if str(e) else ''}", time.monotonic() - t0


def launch_times(fn: Callable[[], Any], calls: int = 10) -> dict[str, float]:
    """CUDA time per call (ms) of each kernel name, from torch.profiler over ``calls`` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:  # the host-side ops repeat their kernels' times
            continue
        us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0) or 0.0)
        out[ev.key] = out.get(ev.key, 0.0) + us / 1e3 / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def errors(result: tuple[Any, Any], ref: tuple[Any, Any]) -> tuple[float, float]:
    from dtune.measure.error import rel_rms_error

    o, s = result
    return rel_rms_error(o, ref[0]), (rel_rms_error(s, ref[1]) if s is not None else float("nan"))


def reference(x: dict[str, Any]) -> tuple[Any, Any]:
    from dtune.kernels.reference import chunk_reference

    f64 = {
        n: (t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()
    }
    o, s = chunk_reference(
        f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], scale=x["scale"], initial_state=f64["initial_state"],
        output_final_state=True,
    )  # fmt: skip
    return o, s


def fla_calls(kernel: str, x: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """fla's op (and for chunk_kda its safe_gate mode), if fla imports."""
    from dtune.measure.baselines import KDA_LOWER_BOUND, fla_forward, fla_function

    out: list[tuple[str, Callable[[], Any]]] = []
    fn, why = fla_function(kernel)
    xs = {**x, "cu_seqlens": None}
    if fn is None:
        print(f"  fla: {why}", flush=True)
    else:
        gated = kernel != "chunk_delta_rule"
        fwd = fla_forward(fn, gated)
        out.append(("fla", lambda: fwd(xs)))
        if kernel == "chunk_kda":
            fast = fla_forward(fn, gated, safe_gate=True, lower_bound=KDA_LOWER_BOUND)
            xf = {**xs, "g": xs["g"].clamp(min=KDA_LOWER_BOUND)}
            out.append(("fla safe_gate", lambda: fast(xf)))
    return out


def flashqla_call(kernel: str, x: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    if kernel != "chunk_gated_delta_rule":
        return []
    try:
        import flash_qla
    except Exception as e:
        print(f"  flashqla: not importable ({type(e).__name__})", flush=True)
        return []
    kw = {"scale": x["scale"], "initial_state": x["initial_state"], "output_final_state": True}
    return [("flashqla", lambda: flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw))]


def baselines(kernel: str, x: dict[str, Any], a: argparse.Namespace) -> list[tuple[str, Callable[[], Any]]]:
    """The baselines to time beside dtune for ``kernel`` under the command line's switches."""
    out = [] if a.no_fla or (kernel == "chunk_kda" and not a.fla_kda) else fla_calls(kernel, x)
    return out + ([] if a.no_flashqla else flashqla_call(kernel, x))


def env_info(interpret: bool) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "interpret": interpret}
    if not interpret:
        info["gpu"] = torch.cuda.get_device_name()
    try:  # DTUNE_COMMIT first: a copied tree may carry a stale or no .git
        info["commit"] = (
            os.environ.get("DTUNE_COMMIT")
            or subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    except Exception:
        info["commit"] = "unknown"
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        info["fla"] = None
    return info


def main() -> None:
    doc = __doc__ or ""
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1], formatter_class=fmt)
    ap.add_argument("--shapes", default="B8,B1", help="comma-separated: B8 (B 8, T 4096), B1 (B 1, T 32768)")
    ap.add_argument("--kernels", default=",".join(KERNEL_NAMES))
    ap.add_argument("--workers", type=int, default=10, help="compile processes")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-kda", action="store_true", help="time fla's chunk_kda too (its autotune takes minutes)")
    ap.add_argument("--no-flashqla", action="store_true", help="FlashQLA is timed when importable (~45 s JIT a shape)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip the rows that would start after this (GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape and kernel")
    ap.add_argument(
        "--decays", default="strong", choices=DECAYS,
        help="the log gates timed: strong (the tuned configs' inputs) or model (fla's layers at initialisation)",
    )  # fmt: skip
    ap.add_argument("--interpret", action="store_true", help="CPU dry run under Triton's interpreter, tiny shapes")
    a = ap.parse_args()
    t_start = time.monotonic()
    interpret = a.interpret
    dev = "cpu" if interpret else "cuda"
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in a.shapes.split(",") if k]
    kernels = [k for k in a.kernels.split(",") if k]
    for k in kinds:
        if k not in SHAPES:
            ap.error(f"unknown shape {k!r}; use {', '.join(SHAPES)}")
    (out / "env.json").write_text(json.dumps(env_info(interpret), indent=1))

    # ---- 1. compile every dtune config in child processes (and warm fla here meanwhile) ----------------------------
    plan = [
        (kind, kernel, name, cfg)
        for kind in kinds
        for kernel in kernels
        for name, cfg in configs_for(kernel, kind, interpret)
    ]
    ctx = __import__("multiprocessing").get_context("spawn")
    compile_errors: dict[tuple[str, str, str], str] = {}
    with ProcessPoolExecutor(max_workers=max(1, a.workers if not interpret else 2), mp_context=ctx) as pool:
        futures: dict[tuple[str, str, str], Future[tuple[str, float]]] = {
            (kind, kernel, name): pool.submit(_compile_one, kernel, kind, cfg, interpret)
            for kind, kernel, name, cfg in plan
        }
        if not interpret:  # fla's autotune and FlashQLA's JIT at the real shapes (fla caches its choices on disk)
            for kind in kinds:
                B, T = SHAPES[kind]
                for kernel in kernels:
                    x = make_case(kernel, B, T, dev, interpret)
                    for name, warm in baselines(kernel, x, a):
                        t0 = time.monotonic()
                        try:
                            warm()
                            torch.cuda.synchronize()
                            print(f"  warm {name} {kernel} {kind}: {time.monotonic() - t0:.1f} s", flush=True)
                        except Exception as e:
                            print(f"  warm {name} {kernel} {kind} failed: {type(e).__name__}: {e}"[:300], flush=True)
        for key, fut in futures.items():
            err, secs = fut.result()
            if err:
                compile_errors[key] = err
                print(f"  compile {' '.join(key)}: FAILED {err}", flush=True)
    print(
        f"compiled {len(plan)} configs in {time.monotonic() - t_start:.0f} s ({len(compile_errors)} failed)", flush=True
    )

    # ---- 2. time the rows one after the other ----------------------------------------------------------------------
    from dtune.measure.timing import time_fn

    rows: list[dict[str, Any]] = []
    fields = [
        "shape",
        "kernel",
        "variant",
        "median_ms",
        "min_ms",
        "max_ms",
        "rounds",
        "vs_shipped",
        "vs_fla",
        "err_o",
        "err_state",
        "kernels_ms",
        "launches",
        "note",
    ]
    csv_path, jl_path = out / "fwd_variants.csv", out / "launches.jsonl"
    with csv_path.open("w", newline="") as fcsv, jl_path.open("w") as fjl:
        writer = csv.DictWriter(fcsv, fieldnames=fields)
        writer.writeheader()
        for kind in kinds:
            B, T = TINY[kind] if interpret else SHAPES[kind]
            for kernel in kernels:
                x = make_case(kernel, B, T, dev, interpret, a.decays)
                ref = reference(x)
                contestants: list[tuple[str, Callable[[], Any] | None, str]] = []
                for name, cfg in configs_for(kernel, kind, interpret):
                    err = compile_errors.get((kind, kernel, name), "")
                    contestants.append((name, None if err else op_call(kernel, x, cfg), err))
                if not interpret:
                    contestants += [(n, f, "") for n, f in baselines(kernel, x, a)]
                base_ms = fla_ms = None
                group: list[dict[str, Any]] = []
                live: list[tuple[dict[str, Any], Callable[[], Any]]] = []
                n_warm, n_rep = (0, 1) if interpret else (5, 50)  # a dry run: once
                for name, fn, note in contestants:
                    row: dict[str, Any] = {
                        "shape": f"{kind} (B{B} T{T})" + ("" if a.decays == "strong" else f" {a.decays}"),
                        "kernel": kernel,
                        "variant": name,
                        "note": note,
                    }
                    if fn is not None and not interpret and time.monotonic() - t_start > a.budget_s:
                        fn, row["note"] = None, "SKIP (budget)"
                    if fn is not None:
                        try:
                            result = fn()
                            row["err_o"], row["err_state"] = errors(result, ref)
                            launches = launch_times(fn) if not interpret else {}
                            row["launches"] = "; ".join(f"{k[:40]} {v:.3f}" for k, v in launches.items())
                            row["kernels_ms"] = sum(launches.values()) if launches else None
                            fjl.write(
                                json.dumps({"shape": kind, "kernel": kernel, "variant": name, "ms": launches}) + "\n"
                            )
                            live.append((row, fn))
                        except Exception as e:
                            row["note"] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                            traceback.print_exc()
                    group.append(row)
                # interleaved rounds: every contestant once per round, the median of its rounds' medians
                times: dict[int, list[float]] = {i: [] for i in range(len(live))}
                for _ in range(1 if interpret else a.rounds):
                    for i, (row, fn) in enumerate(live):
                        if row["note"].startswith("FAILED"):
                            continue
                        try:
                            times[i].append(time_fn(fn, dev, warmup=n_warm, repeats=n_rep).median_ms)
                        except Exception as e:
                            row["note"] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                            traceback.print_exc()
                for i, (row, _fn) in enumerate(live):
                    if times[i]:
                        row["median_ms"] = statistics.median(times[i])
                        row["min_ms"], row["max_ms"], row["rounds"] = min(times[i]), max(times[i]), len(times[i])
                for row in group:
                    if row["variant"] == "shipped":
                        base_ms = row.get("median_ms")
                    if row["variant"] == "fla":
                        fla_ms = row.get("median_ms")
                    print(
                        f"  {kind} {kernel} {row['variant']}: {row.get('median_ms', '-')} ms  {row.get('note', '')}",
                        flush=True,
                    )
                for row in group:
                    ms = row.get("median_ms")
                    row["vs_shipped"] = base_ms / ms if ms and base_ms else None
                    row["vs_fla"] = fla_ms / ms if ms and fla_ms else None
                    writer.writerow(row)
                    rows.append(row)
                fcsv.flush()
                fjl.flush()
                del x, ref

    # ---- 3. the table ------------------------------------------------------------------------------------------------
    def f(v: Any, spec: str) -> str:
        return "-" if v is None or v == "" else format(v, spec)

    print(
        f"\nchunk forward variants: bf16, H {H}, D {D}, initial + final state; {env_info(interpret).get('gpu', 'CPU')}"
    )
    print("times: op call, CUDA events, L2 flushed, median (interpreter: host clock, not meaningful); kernels: the")
    print("call's launches summed (torch.profiler): a call well above it waited between its launches (host time)")
    print(
        f"{'shape':<18}{'kernel':<24}{'variant':<18}{'ms':>8}{'spread':>14}{'kernels':>9}{'x ship':>8}{'x fla':>7}"
        f"{'err o':>9}{'err S':>9}  note"
    )
    for r in rows:
        print(
            f"{r['shape']:<18}{r['kernel']:<24}{r['variant']:<18}{f(r.get('median_ms'), '.3f'):>8}"
            f"{' ' + f(r.get('min_ms'), '.3f') + '-' + f(r.get('max_ms'), '.3f'):>14}{f(r.get('kernels_ms'), '.3f'):>9}"
            f"{f(r.get('vs_shipped'), '.2f'):>8}{f(r.get('vs_fla'), '.2f'):>7}{f(r.get('err_o'), '.2e'):>9}"
            f"{f(r.get('err_state'), '.2e'):>9}  {r.get('note') or ''}"
        )
    print(f"\n{csv_path}, {jl_path}; {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
