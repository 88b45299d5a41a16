"""Leave-one-out check of the lookup for shapes nobody tuned: hide each shipped bucket, time the config the lookup
then builds (dtune.borrow: the nearest buckets, adjusted to the shape) against the bucket's own tuned config and
flash-linear-attention's fastest mode, side by side. Tables printed last.

Usage (one CUDA GPU, from the checkout's root):
    python benchmarks/leave_one_out.py [--budget-s 480] [--kernels forward] [-j 14] [--rounds 3]
    python benchmarks/leave_one_out.py --interpret          (CPU, Triton's interpreter, tiny shapes: a dry run)

For every entry of the tuned-config file (default: the shipped dtune/configs/h200.json; --kernels picks which: the
forward kernels, chunk and fused-recurrent, by default; ``all`` adds the chunk backward, whose one bucket per kernel
falls back to the default when hidden), at the bucket's own shape (B sequences of T tokens; the packed buckets as
the packed batch of the benchmark of record, 16 prompts of 52640 tokens), bf16, the default workload (initial and
final state):

* own: the bucket's tuned config, as the ops run it today;
* lookup: the config the lookup builds with that bucket hidden (``TunedConfigs.without(...).choose(...)``), and
  where it came from (``borrowed: BUCKET (changes)``, or the default when nothing of that kernel is left);
* fla: fla's fastest mode on the same inputs (chunk_kda: the better of its default and ``safe_gate=True,
  lower_bound=-5``), where fla is installed.

Timed as ``dtune bench`` and the search time them (dtune.measure.harness.op_run: the op's default call with
``check_gate=False``; dtune.measure.timing.time_call: CUDA events with the L2 flushed, graph replays at T = 1),
interleaved over --rounds rounds, the median of the rounds' medians; dtune's outputs checked against the float64
chunked reference (relative RMS, ``err_own``, ``err_lookup``). Targets: lookup / own median <= 1.10, worst <= 1.25, and
never slower than fla.

Compiles are the cost (cold, a chunk config's kernels take ~10-20 s each on one core): the distinct (kernel, shape,
config) calls (37 for the default kernels of the shipped file; 15 of its 26 buckets get their own config back) are
first compiled without launching in -j child processes, which also run fla once per shape (its compiles and
autotuning, which fla caches on disk); Triton's on-disk cache then serves the timing. Expected on one H200 with 16
cores, cold caches, the default kernels: ~3-4 min of compiles, ~2 min of timing, under 7 min in all (the backward
adds ~2 min). A bucket not reached within --budget-s keeps its row, marked.

Writes under $OUT (default ./out): ``leave_one_out.csv`` (one row per bucket), ``leave_one_out.json`` (the summary);
prints the table and the summary last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from dtune.kernels import get_kernel  # noqa: E402

from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload  # noqa: E402
from dtune.shape import Gate, Shape  # noqa: E402
from dtune.store import Entry, TunedConfigs, read_configs  # noqa: E402

SHIPPED = ROOT / "dtune" / "configs" / "h200.json"
# The packed batch of the benchmark of record (scripts/h200_tune.sh, PACKED): 16 prompts, 52640 tokens; the packed
# buckets (B = 16 sequences, T = 3290 tokens on average) were tuned on it.
PACKED = (1024, 4096, 2048, 6144, 512, 3072, 8192, 1536, 2560, 4608, 896, 5632, 3584, 1280, 3328, 4128)
TARGET_MEDIAN, TARGET_WORST = 1.10, 1.25
COLUMNS = [
    "kernel", "bucket", "shape", "lookup_from", "changes", "own_ms", "lookup_ms", "lookup_vs_own", "fla_ms", "fla_impl",
    "fla_vs_lookup", "err_own", "err_lookup", "status",
]  # fmt: skip


@dataclass
class Case:
    """One hidden bucket: the shape it is timed at, its own config and the one the lookup builds without it."""

    kernel: str
    bucket: dict[str, int]
    shape: Shape  # the bucket's shape (the lookup's key)
    workload: Workload
    own: dict[str, Any]  # full configs
    lookup: dict[str, Any]
    lookup_from: str  # Choice.describe(), or "default (...)"
    changes: str
    row: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        b = self.bucket
        return f"T{b['T']}-B{b['B']}" + ("" if b["HV"] == b["H"] else f"-HV{b['HV']}") + f"-D{b['K']}"


def bucket_call(kernel: str, b: dict[str, int]) -> tuple[Shape, Workload]:
    """The call a bucket stands for: B sequences of T tokens, or the benchmark of record's packed batch."""
    gate = Gate(get_kernel(kernel).gate)
    shape = Shape(b["B"], b["T"], b["H"], b["HV"], b["K"], b["V"], b["B"], gate)
    if b["B"] == len(PACKED) and b["T"] == sum(PACKED) // len(PACKED):
        workload = replace(DEFAULT_WORKLOAD, seq_lens=PACKED)
        return workload.shape(shape), workload
    return shape, DEFAULT_WORKLOAD


