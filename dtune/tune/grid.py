"""``dtune tune-gpu``: tune every kernel's default buckets on the GPU present, then export, bench and report.

The plan (:func:`make_plan`) comes from each kernel's search space (``[shapes]``, the grid, and ``[tune]``,
:class:`dtune.tune.space.TuneSpec`): per kernel, a search of its **anchor** bucket on ``anchor_share`` of the job's
budget, then one search of the other buckets, nearest to the anchor first (the grid, then long prompts and grouped
value heads at the anchor's head dim), then one of the packed batch, each bucket on ``bucket_share`` of the budget.
Every search starts from the shipped configs of every GPU and from the winners of all the kernel's searches before
it (``--transfer-from`` each earlier run folder; within a search, its own earlier buckets): a new GPU starts from
what other GPUs found, and each bucket from its nearest tuned neighbours (:mod:`dtune.tune.transfer`). The forward
kernels come first, the backward kernels after them with the freshly tuned forward configs in force (a backward
trial times the training step, whose forward is the store's).

Running it (:func:`run_job`): each search is one run folder under ``OUT/runs/<kernel>/``; a bucket whose search
ended (its budget or trial count spent, not cut short by Ctrl-C) is recorded in ``OUT/tune-gpu.json`` at once, so a
re-run of the same command skips it and an interrupted job loses no finished bucket. After every search the run
folders' winners are merged into ``OUT/<gpu>.json``, over this GPU's shipped file when there is one (a newer entry
replaces the shipped one of its bucket), validated as the ops validate it at run time and written atomically. Then
each kernel's buckets are benched against the installed baselines with that file (``OUT/bench/<kernel>/bench.csv``,
as ``dtune bench`` writes it, shape by shape, each shape's side-by-side times recorded in ``OUT/<gpu>.json`` as it
finishes) and ``OUT/dtune-<gpu>-report.html`` is built from the whole folder (``dtune report``).
With a time limit for the whole job (``timeout``) a search takes only the buckets its budgets fit into what is left,
and a bench that does not fit is skipped: a re-run continues.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from dtune.kernels import get_kernel

from dtune.gpu import GpuProfile
from dtune.shape import Gate, Shape, ShapeGrid, packed_and_grouped
from dtune.tune import models as model_data
from dtune.tune.space import RunCosts, SearchSpace, load_space, shipped_spaces
from dtune.tune.summary import Reporter, ShapeSummary
from dtune.tune.transfer import bucket_distance

PROGRESS_JSON = "tune-gpu.json"  # the finished buckets and benches of the job in OUT
RUNS = "runs"
BENCH = "bench"
DEFAULT_BUDGET_S = 90.0  # a chunk kernel's anchor search; every other bucket gets its space's share of it
# What a search costs beyond its buckets' budgets: each space's [tune] costs (dtune.tune.space.RunCosts).
# What a bench costs a shape on the H200 (3 rounds, fla's first call autotunes): a forward 10-20 s with fla, a
# packed batch 50-140 s (fla's variable-length autotuning), a training step about a minute.
BENCH_SHAPE_S = 10.0
BENCH_PACKED_S = 60.0
BENCH_STEP_S = 60.0
# Failure reasons that say nothing about whether a config of the bucket passes: a bucket whose search ended with only
# these and no passing config is searched again on the next run.
# A bucket's winner more than this many times slower than its shipped entry keeps the shipped entry (export.supersede).
KEEP_SHIPPED_X = 1.5
UNTRIED = ("cancelled", "interrupted", "claimed", "constraint", "predicted")
# Under Triton's interpreter the plan's shapes shrink to these (sequence lengths below, at and above the anchor's).
TINY_T = (5, 9, 20)
TINY_D = 16
TINY_PACKED = (3, 9, 5)


@dataclass(frozen=True)
class Bucket:
    """One tuned-config bucket of one kernel: a shape, and for a packed batch the sequence lengths (cu_seqlens)."""

    kernel: str
    shape: Shape
    packed: tuple[int, ...] | None = None

    @property
    def key(self) -> str:
        """The job's name of the bucket, e.g. ``chunk_kda:T4096-B8-H16-HV16-K128-V128`` (``:packed`` for one)."""
        return f"{self.kernel}:{self.shape.key}" + (":packed" if self.packed else "")


