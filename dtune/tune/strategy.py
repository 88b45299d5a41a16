"""Search strategies: what to try next, given what has been measured (``dtune search --strategy``).

A strategy proposes :class:`Candidate` configs and observes each one's :class:`Result`; the driver
(:class:`dtune.tune.shape_search.ShapeSearch`) turns candidates into Optuna trials, checks constraints, compiles ahead,
gates and times them, and reports back. Two kinds:

* ``pattern`` (:mod:`dtune.tune.pattern`, the default for multi-stage kernels): the default, the space's seeds and
  transferred configs first, then one-parameter moves around the best config, a batch at a time (compiled in
  parallel), stage by stage; the driver creates each planned config's trial itself.
* ``tpe``, ``cmaes``, ``random``, ``grid`` (:class:`SamplerStrategy`): Optuna's samplers over the joint space
  (the default for the one-launch fused-recurrent kernels, whose spaces are small); the default, seeds and
  transferred configs are enqueued first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna

SAMPLERS = ("tpe", "cmaes", "random", "grid")
STRATEGIES = ("pattern", *SAMPLERS)


@dataclass
class Measured:
    """What a whole trial measured of a config: the base a stage-local move's estimate builds on."""

    number: int
    value: float
    stage_ms: dict[str, float]


@dataclass
class Candidate:
    """A config to try. ``params`` None: the sampler picks (sampler strategies). ``kind`` ``"stage"``: a move of
    ``stage``'s parameters only, timed on that stage against ``base`` (its value is ``base`` with that stage's time
    replaced); ``"whole"``: gated with the edge case and timed as a whole (the only kind that may be exported)."""

    params: dict[str, Any] | None
    kind: str = "whole"
    stage: str | None = None
    base: Measured | None = None
    source: str = "search"  # default, seed, transfer, retry, start, stage, combine, coupling, sampler
    is_default: bool = False


@dataclass
class Result:
    """What became of a candidate: ``ok`` (passed the gate and was timed), its value (whole: the measured time;
    stage: the estimate) and stage times; ``number`` is its trial (or the earlier trial it reused)."""

    candidate: Candidate
    params: dict[str, Any]
    ok: bool
    value: float | None = None
    stage_ms: dict[str, float] = field(default_factory=dict)
    number: int = -1
    reason: str | None = None
    reused: bool = False

    def measured(self) -> Measured | None:
        if not self.ok or self.value is None or self.candidate.kind != "whole":
            return None
        return Measured(self.number, self.value, dict(self.stage_ms))


class Strategy(Protocol):
    """Proposes candidates and observes their results."""

    def propose(self, room: int) -> list[Candidate] | None:
        """Up to ``room`` new candidates; ``[]`` to wait for results in flight; None when the search is over."""
        ...

    def observe(self, result: Result) -> None: ...


class SamplerStrategy:
    """An Optuna sampler over the joint space: every proposal is "ask the sampler" (the driver enqueues the
    starting configs in the study first)."""

    def propose(self, room: int) -> list[Candidate] | None:
        return [Candidate(None, source="sampler") for _ in range(room)]

    def observe(self, result: Result) -> None:
        pass


def make_sampler(
    name: str, seed: int, choices: Mapping[str, Sequence[Any]], parallel: bool = False
) -> optuna.samplers.BaseSampler:
    """The Optuna sampler called ``name``, seeded. ``parallel``: trials are asked ahead (TPE lies about running ones).
    The pattern strategy plans its own configs: its fallback sampler is random."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=parallel)
    if name in ("random", "pattern"):
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        # Parameters are categorical: CMA-ES samples them independently (through its fallback sampler).
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "grid":
        return optuna.samplers.GridSampler({n: list(c) for n, c in choices.items()}, seed=seed)
    raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")


def neighbours(choices: Sequence[Any], value: Any) -> list[Any]:
    """One-step moves of a parameter: the next smaller and larger choice of an ordered numeric parameter (a tile,
    a warp count), every other choice of a flag or a variant. ``value`` outside ``choices``: every choice."""
    values = list(choices)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if value not in values:
        return values
    if not numeric:
        return [v for v in values if v != value]
    ordered = sorted(values)
    i = ordered.index(value)
    return [ordered[j] for j in (i - 1, i + 1) if 0 <= j < len(ordered)]