def cases(table: TunedConfigs, kernels: list[str]) -> list[Case]:
    """One case per entry of ``kernels`` (in the file's order, forward chunk kernels first)."""
    out = []
    order = {k: i for i, k in enumerate(kernels)}
    for e in sorted((e for e in table.entries if e.kernel in order), key=lambda e: order[e.kernel]):
        out.append(case_of(table, e))
    return out


def case_of(table: TunedConfigs, e: Entry) -> Case:
    spec = get_kernel(e.kernel)
    shape, workload = bucket_call(e.kernel, e.bucket)
    b = e.bucket
    choice = table.without(e.kernel, e.dtype, b).choose(e.kernel, e.dtype, shape)
    own = spec.check_config(b["K"], b["V"], e.config)
    if choice is None:
        lookup, where, changes = spec.default_config(b["K"], b["V"]), "default (nothing else tuned)", ""
    else:
        lookup, where = spec.check_config(b["K"], b["V"], choice.config), choice.describe()
        changes = "; ".join(str(c) for c in choice.changes)
    return Case(e.kernel, dict(b), shape, workload, own, lookup, where, changes)


def select(kernels: str) -> list[str]:
    """``forward`` (chunk, then fused-recurrent), ``all`` (and the chunk backward), or a comma-separated list."""
    forward = [f"chunk_{op}" for op in ("delta_rule", "gated_delta_rule", "kda")]
    forward += [f"fused_recurrent_{op}" for op in ("delta_rule", "gated_delta_rule", "kda")]
    if kernels == "forward":
        return forward
    if kernels == "all":
        return forward + [f"chunk_{op}_bwd" for op in ("delta_rule", "gated_delta_rule", "kda")]
    names = [k.strip() for k in kernels.split(",") if k.strip()]
    for k in names:
        get_kernel(k)  # ValueError naming it
    return names


def tiny(case: Case) -> Case:
    """The same configs at a shape the interpreter runs in seconds (fp32; the configs are the real bucket's)."""
    b = case.bucket
    ratio = b["HV"] // b["H"]
    T = 1 if b["T"] == 1 else 37
    shape = Shape(2, T, 2, 2 * ratio, 16, 16, 2, case.shape.gate)
    workload = DEFAULT_WORKLOAD
    if case.workload.seq_lens is not None:
        workload = replace(DEFAULT_WORKLOAD, seq_lens=(5, 17, 40))
        shape = workload.shape(shape)
    return replace(case, shape=shape, workload=workload, row={})


# ---- warm-up: compile in child processes ----------------------------------------------------------------------------


