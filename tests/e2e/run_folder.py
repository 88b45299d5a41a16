"""A realistic synthetic run folder (what ``dtune search --out DIR`` writes, plus bench.csv, profile.csv and
launches.csv).

Built from the documented contract only (run.json, study.db, trials.csv, tuned.json), so report tests do not
depend on the tuner's code. Times are deterministic and shaped like a real search: the default first, a
spread of configs, some failing the gate or the compiler, some pruned by constraints.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

KERNEL = "chunk_kda"
GPU = {
    "key": "h200",
    "name": "NVIDIA H200",
    "cc_major": 9,
    "cc_minor": 0,
    "sm_count": 132,
    "smem_per_block": 232448,
    "regs_per_sm": 65536,
    "l2_mb": 60,
    "hbm_gbs": 4800.0,
    "bf16_tflops": 989.0,
    "fp32_tflops": 67.0,
    "source": "datasheet",
}
PARAMS: dict[str, tuple[int, ...]] = {
    "BT": (32, 64),
    "BC": (16, 32),
    "BV": (32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}
DEFAULT = {"BT": 64, "BC": 16, "BV": 64, "num_warps": 4, "num_stages": 2}
SHAPES = [(T, D) for D in (64, 128) for T in (1024, 4096, 16384)]
STAGES = ["gate_cumsum", "kkt_solve", "wu", "state_pass", "output"]


def _shape(T: int, D: int) -> dict[str, Any]:
    return {"shape_key": f"T{T}_D{D}", "B": 32768 // T, "T": T, "H": 16, "HV": 16, "K": D, "V": D}


def _time(T: int, D: int, p: dict[str, int]) -> float:
    """A smooth, deterministic cost: bigger tiles help up to a point, warps and stages matter a little."""
    base = 0.45 * (D / 64) * (1 + 0.08 * math.log2(T / 1024))
    tile = 1.0 + 0.15 * abs(math.log2(p["BV"] / (D / 2))) + (0.1 if p["BT"] == 32 else 0.0)
    return round(base * tile * (1 + 0.05 * abs(p["num_warps"] - 4) / 2) * (1 + 0.03 * (3 - p["num_stages"])), 5)


def make_run_folder(root: Path, trials_per_study: int = 14, seed: int = 0) -> Path:
    """Write a complete run folder under ``root`` and return it."""
    run = root / "run-h200-chunk_kda"
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{run / 'study.db'}"
    dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in PARAMS.items()}
    rows, entries = [], []
    for T, D in SHAPES:
        shape = _shape(T, D)
        name = f"{KERNEL}:h200:bf16:{shape['shape_key']}"
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize")
        default_ms = _time(T, D, DEFAULT)
        for n in range(trials_per_study):
            p = dict(DEFAULT) if n == 0 else {k: rng.choice(v) for k, v in PARAMS.items()}
            roll = rng.random() if n else 1.0
            state, reason, message = "complete", "ok", ""
            if roll < 0.12:
                state, reason, message = "pruned", "constraint", "BC > BT"
            elif roll < 0.22:
                state, reason, message = "failed", "gate", "rel. RMS error 3.1e-1 > 1e-2 (overflow in exp)"
            elif roll < 0.27:
                state, reason, message = "failed", "resources", "out of shared memory: 262144 > 232448"
            t = _time(T, D, p) if state == "complete" else math.nan
            ot = {"complete": optuna.trial.TrialState.COMPLETE, "failed": optuna.trial.TrialState.FAIL}.get(
                state, optuna.trial.TrialState.PRUNED
            )
            study.add_trial(
                optuna.trial.create_trial(params=p, distributions=dists, value=None if math.isnan(t) else t, state=ot)
            )
            w_flops = 32768 * 16 * (2 * 64 * (5 * D) + 6 * D * D)
            w_bytes = 32768 * 16 * (2 * 4 * D + 2 + 4 * D)
            rows.append(
                {
                    "study": name,
                    "kernel": KERNEL,
                    "gpu": "h200",
                    "dtype": "bf16",
                    **shape,
                    "number": n,
                    "state": state,
                    "reason": reason,
                    "message": message,
                    "time_ms": t,
                    "default_time_ms": default_ms,
                    "error_o": 2e-3 if state == "complete" else (0.31 if reason == "gate" else math.nan),
                    "error_s": 1e-3 if state == "complete" else math.nan,
                    "registers": 128 if state == "complete" else math.nan,
                    "spills": 0 if state == "complete" else math.nan,
                    "shared_mem": 49152 * p["num_stages"] if state == "complete" else math.nan,
                    "gbs": w_bytes / (t * 1e-3) / 1e9 if state == "complete" else math.nan,
                    "tflops": w_flops / (t * 1e-3) / 1e12 if state == "complete" else math.nan,
                    "is_default": n == 0,
                    "datetime_start": f"2026-11-29T10:{n:02d}:00",
                    "duration_s": 2.5 + 0.1 * n,
                    **{f"p.{k}": v for k, v in p.items()},
                }
            )
        done = [r for r in rows if r["study"] == name and r["state"] == "complete"]
        best = min(done, key=lambda r: r["time_ms"])
        entries.append(
            {
                "kernel": KERNEL,
                "dtype": "bf16",
                "bucket": {c: shape[c] for c in ("T", "B", "H", "HV", "K", "V")},
                "config": {k: best[f"p.{k}"] for k in PARAMS},
                "time_ms": best["time_ms"],
                "default_time_ms": default_ms,
                "speedup": default_ms / best["time_ms"],
                "gate_error": best["error_o"],
                "trials": {
                    s: sum(r["study"] == name and r["state"] == s for r in rows)
                    for s in ("complete", "failed", "pruned")
                },
            }
        )
    pd.DataFrame(rows).to_csv(run / "trials.csv", index=False)
    versions = {
        "dtune": "0.1.0",
        "torch": "2.13.0",
        "triton": "3.9.0",
        "optuna": optuna.__version__,
        "python": "3.11.2",
    }
    (run / "run.json").write_text(
        json.dumps(
            {
                "kernel": KERNEL,
                "gpu": GPU,
                "dtype": "bf16",
                "shapes": [_shape(T, D) for T, D in SHAPES],
                "versions": versions,
                "commit": "83e632d",
                "interpret": False,
                "sampler": "TPESampler",
                "created": "2026-11-29T10:00:00Z",
            },
            indent=1,
        )
    )
    tuned = {"schema": 1, "gpu": "h200", "gpu_name": GPU["name"], "versions": versions, "entries": entries}
    (run / "tuned.json").write_text(json.dumps(tuned, indent=1))
    _bench(run, entries)
    _profile(run)
    _launches(run)
    return run


def _bench_row(
    kernel: str, impl: str, mode: str, b: dict[str, Any], ms: float, source: str, **extra: Any
) -> dict[str, Any]:
    D = b["K"]
    tokens = b["B"] * b["T"]
    flops = tokens * 16 * (2 * 64 * (5 * D) + 6 * D * D)
    nbytes = tokens * 16 * (2 * 4 * D + 2 + 4 * D)
    match = source.split(":")[0] if impl == "tuned" else ""
    return {
        "kernel": kernel,
        "impl": impl,
        "mode": mode,
        "dtype": "bf16",
        **b,
        "N": b.get("N", b["B"]),
        "median_ms": ms,
        "min_ms": ms * 0.98,
        "iqr_ms": ms * 0.01,
        "repeats": 150,
        "meaningful": True,
        "gbs": nbytes / (ms * 1e-3) / 1e9,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "flops": flops,
        "bytes": nbytes,
        "config_source": source if impl == "tuned" else "fla default" if impl.startswith("fla") else "template default",
        "config_match": match,
        "device": "cuda",
        "note": "",
        **extra,
    }


def _bench(run: Path, entries: list[dict[str, Any]]) -> None:
    """The prefill grid of the tuned entries, an untuned long prompt (its config borrowed), a packed batch, a training
    step (mode fwd+bwd) and decode (eager and graph): the report's three uses."""
    rows = []
    cases: list[tuple[str, str, dict[str, Any], dict[str, float], str, str]] = []
    for e in entries:
        b = e["bucket"]
        D = b["K"]
        times = {
            "tuned": e["time_ms"],
            "default": e["default_time_ms"],
            "fla": 0.9 * D / 64 + 0.05,
            "fla_fast": 0.8 * D / 64 + 0.04,
            "torch": 9.5 * D / 64,
        }
        bucket = f"T{b['T']}-B{b['B']}-H16-HV16-K{D}-V{D}"
        cases.append((KERNEL, "eager", b, times, f"exact: tuned.json {bucket}", json.dumps(e["config"])))
    long = {"T": 65536, "B": 1, "H": 16, "HV": 16, "K": 128, "V": 128}
    borrowed = "borrowed: tuned.json T16384-B2-H16-HV16-K128-V128 (SEG_CHUNKS 0→128 (1 sequence(s) × 16 value heads)"
    cases.append((KERNEL, "eager", long, {"tuned": 3.1, "default": 5.0, "fla": 4.9, "fla_fast": 4.6}, borrowed, "{}"))
    packed = {"T": 52640, "B": 1, "H": 16, "HV": 16, "K": 128, "V": 128, "N": 16}
    cases.append((KERNEL, "eager", packed, {"tuned": 1.8, "default": 2.9, "fla": 2.6}, "exact: tuned.json T3290", "{}"))
    step = {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 128, "V": 128}
    times = {"tuned": 8.9, "default": 9.3, "fla": 7.1, "fla_fast": 6.6}
    cases.append((f"{KERNEL}_bwd", "fwd+bwd", step, times, "exact: tuned.json T4096-B8", "{}"))
    for B in (1, 32, 256):
        decode = {"T": 1, "B": B, "H": 16, "HV": 16, "K": 128, "V": 128}
        for mode, scale in (("eager", 1.0), ("graph", 0.45)):
            times = {"tuned": scale * (0.02 + 0.0005 * B), "default": scale * (0.021 + 0.0006 * B)}
            times["fla"] = scale * (0.024 + 0.00048 * B)
            src = "exact: tuned.json T1-B32" if B == 32 else "borrowed: tuned.json T1-B32-H16-HV16-K128-V128"
            cases.append(("fused_recurrent_kda", mode, decode, times, src, "{}"))
    for kernel, mode, b, times, source, config in cases:
        fla = min(v for k, v in times.items() if k.startswith("fla"))
        for impl, ms in times.items():
            extra = {"speedup_vs_default": times["default"] / ms, "speedup_vs_fla": fla / ms}
            extra["config"] = config if impl == "tuned" else ""
            rows.append(_bench_row(kernel, impl, mode, b, ms, source, **extra))
    pd.DataFrame(rows).to_csv(run / "bench.csv", index=False)