@dataclass(frozen=True)
class Step:
    """One search of the plan: buckets of one kernel and workload, each on ``seconds``."""

    kernel: str
    name: str  # anchor, grid or packed
    dtype: str
    buckets: tuple[Bucket, ...]
    seconds: int
    costs: RunCosts = field(default_factory=RunCosts)

    @property
    def packed(self) -> tuple[int, ...] | None:
        return self.buckets[0].packed if self.buckets else None

    def estimate_s(self, n: int | None = None) -> float:
        """Wall time of this search for ``n`` of its buckets (default all): their budgets and the run's costs."""
        n = len(self.buckets) if n is None else n
        return self.costs.run_start_s + n * self.bucket_s if n else 0.0

    @property
    def bucket_s(self) -> float:
        """Wall time of one bucket: its budget (at least its first answers) and its end."""
        return max(float(self.seconds), self.costs.starts_s) + self.costs.bucket_end_s


@dataclass(frozen=True)
class Plan:
    """The searches of a job, in order."""

    steps: tuple[Step, ...]

    @property
    def kernels(self) -> list[str]:
        return list(dict.fromkeys(s.kernel for s in self.steps))

    def buckets(self, kernel: str | None = None) -> list[Bucket]:
        return [b for s in self.steps if kernel in (None, s.kernel) for b in s.buckets]

    def dtype(self, kernel: str) -> str:
        return next(s.dtype for s in self.steps if s.kernel == kernel)

    def tune_s(self, done: Mapping[str, Any] | None = None) -> float:
        """Estimated seconds of the searches still to run (buckets in ``done`` are skipped)."""
        done = done or {}
        return sum(s.estimate_s(sum(b.key not in done for b in s.buckets)) for s in self.steps)

    def bench_s(self, skip: Sequence[str] = ()) -> float:
        """Estimated seconds of the benches of every kernel's buckets on a GPU (kernels in ``skip`` left out)."""
        total = 0.0
        for b in self.buckets():
            if b.kernel in skip:
                continue
            step = get_kernel(b.kernel).backward
            total += BENCH_STEP_S if step else BENCH_PACKED_S if b.packed else BENCH_SHAPE_S
        return total


def default_kernels() -> list[str]:
    """Every kernel with a shipped search space, in the job's order: chunk forward, fused-recurrent, backward."""
    return order_kernels(shipped_spaces())


def order_kernels(kernels: Sequence[str]) -> list[str]:
    """``kernels`` in the job's order: the forward kernels before the backward ones (which time the training step
    with the freshly tuned forward configs), chunk before fused-recurrent; otherwise as given."""

    def rank(k: str) -> tuple[int, int]:
        spec = get_kernel(k)
        return (int(spec.backward), int(spec.family != "chunk"))

    return sorted(dict.fromkeys(kernels), key=rank)


