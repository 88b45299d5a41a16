"""GPU check of the chunkwise kernels: correctness at real sizes (float32, bfloat16) and a benchmark against fla.

Usage (one CUDA GPU):  python scripts/gpu_chunk.py [--quick] [--no-bench] [--no-check] [--no-fla] [--budget-s 230]
                                                   [--sweep N]

1. Correctness: chunk_delta_rule / chunk_gated_delta_rule / chunk_kda with their default configs (plus a few
   non-default configs unless --quick) against the float64 chunked reference on the GPU (chunk_reference),
   strong decays (per-step log gate down to −5; one KDA case down to −60, where the guarded diagonal's exact
   second pass runs): relative RMS error of the output and the final state, PASS/FAIL
   per case. One failing case prints FAIL (with the exception) and the run continues. ``--sweep N`` adds N random
   configs per op drawn from the shipped search space (bf16, B=2 T=1000 H=4 HV=8 D=128), each run twice and
   compared bitwise (races in the intra stage's read-back of W/U would show there).
2. Benchmark (not a test): bf16, B·T = 32768, H = 16 (8 at D = 256), T in {1024, 4096, 16384}, D in {64, 128, 256}:
   median ms (dtune.measure.time_fn: CUDA events, L2 flushed, median) of dtune's default config, of the same
   with FUSE_OUTPUT, and of flash-linear-attention when importable (chunk_kda also in its fast mode
   safe_gate=True, lower_bound=-5; gates are drawn in [-5, 0)), measured side by side in this run; the ratio
   fla / dtune (> 1: dtune faster) and dtune's per-stage times. fla autotunes every new shape family on its
   first call (20-80 s): the full grid does not fit 4 minutes with fla; --budget-s skips what is left (SKIP).

Details go to $OUT (default ./out): chunk_correctness.csv, chunk_bench.csv, chunk_stages.csv, chunk_gpu.json.
The short tables are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.reference import chunk_reference

from dtune import ops
from dtune.inputs import dtype_name
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import time_fn
from dtune.shape import Gate, Shape

OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
SHORT = {Gate.NONE: "dn", Gate.SCALAR: "gdn", Gate.CHANNEL: "kda"}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


Case = tuple[str, Shape, "list[int] | None", "dict[str, Any] | None", tuple[torch.dtype, ...]]
BOTH = (torch.float32, torch.bfloat16)
BF16 = (torch.bfloat16,)


def correctness_cases(quick: bool) -> list[Case]:
    """(name, problem, seq_lens, config, dtypes). Every distinct case compiles its three kernels (~2 s each; float32
    with exact dots takes ~15 s a case on the H200), so float32 runs only where it adds coverage: the varlen case
    (grouped heads, K != V), and without --quick also T = 16384. --quick keeps two real sizes (bf16; T = 4096 at
    D = 128, T = 16384 at D = 64), D = 256, the varlen case and the KDA case with log gates down to −60. Both modes
    run the transposed state pass (STATE_LAYOUT = "vk") at T = 4096 and on the varlen case."""
    cases: list[Case] = []
    for gate in Gate:
        s = SHORT[gate]
        varlen = Shape(1, 0, 4, 8, 128, 64, 7, gate, True)
        if quick:
            cases.append((f"B8-T4096-H16-D128-{s}", Shape(8, 4096, 16, 16, 128, 128, 8, gate), None, None, BF16))
            cases.append((f"B1-T16384-H16-D64-{s}", Shape(1, 16384, 16, 16, 64, 64, 1, gate), None, None, BF16))
        else:
            cases.append((f"B2-T16384-H16-D128-{s}", Shape(2, 16384, 16, 16, 128, 128, 2, gate), None, None, BOTH))
            cases.append((f"B8-T4096-H16-D64-{s}", Shape(8, 4096, 16, 16, 64, 64, 8, gate), None, None, BF16))
        cases.append((f"B4-T1023-H8-D256-{s}", Shape(4, 1023, 8, 8, 256, 256, 4, gate), None, None, BF16))
        cases.append((f"varlen-H4-HV8-K128-V64-{s}", varlen, [1, 700, 33, 0, 2048, 129, 63], None, BOTH))
        # the transposed state pass at its wgmma size (not yet run on a GPU when added, 2026-11-29)
        vk = {"STATE_LAYOUT": "vk", "h_BV": 64}
        cases.append((f"B8-T4096-H16-D128-{s}-vk", Shape(8, 4096, 16, 16, 128, 128, 8, gate), None, vk, BF16))
        cases.append((f"varlen-H4-HV8-K128-V64-{s}-vk", varlen, [1, 700, 33, 0, 2048, 129, 63], vk, BOTH))
        if gate is Gate.CHANNEL:  # per-step log gates down to −60: the guarded diagonal's exact second pass runs
            steep = Shape(2, 1000, 4, 8, 128, 128, 2, gate)
            cases.append((f"B2-T1000-H4-HV8-D128-{s}-gate-60", steep, None, None, BOTH))
        if not quick:
            variants: list[dict[str, Any]] = [{"FUSE_OUTPUT": True}, {"BT": 128, "BC": 32, "intra_num_warps": 8}]
            if gate is Gate.CHANNEL:
                variants += [{"SAFE_DIAG": False, "BC": 16}, {"SAFE_DIAG": False, "BC": 32}, {"BT": 32, "BC": 16}]
            for cfg in variants:
                tag = "-".join(f"{k}{v}" for k, v in cfg.items())
                p = Shape(4, 2000, 8, 8, 128, 128, 4, gate)
                cases.append((f"B4-T2000-H8-D128-{s}-{tag}", p, None, cfg, BF16))
    return cases


def check_correctness(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for name, p, seq_lens, cfg, dtypes in correctness_cases(quick):
        for dtype in dtypes:
            row: dict[str, Any] = {"case": name, "dtype": dtype_name(dtype), "config": json.dumps(cfg or {})}
            t0 = time.time()
            try:
                gmin = -60.0 if name.endswith("gate-60") else -5.0
                x = make_inputs(p, dtype=dtype, device="cuda", seed=1, seq_lens=seq_lens, gate_min=gmin)
                args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
                kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
                o, s = ops.run_kernel(OPS[p.gate], *args, **kw, config=cfg)
                torch.cuda.synchronize()
                o_ref, s_ref = chunk_reference(*args, **kw)
                assert s is not None and s_ref is not None
                row |= {"err_o": rel(o, o_ref), "err_s": rel(s, s_ref)}
                row["pass"] = row["err_o"] < TOL[dtype] and row["err_s"] < TOL[dtype]
                del o, s, o_ref, s_ref, x
            except Exception as e:  # one failing case must not hide the others
                row |= {"err_o": float("nan"), "err_s": float("nan"), "pass": False, "error": repr(e)[:300]}
                traceback.print_exc()
            row["seconds"] = time.time() - t0
            rows.append(row)
            print(
                f"{row['case']:<52} {row['dtype']:<5} o {row['err_o']:.2e} S {row['err_s']:.2e} "
                f"{'PASS' if row['pass'] else 'FAIL'} ({row['seconds']:.1f} s)",
                flush=True,
            )
            torch.cuda.empty_cache()
    return rows


def sweep(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n random configs per op from the shipped search space (constraints applied, H200-like limits), bf16, one
    mid-size shape: error vs the reference, and a second run compared bitwise (a race shows as a difference)."""
    import random

    from dtune.tune.space import Shape, load_space

    gpu = {"smem_per_block": 232448, "sm_count": 132, "cc_major": 9, "cc_minor": 0, "regs_per_sm": 65536}
    rows = []
    rng = random.Random(seed)
    for gate in Gate:
        op = OPS[gate]
        space = load_space(op)
        p = Shape(2, 1000, 4, 8, 128, 128, 2, gate)
        shape = Shape(B=2, T=1000, H=4, HV=8, K=128, V=128)
        x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=5, gate_min=-5.0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        kw = {"initial_state": x["initial_state"], "output_final_state": True}
        o_ref, s_ref = chunk_reference(*args, **kw)
        assert s_ref is not None
        drawn = 0
        for _ in range(50 * n):
            if drawn == n:
                break
            cfg = {name: rng.choice(list(choices)) for name, choices in space.params.items()}
            full = KERNELS[op].check_config(128, 128, cfg)
            if space.violations(full, shape, gpu):
                continue
            drawn += 1
            row: dict[str, Any] = {"op": op, "config": json.dumps(cfg)}
            try:
                o, s = ops.run_kernel(op, *args, **kw, config=cfg)
                o2, s2 = ops.run_kernel(op, *args, **kw, config=cfg)
                assert s is not None and s2 is not None
                row |= {"err_o": rel(o, o_ref), "err_s": rel(s, s_ref)}
                row["deterministic"] = bool(torch.equal(o, o2) and torch.equal(s, s2))
                row["pass"] = row["err_o"] < TOL[torch.bfloat16] and row["err_s"] < TOL[torch.bfloat16]
                row["pass"] = row["pass"] and row["deterministic"]
            except Exception as e:
                row |= {"err_o": float("nan"), "err_s": float("nan"), "pass": False, "error": repr(e)[:300]}
            rows.append(row)
            print(
                f"sweep {op:<24} o {row['err_o']:.2e} S {row['err_s']:.2e} det {row.get('deterministic')} "
                f"{'PASS' if row['pass'] else 'FAIL'} {row['config']}"[:400],
                flush=True,
            )
        torch.cuda.empty_cache()
    return rows