def _profile(run: Path) -> None:
    rows = []
    shares = {"gate_cumsum": 0.05, "kkt_solve": 0.3, "wu": 0.2, "state_pass": 0.25, "output": 0.2}
    byte_shares = {"gate_cumsum": 0.12, "kkt_solve": 0.15, "wu": 0.25, "state_pass": 0.1, "output": 0.35}
    for D in (64, 128):
        total = 0.5 * D / 64
        for stage, share in [*shares.items(), ("total (whole op)", None)]:
            ms = total * share if share else total * 1.02
            flops = 32768 * 16 * (2 * 64 * (5 * D) + 6 * D * D) * (share or 1.0)
            nbytes = 32768 * 16 * (2 * 4 * D + 2 + 4 * D) * byte_shares.get(stage, 1.15)
            floor = max(nbytes / 4249e9, flops / 700e12) * 1e3
            bound = "memory" if nbytes / 4249e9 >= flops / 700e12 else "compute"
            rows.append(
                {
                    "kernel": KERNEL,
                    "dtype": "bf16",
                    "B": 8,
                    "T": 4096,
                    "H": 16,
                    "HV": 16,
                    "K": D,
                    "V": D,
                    "stage": stage,
                    "median_ms": ms,
                    "min_ms": ms,
                    "iqr_ms": 0.001,
                    "meaningful": True,
                    "share": share if share else math.nan,
                    "flops": flops,
                    "bytes": nbytes,
                    "intensity": flops / nbytes,
                    "gbs": nbytes / (ms * 1e-3) / 1e9,
                    "tflops": flops / (ms * 1e-3) / 1e12,
                    "registers": 168 if share else math.nan,
                    "spills": 0 if share else math.nan,
                    "shared_mem": 65536 if share else math.nan,
                    "floor_ms": floor,
                    "x_floor": ms / floor,
                    "bound": bound,
                    "verdict": f"{ms / floor:.1f}× floor, {bound}-bound",
                    "roof_gbs": 4249.0,
                    "roof_tflops": 700.0,
                    "roof_source": "measured",
                    "config": "{}",
                    "note": "",
                }
            )
    pd.DataFrame(rows).to_csv(run / "profile.csv", index=False)