def anchor_shape(space: SearchSpace, grid: Sequence[Shape], gate: Gate) -> Shape:
    """The bucket tuned first: ``[tune] anchor`` (``T``, ``D``, and ``B``, ``H`` if given, else the grid's batch rule
    and first heads), or the grid's middle bucket."""
    a = space.tune.anchor
    if not a:
        return grid[len(grid) // 2]
    H = a.get("H", space.shapes.heads[0] if space.shapes.heads else 16)
    want = {"T": a["T"], "K": a["D"], "V": a["D"], "H": H, "B": a.get("B")}
    for s in grid:
        if {"T": s.T, "K": s.K, "V": s.V, "H": s.H, "B": s.B if "B" in a else None} == want:
            return s
    tokens = space.shapes.batch_tokens
    B = a.get("B") or (max(1, tokens // a["T"]) if tokens else (space.shapes.batch or (1,))[0])
    return Shape(B, a["T"], H, H, a["D"], a["D"], gate=gate)


def tiny(shape: Shape, anchor: Shape) -> Shape:
    """A plan's shape for Triton's interpreter: the sequence length below, at or above the anchor's (T = 1 stays),
    head dims 16, one head (grouped value heads keep their ratio), batch 1 or 2."""
    if shape.T == 1:
        T = 1
    else:
        T = TINY_T[1] if shape.T == anchor.T else TINY_T[0] if shape.T < anchor.T else TINY_T[2]
    B = 1 if shape.B == 1 else 2
    return Shape(B, T, 1, shape.HV // shape.H, TINY_D, TINY_D, gate=shape.gate)


def kernel_steps(space: SearchSpace, dtype: str, budget: float, interpret: bool = False) -> list[Step]:
    """The searches of one kernel: its anchor, the other buckets nearest-first, the packed batch."""
    kernel, spec = space.kernel, space.tune
    gate = Gate(get_kernel(kernel).gate)
    grid = space.shapes.shapes(gate)
    anchor = anchor_shape(space, grid, gate)
    rest = list(grid) if spec.grid else []
    rest += [replace(anchor, T=e.T, B=e.B, N=e.B, HV=anchor.H * e.hv_ratio) for e in spec.extra]
    packed = spec.packed_seqs or None
    if interpret:
        rest = [tiny(s, anchor) for s in rest]
        anchor = tiny(anchor, anchor)
        packed = TINY_PACKED if packed else None
    rest = sorted(dict.fromkeys(s for s in rest if s != anchor), key=lambda s: bucket_distance(s, anchor.bucket()))
    share = max(1, round(budget * spec.bucket_share))
    costs = spec.costs
    anchor_s = max(1, round(budget * spec.anchor_share))
    steps = [Step(kernel, "anchor", dtype, (Bucket(kernel, anchor),), anchor_s, costs)]
    if rest:
        steps.append(Step(kernel, "grid", dtype, tuple(Bucket(kernel, s) for s in rest), share, costs))
    if packed:
        (shape,) = packed_and_grouped([anchor], packed, 1)
        steps.append(Step(kernel, "packed", dtype, (Bucket(kernel, shape, tuple(packed)),), share, costs))
    return steps


def make_plan(
    kernels: Sequence[str], dtypes: Mapping[str, str], budget: float = DEFAULT_BUDGET_S, interpret: bool = False
) -> Plan:
    """The job's searches for ``kernels`` (in :func:`order_kernels`' order), each kernel in ``dtypes[kernel]``, with
    ``budget`` seconds for a share of 1 (ValueError for a non-positive budget or a kernel without a space)."""
    if budget <= 0:
        raise ValueError(f"--budget must be positive, got {budget}")
    steps: list[Step] = []
    for kernel in order_kernels(kernels):
        steps += kernel_steps(load_space(kernel), dtypes[kernel], budget, interpret)
    return Plan(tuple(steps))


def model_kernels(names: Sequence[str], kernels: Sequence[str] | None = None) -> list[str]:
    """The kernels with a search space that the models called ``names`` call (of ``kernels`` if given), in the job's
    order; ValueError for an unknown model, or ``kernels`` that none of them calls."""
    chosen = model_data.load().get(names)
    spaces = set(shipped_spaces())
    called = list(dict.fromkeys(k for m in chosen for k in m.kernels if k in spaces))
    if kernels is not None:
        if not set(kernels) & set(called):
            raise ValueError(
                f"none of {', '.join(kernels)} is called by {', '.join(m.name for m in chosen)} (they call "
                f"{', '.join(called)})"
            )
        called = [k for k in called if k in kernels]
    return order_kernels(called)


def model_plan(
    names: Sequence[str],
    kernels: Sequence[str] | None,
    dtypes: Mapping[str, str],
    budget: float = DEFAULT_BUDGET_S,
    degrees: Sequence[int] | None = None,
    interpret: bool = False,
) -> Plan:
    """The searches of the models called ``names`` (``dtune/models.toml``; ``all``: every one) instead of the
    default grid: per kernel the models call (of ``kernels`` if given), one search per model of its buckets at the
    tensor-parallel ``degrees`` (default the file's), nearest to the kernel's anchor first, then one of its packed
    batch, each bucket on the space's ``bucket_share`` of ``budget``. ValueError for an unknown model or degree, or
    ``kernels`` that none of the models calls."""
    if budget <= 0:
        raise ValueError(f"--budget must be positive, got {budget}")
    data = model_data.load()
    chosen = data.get(names)
    degrees = tuple(degrees) if degrees else data.calls.tensor_parallel  # (a degree that does not divide: shapes())
    steps: list[Step] = []
    for kernel in model_kernels(names, kernels):
        space = load_space(kernel)
        gate = Gate(get_kernel(kernel).gate)
        anchor = anchor_shape(space, space.shapes.shapes(gate), gate)
        share = max(1, round(budget * space.tune.bucket_share))
        for model in chosen:
            if kernel not in model.kernels:
                continue
            shapes, packed = data.shapes(model, kernel, degrees, gate)
            seqs: tuple[int, ...] | None = data.calls.packed_prefill or None
            if interpret:
                shapes = [tiny(s, anchor) for s in shapes]
                ratio = model.v_heads // model.heads
                packed = packed_and_grouped([tiny(anchor, anchor)], TINY_PACKED, ratio) if packed else []
                seqs = TINY_PACKED
            shapes = sorted(dict.fromkeys(shapes), key=lambda s: bucket_distance(s, anchor.bucket()))
            if shapes:
                buckets = tuple(Bucket(kernel, s) for s in shapes)
                steps.append(Step(kernel, model.name, dtypes[kernel], buckets, share, space.tune.costs))
            if packed:
                buckets = tuple(Bucket(kernel, s, seqs) for s in dict.fromkeys(packed))
                steps.append(Step(kernel, f"{model.name}-packed", dtypes[kernel], buckets, share, space.tune.costs))
    return Plan(tuple(steps))


def missing_from(plan: Plan, doc: Mapping[str, Any] | None) -> Plan:
    """``plan`` without the buckets that ``doc`` (a tuned-config document, or None: none) has an entry for, kernel,
    dtype and bucket alike; a step left without buckets is dropped."""
    if doc is None:
        return plan
    have = {(e["kernel"], e["dtype"], json.dumps(e["bucket"], sort_keys=True)) for e in doc.get("entries", [])}
    steps = []
    for s in plan.steps:
        left = tuple(
            b for b in s.buckets if (s.kernel, s.dtype, json.dumps(b.shape.bucket(), sort_keys=True)) not in have
        )
        if left:
            steps.append(replace(s, buckets=left))
    return Plan(tuple(steps))


# ---------------------------------------------------------------------------------------------- the job's record


@dataclass
class Ledger:
    """``OUT/tune-gpu.json``: the buckets whose search ended and the benches done, rewritten after each."""

    path: Path
    gpu: str
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # bucket key -> run folder, best and default ms
    benched: dict[str, int] = field(default_factory=dict)  # kernel -> its buckets done when it was benched
    # one row per run of the job (a re-run after --timeout or Ctrl-C adds one): when it started, its seconds so far,
    # the buckets it finished; what the job took in all is their sum
    runs: list[dict[str, Any]] = field(default_factory=list)
    _t0: float | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, out: Path, gpu: str) -> Ledger:
        """The record in ``out`` (empty if none); ValueError if it is another GPU's or not readable."""
        path = out / PROGRESS_JSON
        if not path.is_file():
            return cls(path, gpu)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            mine = doc["gpu"]
            done, benched = dict(doc["done"]), {str(k): int(v) for k, v in doc.get("benched", {}).items()}
            runs = [dict(r, elapsed_s=float(r["elapsed_s"])) for r in doc.get("runs", [])]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a tune-gpu record ({type(e).__name__}: {e}); use another --out") from None
        if mine != gpu:
            raise ValueError(f"{path} records a job on {mine!r}, not this {gpu!r}: use another --out")
        return cls(path, gpu, done, benched, runs)

    def start_run(self) -> None:
        """A run of the job begins: its row is added (saved with the first finished bucket, or at its end)."""
        self._t0 = time.monotonic()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.runs.append({"started": started, "elapsed_s": 0.0, "buckets": 0})

    def finish(self, key: str, record: dict[str, Any]) -> None:
        """A bucket's search ended: recorded (and counted to the run in progress), then saved."""
        self.done[key] = record
        if self.runs:
            self.runs[-1]["buckets"] += 1
        self.save()

    @property
    def elapsed_s(self) -> float:
        """Seconds of every run of the job so far (the one in progress up to now)."""
        return sum(float(r["elapsed_s"]) for r in self.runs)

    def save(self) -> None:
        if self._t0 is not None and self.runs:
            self.runs[-1]["elapsed_s"] = round(time.monotonic() - self._t0, 1)
        doc = {"schema": 1, "gpu": self.gpu, "done": self.done, "benched": self.benched, "runs": self.runs}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)  # a reader, or a job killed while writing, never sees half a file

    def done_of(self, kernel: str) -> int:
        return sum(k.split(":", 1)[0] == kernel for k in self.done)

    def benched_now(self, out: Path) -> list[str]:
        """Kernels whose bench is in ``out`` and current (no bucket of theirs finished since)."""
        return [k for k, n in self.benched.items() if n == self.done_of(k) and (out / BENCH / k).is_dir()]


# ---------------------------------------------------------------------------------------------------- the run


class JobReporter:
    """What a job tells while it runs (silent here; ``dtune tune-gpu`` draws it with rich)."""

    def search(self, step: Step, buckets: Sequence[Bucket], run_dir: Path) -> Reporter:
        """A search is starting: the progress callbacks for its trials."""
        return Reporter()

    def bucket_done(self, bucket: Bucket, summary: ShapeSummary) -> None:
        pass

    def skipped(self, what: str, why: str) -> None:
        pass

    def exported(self, path: Path, entries: int) -> None:
        pass

    def bench(self, kernel: str, shapes: int) -> None:
        pass

    def benched(self, kernel: str, paths: Sequence[Path]) -> None:
        pass

    def reported(self, path: Path) -> None:
        pass


@dataclass
class Job:
    """Everything one ``dtune tune-gpu`` needs (the CLI builds it from its options)."""

    plan: Plan
    gpu: GpuProfile
    out: Path
    trials: int | None = None  # per bucket, with its budget: whichever ends first
    timeout: float | None = None  # seconds for the whole job
    compile_ahead: int = 0
    devices: tuple[str, ...] = ()
    trial_timeout: float = 120.0
    interpret: bool = False
    bench: bool = True
    baselines: tuple[str, ...] = ("default", "fla")
    rounds: int | None = None

    @property
    def config_file(self) -> Path:
        return self.out / f"{self.gpu.key}.json"

    @property
    def report_file(self) -> Path:
        return self.out / f"dtune-{self.gpu.key}-report.html"


@dataclass
class JobResult:
    tuned: list[Bucket] = field(default_factory=list)  # buckets whose search ended in this run
    left: list[Bucket] = field(default_factory=list)  # buckets not tuned: out of time or interrupted
    no_pass: list[str] = field(default_factory=list)  # bucket keys whose search found no config passing the gate
    entries: int = 0  # in the config file
    bench_dirs: list[Path] = field(default_factory=list)
    report: Path | None = None
    interrupted: bool = False
    elapsed_s: float = 0.0  # this run
    job_elapsed_s: float = 0.0  # every run of the job in its folder, this one included
    runs: int = 1


def run_dirs(out: Path, kernel: str) -> list[Path]:
    """The kernel's run folders of the job so far (each holds run.json), oldest first."""
    root = out / RUNS / kernel
    found = [p.parent for p in root.glob("*/run.json")] if root.is_dir() else []
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name))


