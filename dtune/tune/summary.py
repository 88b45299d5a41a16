"""What a search reports while it runs and when it ends: per-shape and per-run summaries, and the progress
callbacks (:class:`Reporter`; the CLI draws them with rich)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtune.shape import Shape


@dataclass
class ShapeSummary:
    study: str
    shape_key: str
    trials_run: int = 0  # created by this process (pruned ones included)
    completed_run: int = 0  # gated and timed by this process
    counts: dict[str, int] = field(default_factory=dict)  # all trials of the study
    failures: dict[str, int] = field(default_factory=dict)
    best_ms: float | None = None
    default_ms: float | None = None
    best_config: dict[str, Any] | None = None
    elapsed_s: float = 0.0
    model_hits: int = 0  # compiled trials whose resource-model spill prediction matched ptxas
    model_checked: int = 0
    last: dict[str, Any] | None = None  # the last trial's row

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.default_ms:
            return self.default_ms / self.best_ms
        return None

    @property
    def trials_per_min(self) -> float:
        return 60.0 * self.trials_run / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def completed_per_min(self) -> float:
        return 60.0 * self.completed_run / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def model_hit_rate(self) -> float | None:
        return self.model_hits / self.model_checked if self.model_checked else None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("last")
        d["speedup"] = self.speedup
        d["trials_per_min"] = self.trials_per_min
        d["completed_per_min"] = self.completed_per_min
        d["model_hit_rate"] = self.model_hit_rate
        return d


@dataclass
class RunSummary:
    run_dir: str
    storage: str
    kernel: str
    gpu: str
    dtype: str
    interpret: bool
    shapes: list[ShapeSummary] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False
    worker_restarts: int = 0
    strategy: str = ""

    @property
    def trials_per_min(self) -> float:
        n = sum(s.trials_run for s in self.shapes)
        return 60.0 * n / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def completed_per_min(self) -> float:
        n = sum(s.completed_run for s in self.shapes)
        return 60.0 * n / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def model_hit_rate(self) -> float | None:
        checked = sum(s.model_checked for s in self.shapes)
        return sum(s.model_hits for s in self.shapes) / checked if checked else None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shapes"] = [s.as_dict() for s in self.shapes]
        d["trials_per_min"] = self.trials_per_min
        d["completed_per_min"] = self.completed_per_min
        d["model_hit_rate"] = self.model_hit_rate
        return d


class Reporter:
    """Progress callbacks of a search; the base class is silent (the CLI draws with rich)."""

    def shape_started(self, index: int, total: int, shape: Shape, summary: ShapeSummary, budget: int | None) -> None:
        pass

    def trial_finished(self, summary: ShapeSummary) -> None:
        pass

    def shape_finished(self, summary: ShapeSummary) -> None:
        pass
