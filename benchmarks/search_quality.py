"""How good is each search strategy? From the template's default alone (--no-seeds), per kernel and strategy: the best
config so far against wall time and against completed (gated and timed) trials, next to the best config known for
the shape.

Usage (one GPU, from the checkout's root; ~8 minutes with the defaults):
    python benchmarks/search_quality.py [--kernels chunk_kda,chunk_gated_delta_rule,chunk_delta_rule]
        [--strategies pattern,tpe,random] [--budget 40] [--compile-ahead 14] [--devices 0] [--deadline UNIX_TIME]
    python benchmarks/search_quality.py --interpret     # the same steps on tiny shapes on the CPU (times mean nothing)

Shape: D = 128, T = 4096, B·T = 32768 (B = 8), H = 16, bf16 (--head-dim, --seq-len, --batch-tokens, --heads,
--dtype). Each (kernel, strategy) gets --budget seconds (shrunk to fit before --deadline) and a Triton cache of its
own (every run pays its compiles; --shared-cache turns that off). The best known config of a kernel is the fastest
of: the shipped tuned config for this GPU and shape, timed here with the trials' harness (unless --no-shipped), and
every run's best; the table says which. Written under $OUT (default ./out) after every run: search_quality.csv (one
row per completed trial: elapsed seconds, best so far, its ratio to the best known), search_quality_summary.csv, the
run folders (runs/<kernel>-<strategy>/); the table is printed last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import pandas as pd

WITHIN = 0.03  # "within 3% of the best known config"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="chunk_kda,chunk_gated_delta_rule,chunk_delta_rule")
    ap.add_argument("--strategies", default="pattern,tpe,random", help="of pattern, tpe, cmaes, random, grid")
    ap.add_argument("--budget", type=float, default=None, help="seconds per (kernel, strategy); default 40 (6 interp.)")
    ap.add_argument("--compile-ahead", type=int, default=None, help="default: CPU cores - 2, at most 14")
    ap.add_argument("--devices", default=None, help="GPUs timing trials, e.g. 0,1 (default: one)")
    ap.add_argument("--deadline", type=float, default=0.0, help="Unix time: budgets shrink to end 30 s before it")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--no-shipped", action="store_true", help="do not time the shipped config")
    ap.add_argument(
        "--known-config", type=Path, default=None, help="config file of the best known configs (default: the shipped)"
    )
    ap.add_argument(
        "--shared-cache", action="store_true", help="one Triton cache for all runs (later runs compile less)"
    )
    ap.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    ap.add_argument(
        "--transfer-seq-len",
        type=int,
        default=None,
        help="also tune this sequence length (B = batch-tokens / T) with the pattern strategy twice: cold (from the "
        "default) and seeded by the pattern run above (--transfer-from): rows 'cold@T...' and 'transfer@T...'",
    )
    return ap.parse_args()


def shipped_time(kernel: str, shape: Any, dtype: str, gpu: str, path: Path | None = None) -> tuple[float, str] | None:
    """The shipped config's time on ``shape`` with the trials' harness (CUDA events, L2 flushed, median), or None."""
    from dtune.kernels import get_kernel

    from dtune.inputs import dtype_from_name
    from dtune.measure.harness import op_run
    from dtune.measure.timing import time_call
    from dtune.store import ConfigFileError, read_configs

    path = path or Path(__file__).resolve().parents[1] / "dtune" / "configs" / f"{gpu}.json"
    try:
        entry = read_configs(path, gpu).nearest(kernel, dtype, shape)
    except ConfigFileError:
        return None
    if entry is None:
        return None
    run = op_run(kernel, shape, dtype_from_name(dtype), "cuda")
    config = get_kernel(kernel).check_config(shape.K, shape.V, entry.config)
    timing = time_call(run.call(config), "cuda")
    b = entry.bucket
    return timing.median_ms, f"{path.name} (bucket T{b['T']}-B{b['B']}, timed here)"


def builds(run_dir: Path) -> dict[str, float]:
    """Kernels compiled per trial: ahead (the pool) for stage-local and whole trials, and in the timing worker."""
    trials = pd.read_csv(run_dir / "trials.csv")
    ran = trials[trials["state"] != "pruned"]
    stage, whole = ran[ran["kind"] == "stage"], ran[ran["kind"] == "whole"]
    return {
        "built_ahead_per_stage_trial": stage["built_ahead"].mean() if len(stage) else math.nan,
        "built_ahead_per_whole_trial": whole["built_ahead"].mean() if len(whole) else math.nan,
        "built_in_timing_worker": ran["built"].sum(),
    }


def curve(run_dir: Path, t0: float) -> pd.DataFrame:
    """Completed trials of one run in order of completion, with the best whole time so far."""
    trials = pd.read_csv(run_dir / "trials.csv")
    done = trials[trials["state"] == "complete"].copy()
    start = pd.to_datetime(done["datetime_start"]).map(lambda d: d.timestamp())
    done["elapsed_s"] = start + done["duration_s"].fillna(0) - t0
    done = done.sort_values("elapsed_s").reset_index(drop=True)
    done["completed"] = range(1, len(done) + 1)
    whole = done["time_ms"].where(done["kind"] == "whole")
    done["best_so_far_ms"] = whole.cummin().ffill()
    return done[["number", "kind", "completed", "elapsed_s", "time_ms", "best_so_far_ms"]]


def main() -> None:
    a = parse()
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    from dtune.gpu import resolve_gpu
    from dtune.measure.inputs import DEFAULT_WORKLOAD
    from dtune.shape import Shape
    from dtune.tune.search import SearchConfig, run_search
    from dtune.tune.space import load_space

    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    D = a.head_dim or (16 if a.interpret else 128)
    T = a.seq_len or (9 if a.interpret else 4096)
    H = a.heads or (1 if a.interpret else 16)
    B = 1 if a.interpret else max(1, a.batch_tokens // T)
    dtype = a.dtype or ("fp32" if a.interpret else "bf16")
    budget = a.budget or (6.0 if a.interpret else 40.0)
    ca = a.compile_ahead if a.compile_ahead is not None else (0 if a.interpret else min(14, (os.cpu_count() or 4) - 2))
    devices = tuple(d for d in (a.devices or "").split(",") if d)
    gpu = resolve_gpu("auto", interpret=a.interpret)
    kernels, strategies = a.kernels.split(","), a.strategies.split(",")
    shape = Shape(B, T, H, H, D, D)
    print(f"search quality: {', '.join(kernels)} x {', '.join(strategies)} at {shape.key} {dtype} on {gpu.key}, "
          f"{budget:g} s each, compile-ahead {ca}" + (" [interpreter]" if a.interpret else ""), flush=True)  # fmt: skip

    known: dict[str, tuple[float, str, str]] = {}  # kernel: (ms, what, shape key)
    if not a.no_shipped and not a.interpret:
        for k in kernels:
            got = shipped_time(k, shape, dtype, gpu.key, a.known_config)
            if got is not None:
                known[k] = (*got, shape.key)
                print(f"  {k}: {got[1]}: {got[0]:.4g} ms", flush=True)

    rows: list[dict[str, Any]] = []
    curves: list[pd.DataFrame] = []
    todo: list[tuple[str, str, Any, tuple[Path, ...]]] = [(k, s, shape, ()) for k in kernels for s in strategies]
    if a.transfer_seq_len:
        T2 = a.transfer_seq_len
        other = Shape(max(1, a.batch_tokens // T2) if not a.interpret else 1, T2, H, H, D, D)
        for k in kernels:
            todo.append((k, f"cold@T{T2}", other, ()))
            todo.append((k, f"transfer@T{T2}", other, (out / "runs" / f"{k}-pattern",)))
    for i, (k, label, where, donors) in enumerate(todo):
        strategy = label if "@" not in label else "pattern"
        donors = tuple(d for d in donors if (d / "run.json").exists())
        this = budget
        if a.deadline:
            this = min(budget, (a.deadline - time.time() - 30) / (len(todo) - i))
            if this < 5:
                print(f"  {k} {strategy}: skipped (the deadline leaves {this:.0f} s a run)", flush=True)
                continue
        run_dir = out / "runs" / f"{k}-{label}"
        if not a.shared_cache:
            # outside $OUT: a device command returns $OUT, and Triton caches would swell it past what comes back
            cache_root = Path(os.environ.get("DTUNE_SQ_CACHE", tempfile.gettempdir())) / "dtune_sq_cache"
            os.environ["TRITON_CACHE_DIR"] = str(cache_root / f"{k}-{label}")
        cfg = SearchConfig(
            kernel=k, gpu=gpu, space=load_space(k), shapes=[where], out=run_dir, dtype=dtype, timeout=this,
            strategy=strategy, seeds=False, interpret=a.interpret, compile_ahead=ca, devices=devices,
            workload=DEFAULT_WORKLOAD, resume=False, transfer_from=donors,
        )  # fmt: skip
        if (run_dir / "study.db").exists():
            (run_dir / "study.db").unlink()  # a fresh study: this measures the search, not a resumed one
        t0 = time.time()
        summary = run_search(cfg)
        c = curve(run_dir, t0)
        c.insert(0, "strategy", label)
        c.insert(0, "kernel", k)
        curves.append(c)
        s = summary.shapes[0]
        rows.append(
            {
                "kernel": k, "strategy": label, "shape": where.key, "budget_s": round(this, 1),
                "trials": s.trials_run, "completed": s.completed_run,
                "completed_per_min": round(s.completed_per_min, 1),
                "best_ms": s.best_ms, "default_ms": s.default_ms, "model_hit_rate": s.model_hit_rate,
                "failures": s.failures, **builds(run_dir),
                "trials_to_own_best": int(c.loc[c["best_so_far_ms"] <= (s.best_ms or 0) * 1.0001, "completed"].min())
                if s.best_ms else None,
            }
        )  # fmt: skip
        print(f"  {k} {label}: best {s.best_ms} ms, {s.completed_run} completed ({s.completed_per_min:.1f}/min)",
              flush=True)  # fmt: skip
        write(out, rows, curves, known)
    table(write(out, rows, curves, known))


def write(
    out: Path, rows: list[dict[str, Any]], curves: list[pd.DataFrame], known: dict[str, tuple[float, str, str]]
) -> pd.DataFrame:
    """Both CSVs, with the best known config per kernel (the shipped config's time or the best run)."""
    summary = pd.DataFrame(rows)
    allc = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame()
    shape_of = {(r["kernel"], r["strategy"]): r["shape"] for r in rows}
    best: dict[tuple[str, str], tuple[float, str]] = {(k, v[2]): (v[0], v[1]) for k, v in known.items()}
    for r in rows:
        key = (r["kernel"], r["shape"])
        if r["best_ms"] is not None and (key not in best or r["best_ms"] < best[key][0]):
            best[key] = (r["best_ms"], f"best of this script's runs ({r['strategy']})")

    def known_of(kernel: str, strategy: str) -> tuple[float, str]:
        return best.get((kernel, shape_of.get((kernel, strategy), "")), (math.nan, "-"))

    if not allc.empty:
        allc["best_known_ms"] = [known_of(k, s)[0] for k, s in zip(allc["kernel"], allc["strategy"])]
        allc["ratio"] = allc["best_so_far_ms"] / allc["best_known_ms"]
        allc.to_csv(out / "search_quality.csv", index=False)
    if not summary.empty:
        summary["best_known_ms"] = [known_of(k, s)[0] for k, s in zip(summary["kernel"], summary["strategy"])]
        summary["best_known"] = [known_of(k, s)[1] for k, s in zip(summary["kernel"], summary["strategy"])]
        summary["vs_best_known"] = summary["best_ms"] / summary["best_known_ms"]
        reach_s, reach_n = [], []
        for _, r in summary.iterrows():
            c = allc[(allc["kernel"] == r["kernel"]) & (allc["strategy"] == r["strategy"])]
            hit = c[c["ratio"] <= 1 + WITHIN]
            reach_s.append(hit["elapsed_s"].iloc[0] if len(hit) else math.nan)
            reach_n.append(hit["completed"].iloc[0] if len(hit) else math.nan)
        summary["s_to_3pct"], summary["trials_to_3pct"] = reach_s, reach_n
        summary.to_csv(out / "search_quality_summary.csv", index=False)
    return summary


def table(summary: pd.DataFrame) -> None:
    if summary.empty:
        print("no runs")
        return
    print()
    head = f"{'kernel':<24}{'strategy':<16}{'done':>5}{'/min':>6}{'best ms':>9}{'x known':>8}{'s to 3%':>8}"
    print(head + f"{'n to 3%':>8}{'n best':>7}{'model':>6}{'built':>6}  best known")
    for _, r in summary.iterrows():
        hit = r["model_hit_rate"]
        built = r["built_ahead_per_stage_trial"]
        print(
            f"{r['kernel']:<24}{r['strategy']:<16}{r['completed']:>5}{r['completed_per_min']:>6.1f}"
            f"{(r['best_ms'] or math.nan):>9.4g}{r['vs_best_known']:>8.3f}{r['s_to_3pct']:>8.0f}"
            f"{r['trials_to_3pct']:>8.0f}{r['trials_to_own_best'] or math.nan:>7.0f}"
            f"{'' if hit is None or hit != hit else f'{100 * hit:.0f}%':>6}{built:>6.1f}  "
            f"{r['best_known_ms']:.4g} ms, {r['best_known']}"
        )
    print(
        "done: completed (gated and timed) trials; n to 3%: completed trials until within 3% of the best known; "
        "n best: until the run's own best; built: kernels compiled ahead per stage-local trial"
    )


if __name__ == "__main__":
    main()