def fla_ops() -> dict[str, Callable[..., Any]]:
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:
        print(f"fla not importable ({e!r}): no fla baseline", flush=True)
        return {}
    return {
        "chunk_delta_rule": lambda q, k, v, g, b, h0: chunk_delta_rule(
            q, k, v, b, initial_state=h0, output_final_state=True
        ),
        "chunk_gated_delta_rule": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
            q, k, v, g=g, beta=b, initial_state=h0, output_final_state=True
        ),
        "chunk_kda": lambda q, k, v, g, b, h0: chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True),
        "chunk_kda/safe_gate": lambda q, k, v, g, b, h0: chunk_kda(
            q, k, v, g, b, initial_state=h0, output_final_state=True, safe_gate=True, lower_bound=-5.0
        ),
    }


def bench_shape(
    gate: Gate, D: int, T: int, fla: dict[str, Callable[..., Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time dtune (default, default + FUSE_OUTPUT) and fla on one shape; per-stage times of dtune's default."""
    op = OPS[gate]
    H = 8 if D == 256 else 16
    B = 32768 // T
    base = {"op": op, "D": D, "T": T, "B": B, "H": H}
    rows: list[dict[str, Any]] = []
    stage_rows: list[dict[str, Any]] = []
    p = Shape(B, T, H, H, D, D, B, gate)
    x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=2, gate_min=-5.0)
    q, k, v, g, b, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"]
    if g is not None:
        g = g.clamp(-5.0, -1e-6)
    spec = KERNELS[op]
    default = spec.default_config(D, D)
    impls: dict[str, Callable[[], Any]] = {
        "dtune": lambda: ops.run_kernel(op, q, k, v, g, b, None, h0, True),
        "dtune_fused": lambda: ops.run_kernel(op, q, k, v, g, b, None, h0, True, config={"FUSE_OUTPUT": True}),
    }
    for name, fla_fn in fla.items():
        if name.split("/")[0] == op:
            impls[name.replace(op, "fla")] = partial(fla_fn, q, k, v, g, b, h0)
    for impl, fn in impls.items():
        t0 = time.time()
        try:
            fn()
            torch.cuda.synchronize()
            first = time.time() - t0
            tm = time_fn(fn, warmup=3, repeats=30)
            rows.append(base | {"impl": impl, "ms": tm.median_ms, "iqr_ms": tm.iqr_ms, "first_call_s": first})
            print(f"{op:<24} D{D:<4} T{T:<6} {impl:<14} {tm.median_ms:8.3f} ms (first call {first:.1f} s)", flush=True)
        except Exception as e:
            rows.append(base | {"impl": impl, "error": repr(e)})
            print(f"{op:<24} D{D:<4} T{T:<6} {impl:<14} FAIL {e!r}"[:300], flush=True)
    # per-stage breakdown of the default config (each stage timed alone, on the same buffers)
    stages, _ = chunk_mod.plan(q, k, v, g, b, spec.gate, D**-0.5, h0, True, None, default)
    for st in stages:
        ts = time_fn(st.run, warmup=2, repeats=20)
        kern = st.run()
        stage_rows.append(
            base
            | {
                "stage": st.name,
                "ms": ts.median_ms,
                "TFLOPs": st.flops / ts.median_ms / 1e9,
                "GBs": st.bytes / ts.median_ms / 1e6,
                "n_regs": getattr(kern, "n_regs", None),
                "n_spills": getattr(kern, "n_spills", None),
                "shared": getattr(getattr(kern, "metadata", None), "shared", None),
            }
        )
    return rows, stage_rows


def bench(quick: bool, use_fla: bool, deadline: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    fla = fla_ops() if use_fla else {}
    rows: list[dict[str, Any]] = []
    stage_rows: list[dict[str, Any]] = []
    dims = (128,) if quick else (64, 128, 256)
    seq_lens = (4096,) if quick else (1024, 4096, 16384)
    for gate in (Gate.CHANNEL, Gate.SCALAR, Gate.NONE):
        for D in dims:
            for T in seq_lens:
                base = {"op": OPS[gate], "D": D, "T": T}
                if time.time() > deadline:
                    print(f"{OPS[gate]:<24} D{D:<4} T{T:<6} SKIP (time budget)", flush=True)
                    rows.append(base | {"impl": "-", "skipped": True})
                    continue
                try:
                    r, sr = bench_shape(gate, D, T, fla)
                    rows += r
                    stage_rows += sr
                except Exception as e:
                    print(f"{OPS[gate]:<24} D{D:<4} T{T:<6} FAIL {e!r}"[:300], flush=True)
                    traceback.print_exc()
                    rows.append(base | {"impl": "-", "error": repr(e)})
                torch.cuda.empty_cache()
    return rows, stage_rows


def fmt_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols} if rows else {}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grids (benchmark: D=128, T=4096)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness part")
    ap.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    ap.add_argument("--no-fla", action="store_true", help="benchmark dtune only")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip benchmark cases started after this")
    ap.add_argument(
        "--sweep", type=int, default=0, metavar="N", help="also check N random search-space configs per op (bf16)"
    )
    args = ap.parse_args()
    start = time.time()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    corr: list[dict[str, Any]] = []
    if not args.no_check:
        corr = check_correctness(args.quick)
        with open(out / "chunk_correctness.csv", "w") as f:
            cols = ["case", "dtype", "config", "err_o", "err_s", "pass", "seconds", "error"]
            f.write(",".join(cols) + "\n")
            for r in corr:
                f.write(",".join(json.dumps(r.get(c, "")) for c in cols) + "\n")
    if args.sweep:
        sw = sweep(args.sweep)
        corr += [
            {"case": f"sweep-{r['op']}", "dtype": "bf16"}
            | {k: r.get(k, "") for k in ("config", "err_o", "err_s", "pass")}
            for r in sw
        ]
        with open(out / "chunk_sweep.json", "w") as f:
            json.dump(sw, f, indent=1, default=str)
    t_check = time.time() - start
    rows: list[dict[str, Any]] = []
    stage_rows: list[dict[str, Any]] = []
    if not args.no_bench:
        rows, stage_rows = bench(args.quick, not args.no_fla, start + args.budget_s)
        for name, data in (("chunk_bench.csv", rows), ("chunk_stages.csv", stage_rows)):
            keys = sorted({k for r in data for k in r})
            with open(out / name, "w") as f:
                f.write(",".join(keys) + "\n")
                for r in data:
                    f.write(",".join(json.dumps(r.get(c, "")) for c in keys) + "\n")
    with open(out / "chunk_gpu.json", "w") as f:
        json.dump(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "correctness": corr}
            | {"bench": rows, "stages": stage_rows},
            f,
            indent=1,
            default=str,
        )

    # ---- short tables, last ----
    if corr:
        print(f"\n=== chunk correctness vs float64 chunk_reference ({t_check:.0f} s) ===")
        short = [
            {
                "case": r["case"],
                "dtype": r["dtype"],
                "err_o": f"{r['err_o']:.2e}",
                "err_s": f"{r['err_s']:.2e}",
                "ok": "PASS" if r["pass"] else "FAIL",
            }
            for r in corr
        ]
        print(fmt_table(short, ["case", "dtype", "err_o", "err_s", "ok"]))
    if stage_rows:
        print("\n=== dtune default: per-stage ms (nominal TFLOP/s, GB/s, regs/spills/smem) ===")
        short = [
            {
                "op": r["op"],
                "D": r["D"],
                "T": r["T"],
                "stage": r["stage"],
                "ms": f"{r['ms']:.3f}",
                "TF/s": f"{r['TFLOPs']:.0f}",
                "GB/s": f"{r['GBs']:.0f}",
                "regs/spill/smem": f"{r['n_regs']}/{r['n_spills']}/{r['shared']}",
            }
            for r in stage_rows
        ]
        print(fmt_table(short, ["op", "D", "T", "stage", "ms", "TF/s", "GB/s", "regs/spill/smem"]))
    if rows:
        print(
            f"\n=== bf16, B*T=32768, median ms; ratio = fla / dtune (> 1: dtune faster); "
            f"{time.time() - start:.0f} s ==="
        )
        table: dict[tuple[str, int, int], dict[str, Any]] = {}
        for r in rows:
            if "ms" in r:
                table.setdefault((r["op"], r["D"], r["T"]), {})[r["impl"]] = r["ms"]
        short = []
        for (op, D, T), t in table.items():
            best = min(v for i, v in t.items() if i.startswith("dtune"))
            fla_best = min([v for i, v in t.items() if i.startswith("fla")], default=None)
            short.append(
                {
                    "op": op,
                    "D": D,
                    "T": T,
                    **{i: f"{v:.3f}" for i, v in t.items()},
                    "ratio": "-" if fla_best is None else f"{fla_best / best:.2f}",
                }
            )
        impl_cols = sorted({i for t in table.values() for i in t})
        print(fmt_table(short, ["op", "D", "T", *impl_cols, "ratio"]))
        print("(ratio: best fla mode / best dtune variant)")
    n_fail = sum(not r["pass"] for r in corr)
    if corr:
        print(f"\ncorrectness: {len(corr) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