def new_run_dir(out: Path, step: Step) -> Path:
    """``OUT/runs/<kernel>/<step>``, or ``<step>-2``, ... when a re-run continues a step."""
    base = out / RUNS / step.kernel / step.name
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{step.name}-{n}")
    return path


def shipped_file(gpu: str) -> Path | None:
    """This GPU's shipped tuned-config file, if dtune ships one."""
    ref = resources.files("dtune.configs").joinpath(f"{gpu}.json")
    return Path(str(ref)) if ref.is_file() else None


def export(job: Job, ledger: Ledger) -> int:
    """Merge the winners of every run folder of the job into ``job.config_file`` (over this GPU's shipped file, whose
    entries of the buckets tuned here are replaced), validated and written atomically; returns its entries (0: none
    passed yet, nothing written)."""
    from dtune.tune.export import build_export, merge_exports, supersede, write_configs

    docs = [build_export(d) for k in job.plan.kernels for d in run_dirs(job.out, k)]
    docs = [d for d in docs if d["entries"]]
    if not docs:
        return 0
    doc = merge_exports(docs)
    base = shipped_file(job.gpu.key)
    if base is not None:
        note = f"dtune tune-gpu {datetime.date.today().isoformat()}: {len(ledger.done)} buckets"
        doc, _ = supersede(json.loads(base.read_text(encoding="utf-8")), [doc], note, max_slowdown=KEEP_SHIPPED_X)
    write_configs(doc, job.config_file, job.gpu.key)
    return len(doc["entries"])