# One H200 per-launch profile of chunk_kda's training step at B8 T4096 D128 (dtune profile --mode fwd+bwd): dtune's
# launches with their stages and floors (ms), fla's by kernel; the whole op's floor 0.42 ms.
LAUNCHES = {
    "tuned": [
        ("chunk_intra_blocks_kernel", 0.66, "fwd intra (W, U, A_qk, T)", 0.21),
        ("chunk_intra_blocks_kernel", 0.02, "fwd intra (W, U, A_qk, T)", None),
        ("chunk_state_kernel", 0.33, "fwd state + output", 0.12),
        ("chunk_state_kernel", 0.33, "bwd state re-run (S, V_new)", 0.14),
        ("chunk_bwd_state_kernel", 0.68, "bwd reverse state pass", 0.16),
        ("chunk_bwd_dqk_kernel", 5.33, "bwd dq/dk/dv (fused)", 0.55),
        ("chunk_bwd_finish_kernel", 0.02, "bwd finish (dβ)", 0.01),
    ],
    "fla": [
        ("chunk_kda_bwd_kernel_wy_dqkg_fused", 2.10, "", None),
        ("chunk_kda_fwd_kernel_intra_sub_chunk", 1.10, "", None),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 0.88, "", None),
        ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", 0.50, "", None),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>", 0.02, "", None),
    ],
}


def _launches(run: Path) -> None:
    rows = []
    ident = {"kernel": KERNEL, "mode": "fwd+bwd", "dtype": "bf16", "B": 8, "T": 4096, "H": 16, "HV": 16, "K": 128}
    ident |= {"V": 128, "N": 8, "meaningful": True, "roof_gbs": 4249.0, "roof_tflops": 700.0}
    for impl, launches in LAUNCHES.items():
        total = sum(ms for _, ms, _, _ in launches)
        for i, (name, ms, stage, floor) in enumerate(launches, start=1):
            x = {"stage_ms": ms, "floor_ms": floor, "x_floor": ms / floor} if floor else {}
            rows.append({**ident, "impl": impl, "position": i, "launch": name, "count": 1.0, "ms": ms,
                         "share": ms / total, "stage": stage, **x})  # fmt: skip
        call = total * 1.01
        rows.append({**ident, "impl": impl, "position": 0, "launch": "(whole call)", "count": float(len(launches)),
                     "ms": call, "floor_ms": 0.42, "x_floor": call / 0.42, "bound": "memory"})  # fmt: skip
    pd.DataFrame(rows).to_csv(run / "launches.csv", index=False)