def jobs_of(all_cases: list[Case]) -> list[dict[str, Any]]:
    """The distinct (kernel, shape, workload, config) calls to compile."""
    seen: set[str] = set()
    out = []
    for c in all_cases:
        for cfg in (c.own, c.lookup):
            job: dict[str, Any] = {"kernel": c.kernel, "config": cfg, "seq_lens": list(c.workload.seq_lens or ())}
            job["shape"] = c.shape.as_dict() | {"N": c.shape.N, "varlen": c.shape.varlen}
            key = json.dumps(job, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(job)
    return out


def warm_worker(path: Path, index: int, count: int, interpret: bool) -> None:
    """(Child process.) Compile every ``count``-th job of the file without launching; ``fla:KERNEL`` jobs run fla's
    fastest mode once per shape instead (compiles and autotuning)."""
    from dtune.measure.baselines import build_impls
    from dtune.measure.harness import op_run
    from dtune.tune.trials import compile_without_launch

    jobs = json.loads(path.read_text())[index::count]
    dtype, device = (torch.float32, "cpu") if interpret else (torch.bfloat16, "cuda")
    t0 = time.monotonic()
    for job in jobs:
        shape = Shape.from_dict(job["shape"], get_kernel(job["kernel"]).gate)
        workload = replace(DEFAULT_WORKLOAD, seq_lens=tuple(job["seq_lens"]) or None)
        run = None
        try:
            run = op_run(job["kernel"], shape, dtype, device, workload)
            if job.get("fla"):
                impls, _ = build_impls(job["kernel"], ["fla"], None, "", device == "cuda")
                for impl in impls[1:]:
                    impl.make(run.inputs)()
            else:
                with compile_without_launch():
                    run.call(job["config"])()
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # the timing step reports it again, with its row
            print(f"warm {job['kernel']} {shape.key}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        del run
    print(f"warm worker {index}: {len(jobs)} job(s) in {time.monotonic() - t0:.0f} s", flush=True)


def start_warm(all_cases: list[Case], procs: int, interpret: bool, tmp: Path) -> list[subprocess.Popen[bytes]]:
    """``procs`` child processes, each compiling every ``procs``-th of the distinct calls and running fla on every
    ``procs``-th shape (fla caches its autotuning on disk, ``FLA_CACHE_RESULTS``: the timing process finds it)."""
    jobs = jobs_of(all_cases)
    fla_jobs = []
    if not interpret:
        seen: set[str] = set()
        for c in all_cases:
            key = f"{c.kernel} {c.shape.key} {c.workload.seq_lens}"
            if key not in seen:
                seen.add(key)
                fla_jobs.append({**jobs_of([c])[0], "fla": True})
    (tmp / "jobs.json").write_text(json.dumps(jobs + fla_jobs))
    print(f"compiling {len(jobs)} distinct calls and fla on {len(fla_jobs)} shapes in {procs} processes", flush=True)
    extra = ["--interpret"] if interpret else []
    cmd = [sys.executable, __file__, *extra, "--warm-worker"]
    return [subprocess.Popen([*cmd, f"{tmp / 'jobs.json'}:{i}:{procs}"], cwd=ROOT) for i in range(procs)]


def wait_warm(procs: list[subprocess.Popen[bytes]], seconds: float) -> None:
    end = time.monotonic() + max(0.0, seconds)
    for proc in procs:
        try:
            proc.wait(timeout=None if math.isinf(end) else max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"warm-up process {proc.pid} still running: stopped (its compiles so far stay cached)", flush=True)
            proc.kill()
            proc.wait()


# ---- timing ---------------------------------------------------------------------------------------------------------


def measure(case: Case, rounds: int, interpret: bool, errors: bool) -> dict[str, Any]:
    """Time own, lookup and fla side by side on the same inputs (interleaved rounds); check dtune's outputs."""
    from dtune.kernels.reference import chunk_reference

    from dtune.measure.baselines import build_impls
    from dtune.measure.error import rel_rms_error
    from dtune.measure.harness import op_run
    from dtune.measure.timing import time_call, timing_mode

    dtype, device = (torch.float32, "cpu") if interpret else (torch.bfloat16, "cuda")
    run = op_run(case.kernel, case.shape, dtype, device, case.workload)
    same = case.lookup == case.own
    calls: dict[str, Any] = {"own": run.call(case.own)}
    if not same:
        calls["lookup"] = run.call(case.lookup)
    impls = [] if interpret else build_impls(case.kernel, ["fla"], None, "", True)[0][1:]  # fla needs CUDA
    for impl in impls:
        try:
            calls[impl.name] = impl.make(run.inputs)
            calls[impl.name]()
        except Exception as exc:  # fla refusing a shape keeps the row: no fla time
            print(f"{case.kernel} {case.label}: {impl.name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            calls.pop(impl.name)
    row: dict[str, Any] = {}
    if errors and not get_kernel(case.kernel).backward:
        x = run.inputs
        ref, _ = chunk_reference(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], False, x["cu_seqlens"],
            dtype=torch.float64,
        )  # fmt: skip
        row["err_own"] = rel_rms_error(calls["own"]()[0], ref)
        row["err_lookup"] = rel_rms_error(calls["lookup"]()[0], ref) if not same else row["err_own"]
        del ref
    mode = timing_mode("auto", run.shape.T)
    extra = {"warmup": 1, "repeats": 2} if interpret else {}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(time_call(call, device, mode, **extra).median_ms)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    own_ms = med["own"]
    lookup_ms = med.get("lookup", own_ms)
    fla = {n: v for n, v in med.items() if n.startswith("fla")}
    fla_impl = min(fla, key=fla.__getitem__) if fla else ""
    row |= {
        "own_ms": own_ms,
        "lookup_ms": lookup_ms,
        "lookup_vs_own": lookup_ms / own_ms,
        "fla_ms": fla.get(fla_impl, math.nan),
        "fla_impl": fla_impl,
        "fla_vs_lookup": fla[fla_impl] / lookup_ms if fla else math.nan,
        "status": "same config" if same else "timed",
    }
    del run, calls
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst lookup / own, how many are slower than fla, and whether the targets hold."""
    timed = [r for r in rows if isinstance(r.get("lookup_vs_own"), float) and math.isfinite(r["lookup_vs_own"])]
    if not timed:
        return {"buckets": len(rows), "timed": 0}
    ratios = [r["lookup_vs_own"] for r in timed]
    worst = max(timed, key=lambda r: r["lookup_vs_own"])
    vs_fla = [r for r in timed if isinstance(r.get("fla_vs_lookup"), float) and math.isfinite(r["fla_vs_lookup"])]
    slower = [f"{r['kernel']} {r['bucket']}" for r in vs_fla if r["fla_vs_lookup"] < 1.0]
    median = statistics.median(ratios)
    errs = [r["err_lookup"] for r in timed if isinstance(r.get("err_lookup"), float) and math.isfinite(r["err_lookup"])]
    return {
        "buckets": len(rows),
        "timed": len(timed),
        "median_lookup_vs_own": median,
        "worst_lookup_vs_own": worst["lookup_vs_own"],
        "worst": f"{worst['kernel']} {worst['bucket']}",
        "with_fla": len(vs_fla),
        "slower_than_fla": slower,
        "max_err_lookup": max(errs) if errs else None,
        "targets": {
            f"median <= {TARGET_MEDIAN}": median <= TARGET_MEDIAN,
            f"worst <= {TARGET_WORST}": worst["lookup_vs_own"] <= TARGET_WORST,
            "never slower than fla": (not slower) if vs_fla else None,
        },
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["kernel", "bucket", "own_ms", "lookup_ms", "lookup_vs_own", "fla_ms", "fla_vs_lookup", "status"]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.4g}"
        return str(v if v is not None else "")

    width = {c: max(len(c), *(len(cell(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(cell(r.get(c)).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def summary_text(s: dict[str, Any]) -> str:
    if not s.get("timed"):
        return f"{s['buckets']} bucket(s), none timed"
    marks = ", ".join(f"{k} {'n/a' if v is None else 'yes' if v else 'NO'}" for k, v in s["targets"].items())
    fla = f"slower than fla on {len(s['slower_than_fla'])} of {s['with_fla']}" if s["with_fla"] else "no fla times"
    err = f"; largest lookup error {s['max_err_lookup']:.2e} (rel. RMS vs float64)" if s.get("max_err_lookup") else ""
    return (
        f"{s['timed']} of {s['buckets']} buckets timed: lookup / own median {s['median_lookup_vs_own']:.3f}x, worst "
        f"{s['worst_lookup_vs_own']:.3f}x ({s['worst']}); {fla}{err}; targets: {marks}"
    )


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write(rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Everything so far (rewritten after each bucket: a run cut short keeps what it measured)."""
    import csv

    with (out_dir() / "leave_one_out.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out_dir() / "leave_one_out.json").write_text(json.dumps(info, indent=2, default=str) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, default=SHIPPED, help="tuned-config file (default: the shipped H200 one)")
    ap.add_argument("--kernels", default="forward", help="forward (default), all (with the backward), or a list")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="compiles and timing together (default 480; none with --interpret)"
    )
    ap.add_argument("-j", "--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)), help="compile procs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per bucket")
    ap.add_argument("--no-errors", action="store_true", help="skip the float64 reference check of dtune's outputs")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    ap.add_argument("--warm-worker", help=argparse.SUPPRESS)  # child process: FILE:INDEX:COUNT
    a = ap.parse_args()
    if a.warm_worker:
        path, index, count = a.warm_worker.rsplit(":", 2)
        warm_worker(Path(path), int(index), int(count), a.interpret)
        return
    if not a.interpret and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --interpret for a dry run on the CPU)")
    t0 = time.monotonic()
    end = t0 + (a.budget_s if a.budget_s is not None else math.inf if a.interpret else 480.0)
    table_ = read_configs(a.configs)
    all_cases = cases(table_, select(a.kernels))
    if a.interpret:
        all_cases = [tiny(c) for c in all_cases]
    print(f"{len(all_cases)} bucket(s) of {a.configs.name} ({table_.gpu}), OUT={out_dir()}", flush=True)
    rows: list[dict[str, Any]] = []
    path = a.configs.resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path  # no machine's checkout path in the record
    info: dict[str, Any] = {"configs": str(shown), "gpu": table_.gpu, "kernels": a.kernels}
    with tempfile.TemporaryDirectory(prefix="dtune_loo_") as tmp:
        warming = start_warm(all_cases, 1 if a.interpret else a.jobs, a.interpret, Path(tmp))
        # timing wants a quiet GPU: wait for the compiles, leaving ~4 s a bucket for the timing itself
        wait_warm(warming, end - time.monotonic() - 4.0 * len(all_cases))
        info["compile_s"] = round(time.monotonic() - t0, 1)
        for c in all_cases:
            row = {"kernel": c.kernel, "bucket": c.label, "shape": c.shape.key, "lookup_from": c.lookup_from}
            row["changes"] = c.changes
            if time.monotonic() > end:
                row["status"] = "not reached (--budget-s)"
            else:
                try:
                    row |= measure(c, 1 if a.interpret else a.rounds, a.interpret, not a.no_errors)
                except Exception as exc:
                    row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                if torch.cuda.is_available() and not a.interpret:
                    torch.cuda.empty_cache()
            rows.append(row)
            info["summary"] = summary(rows)
            info["run_s"] = round(time.monotonic() - t0, 1)
            write(rows, info)
    print("\n" + table(rows), flush=True)
    print("\n" + summary_text(info["summary"]) + f" ({info['run_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