@contextmanager
def configs_in_force(path: Path | None) -> Iterator[None]:
    """``DTUNE_CONFIG`` set to ``path`` inside the block (for trial workers and the store), restored after it."""
    from dtune import store

    if path is None or not path.is_file():
        yield
        return
    before = os.environ.get(store.ENV)
    os.environ[store.ENV] = str(path)
    store.clear_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(store.ENV, None)
        else:
            os.environ[store.ENV] = before
        store.clear_cache()


class _Record(Reporter):
    """Forwards a search's callbacks and records each bucket whose search ended (not cut short by Ctrl-C)."""

    def __init__(self, inner: Reporter, step: Step, run_dir: Path, job: Job, ledger: Ledger,
                 result: JobResult, reporter: JobReporter) -> None:  # fmt: skip
        self.inner, self.job, self.ledger, self.result, self.reporter = inner, job, ledger, result, reporter
        self.by_key = {b.shape.key: b for b in step.buckets}
        self.run_dir = run_dir

    def shape_started(self, index: int, total: int, shape: Shape, summary: ShapeSummary, budget: int | None) -> None:
        self.inner.shape_started(index, total, shape, summary, budget)

    def trial_finished(self, summary: ShapeSummary) -> None:
        self.inner.trial_finished(summary)

    def shape_finished(self, summary: ShapeSummary) -> None:
        from dtune.tune.interrupt import INTERRUPTED

        self.inner.shape_finished(summary)
        if INTERRUPTED.is_set():  # cut short: searched again on the next run
            return
        bucket = self.by_key[summary.shape_key]
        if summary.best_ms is None and set(summary.failures) <= set(UNTRIED):
            self.reporter.skipped(bucket.key, "no trial finished within its budget (a re-run tries again)")
            self.result.left.append(bucket)
            return
        self.ledger.finish(bucket.key, {
            "run": str(self.run_dir.relative_to(self.job.out)),
            "best_ms": summary.best_ms,
            "default_ms": summary.default_ms,
            "trials": summary.trials_run,
            "failures": dict(summary.failures),  # by reason: why a bucket without a pass has none
        })  # fmt: skip
        self.result.tuned.append(bucket)
        if summary.best_ms is None:
            self.result.no_pass.append(bucket.key)
        self.reporter.bucket_done(bucket, summary)


