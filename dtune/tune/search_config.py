"""What one ``dtune search`` run is given (:class:`SearchConfig`, which the CLI builds from its options), the
environment its worker processes start with, and the record of it that ``run.json`` keeps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtune._env import child_env
from dtune.gpu import GpuProfile, device_name
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.timing import TIMINGS
from dtune.provenance import command_line
from dtune.shape import Shape, ShapeGrid
from dtune.tune import transfer
from dtune.tune.runinfo import git_commit, now_iso, versions
from dtune.tune.space import SearchSpace
from dtune.tune.storage import default_storage_url
from dtune.tune.strategy import STRATEGIES

__all__ = ["DEFAULT_TRIALS", "INTERPRET_SHAPES", "SearchConfig", "run_info", "worker_env"]

INTERPRET_SHAPES = ShapeGrid(seq_lens=(4,), head_dims=(32,), heads=(2,), batch=(2,))
DEFAULT_TRIALS = 40


@dataclass
class SearchConfig:
    """Everything one ``dtune search`` run needs (the CLI builds it from its options)."""

    kernel: str
    gpu: GpuProfile
    space: SearchSpace
    shapes: list[Shape]
    out: Path
    dtype: str = "bf16"
    trials: int | None = None  # per shape, run by this process; with neither trials nor timeout: DEFAULT_TRIALS
    timeout: float | None = None  # seconds per shape
    stop_at: float | None = None  # time.monotonic() at which the whole run stops, its trials in flight cancelled
    strategy: str | None = None  # None: "pattern" when the space has a stage map (multi-launch kernels), else "tpe"
    seed: int = 0
    storage: str | None = None  # None: sqlite in the run folder
    resume: bool = False
    interpret: bool = False
    determinism: bool = False
    trial_timeout: float = 300.0
    repeats: int = 50
    timing: str = "auto"  # auto: graph replays for short sequences (T <= 16, launch-bound), events otherwise
    compile_ahead: int = 0  # compile workers running ahead of the timing workers (0: each trial compiles in turn)
    workload: Workload = DEFAULT_WORKLOAD  # what each trial times (initial and final state by default)
    seeds: bool = True  # start from the space's seeds and the shipped configs' nearest buckets too (False: default)
    transfer_from: tuple[Path, ...] = ()  # run folders whose winners seed the nearest buckets (also with seeds off)
    transfer_count: int = transfer.DEFAULT_COUNT
    devices: tuple[str, ...] = ()  # one timing worker per entry (CUDA_VISIBLE_DEVICES); () one, as the env says
    resource_model: bool = True  # drop configs predicted to spill heavily or to overflow shared memory
    sanitize: bool = True  # re-run a crashed trial under compute-sanitizer (when installed; not under the interpreter)
    max_memory_mb: float | None = None  # trials whose training step / call peaks above this (MiB) fail, reason "memory"
    sampler: str | None = None  # deprecated alias of strategy

    def __post_init__(self) -> None:
        if self.sampler is not None:
            if self.strategy is not None and self.strategy != self.sampler:
                raise ValueError("give --strategy or its deprecated alias --sampler, not both")
            self.strategy = self.sampler
        if self.strategy is None:
            self.strategy = "pattern" if self.space.stages else "tpe"
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        if self.dtype not in self.space.tolerance:
            raise ValueError(f"the search space has no tolerance for dtype {self.dtype!r}")
        if not self.shapes:
            raise ValueError("no shapes to tune")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"--trials must be at least 1, got {self.trials}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")
        if self.compile_ahead < 0:
            raise ValueError(f"--compile-ahead must be 0 or more, got {self.compile_ahead}")
        if self.timing not in TIMINGS:
            raise ValueError(f"unknown timing {self.timing!r}; use one of {', '.join(TIMINGS)}")
        if self.transfer_count < 0:
            raise ValueError(f"--transfer-count must be 0 or more, got {self.transfer_count}")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"--devices lists a device twice: {','.join(self.devices)}")
        for path in self.transfer_from:
            if not (Path(path) / "run.json").is_file():
                raise ValueError(f"--transfer-from {path}: not a run folder (no run.json)")
        if self.max_memory_mb is not None and not self.max_memory_mb > 0:
            raise ValueError(f"--max-memory must be positive, got {self.max_memory_mb}")
        if self.trials is None and self.timeout is None:
            self.trials = DEFAULT_TRIALS

    @property
    def device(self) -> str:
        return "cpu" if self.interpret else "cuda"

    @property
    def storage_url(self) -> str:
        return self.storage or default_storage_url(self.out)

    @property
    def worker_devices(self) -> list[str | None]:
        """One entry per timing worker: a CUDA device index (under the interpreter only a label), or None."""
        return list(self.devices) if self.devices else [None]


def worker_env(interpret: bool) -> dict[str, str]:
    """The workers' environment: this process's, with the interpreter switch, and the folder this dtune was imported
    from first on PYTHONPATH (so a search run from a source checkout starts workers of the same code). Every worker
    (compile pool and timing workers) gets the same Triton cache directory: what the pool builds, the timing
    workers load."""
    env = child_env()
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_info(cfg: SearchConfig) -> dict[str, Any]:
    """What ``run.json`` records of a run: its kernel, GPU, shapes, strategy, options and provenance."""
    return {
        "kernel": cfg.kernel,
        "gpu": cfg.gpu.as_dict(),
        "device_name": None if cfg.interpret else device_name(),  # what torch reported: provenance
        "dtype": cfg.dtype,
        "shapes": [s.as_dict() for s in cfg.shapes],
        "versions": versions(),
        "commit": git_commit(),
        "command": command_line(),  # None where no dtune command started it
        "interpret": cfg.interpret,
        "strategy": cfg.strategy,
        "sampler": cfg.strategy,  # the report's name for it
        "seed": cfg.seed,
        "seeds": cfg.seeds,
        "transfer_from": [str(p) for p in cfg.transfer_from],
        "storage": cfg.storage,  # None: study.db in this folder
        "space": cfg.space.source,
        "determinism": cfg.determinism,
        "timing": cfg.timing,
        "compile_ahead": cfg.compile_ahead,
        "devices": list(cfg.devices),
        "resource_model": cfg.resource_model,
        "workload": dataclasses.asdict(cfg.workload),
        "created": now_iso(),
    }