def _report(job: Job, result: JobResult, reporter: JobReporter) -> None:
    """The job's HTML report; the tuned configs are exported by then, so a report that cannot be built (its charting
    library missing, nothing to draw) is skipped with its reason and never fails the job."""
    try:
        from dtune.report import build_report
    except ImportError as e:
        reporter.skipped("the report", f"ImportError: {e}")
        return
    try:
        result.report, _ = build_report([job.out], job.report_file)
    except (OSError, ValueError) as e:  # NothingToReport is a ValueError
        reporter.skipped("the report", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return
    reporter.reported(result.report)


def _search(job: Job, step: Step, todo: list[Bucket], ledger: Ledger, result: JobResult,
            reporter: JobReporter, deadline: float | None = None) -> bool:  # fmt: skip
    """One search of ``todo`` (stopped at ``deadline``, the job's ``--timeout``, its bucket in progress left for the
    next run); returns whether it was interrupted."""
    from dtune.measure.inputs import Workload
    from dtune.tune.search import SearchConfig, run_search

    sources = tuple(run_dirs(job.out, step.kernel))
    run_dir = new_run_dir(job.out, step)
    cfg = SearchConfig(
        kernel=step.kernel,
        gpu=job.gpu,
        space=load_space(step.kernel),
        shapes=[b.shape for b in todo],
        out=run_dir,
        dtype=step.dtype,
        trials=job.trials,
        timeout=float(step.seconds),
        interpret=job.interpret,
        trial_timeout=job.trial_timeout,
        compile_ahead=job.compile_ahead,
        workload=Workload(True, True, step.packed),
        transfer_from=sources,
        devices=job.devices,
        stop_at=deadline,
    )
    recorder = _Record(reporter.search(step, todo, run_dir), step, run_dir, job, ledger, result, reporter)
    return run_search(cfg, recorder).interrupted


def _bench(job: Job, kernel: str, ledger: Ledger, result: JobResult, reporter: JobReporter) -> None:
    """Bench every planned bucket of ``kernel`` with the job's config file against the baselines."""
    from dtune.inputs import dtype_from_name
    from dtune.measure import bench as b
    from dtune.measure.inputs import Workload

    buckets = job.plan.buckets(kernel)
    dt = dtype_from_name(job.plan.dtype(kernel))
    graph = get_kernel(kernel).family == "fused_recurrent"  # decode: CUDA-graph replays too
    groups: list[tuple[str, list[Shape], tuple[int, ...] | None]] = [
        (kernel, [x.shape for x in buckets if not x.packed], None)
    ]
    groups += [(f"{kernel}-packed", [x.shape], x.packed) for x in buckets if x.packed]
    reporter.bench(kernel, len(buckets))
    paths = []
    for name, shapes, packed in groups:
        if not shapes:
            continue
        folder = job.out / BENCH / name

        def shape_done(partial: b.BenchResult, folder: Path = folder) -> None:  # a stopped bench keeps what it timed
            b.write(partial, folder)
            record_bench(job, partial.frame)

        res = b.run_bench(
            kernel, ShapeGrid(explicit=tuple(shapes)), dt, list(job.baselines), job.config_file,
            rounds=job.rounds, graph=graph, workload=Workload(True, True, packed), shape_done=shape_done,
        )  # fmt: skip
        paths.append(b.write(res, folder)[0])
    ledger.benched[kernel] = ledger.done_of(kernel)
    ledger.save()
    result.bench_dirs += [p.parent for p in paths]
    reporter.benched(kernel, paths)


def record_bench(job: Job, frame: Any) -> None:
    """The bench's side-by-side times into the job's config file (:func:`dtune.tune.export.record_side_by_side`), so
    that what the job measured is what the fla backend's speed rule reads."""
    from dtune.provenance import command_line, stamp
    from dtune.tune.export import record_in_file

    peers = ", ".join(b for b in job.baselines if b != "default") or "no peer"
    what = command_line() or "dtune tune-gpu"
    how = f"side_by_side_ms: the bench of {what} beside {peers} ({stamp(f'{job.rounds or 3} rounds')})"
    record_in_file(job.config_file, frame, how, job.gpu.key)


def run_job(job: Job, reporter: JobReporter | None = None) -> JobResult:
    """Run the plan: the searches (skipping finished buckets), the export after each, the benches, the report."""
    reporter = reporter or JobReporter()
    t0 = time.monotonic()
    deadline = t0 + job.timeout if job.timeout else None
    ledger = Ledger.load(job.out, job.gpu.key)
    ledger.start_run()
    result = JobResult()
    try:
        _run(job, reporter, ledger, result, deadline)
    finally:  # a Ctrl-C between searches keeps this run's time too
        ledger.save()
    result.elapsed_s = time.monotonic() - t0
    result.job_elapsed_s, result.runs = ledger.elapsed_s, len(ledger.runs)
    return result


def _run(job: Job, reporter: JobReporter, ledger: Ledger, result: JobResult, deadline: float | None) -> None:
    """The searches, the benches and the report of one run, into ``result``."""
    for step in job.plan.steps:
        todo = [b for b in step.buckets if b.key not in ledger.done]
        if not todo:
            continue
        if deadline is not None:
            fit = int((deadline - time.monotonic() - step.costs.run_start_s) // step.bucket_s)
            if fit < len(todo):
                result.left += todo[max(fit, 0) :]
                reporter.skipped(
                    f"{step.kernel} {step.name}: {len(todo) - max(fit, 0)} of {len(todo)} bucket(s)",
                    "out of --timeout (a re-run continues)",
                )
                todo = todo[: max(fit, 0)]
            if not todo:
                continue
        backward = get_kernel(step.kernel).backward
        with configs_in_force(job.config_file if backward else None):
            interrupted = _search(job, step, todo, ledger, result, reporter, deadline)
        entries = export(job, ledger)
        if entries:
            reporter.exported(job.config_file, entries)
        if interrupted:
            result.interrupted = True
            result.left += [b for b in step.buckets if b.key not in ledger.done and b not in result.left]
            break
    if not result.interrupted and job.bench:
        if not job.config_file.is_file():
            reporter.skipped("the benches", f"no config passed the gate, so there is no {job.config_file.name}")
        else:
            try:
                with configs_in_force(job.config_file):
                    for kernel in job.plan.kernels:
                        if kernel in ledger.benched_now(job.out):
                            continue
                        need = Plan(tuple(s for s in job.plan.steps if s.kernel == kernel)).bench_s()
                        if deadline is not None and time.monotonic() + need > deadline:
                            reporter.skipped(f"the bench of {kernel}", "out of --timeout (a re-run continues)")
                            continue
                        try:
                            _bench(job, kernel, ledger, result, reporter)
                        except (RuntimeError, ValueError) as e:  # a failing bench never ends the job
                            reporter.skipped(f"the bench of {kernel}", f"{type(e).__name__}: {str(e).splitlines()[0]}")
            except KeyboardInterrupt:
                result.interrupted = True
    if not result.interrupted:
        _report(job, result, reporter)
    if job.config_file.is_file():
        result.entries = len(json.loads(job.config_file.read_text(encoding="utf-8"))["entries"])
