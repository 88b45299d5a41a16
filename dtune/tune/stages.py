"""Which parameters shape which launches: the stage map of a search space (its ``[stages]`` table), as data.

A multi-launch template (the chunk pipeline: ``intra``, ``state`` or ``state+output``, ``output``, and with the
sequence-parallel pass ``transitions`` and ``segment-starts``) exposes its launches by name through its ``plan()``.
A search space groups them into stages: a stage owns some parameters (``intra_*`` shape only the intra launch) and
its time is the sum of its launches' times. Parameters that no stage owns (``BT``, ``BC``, ``INTRA``,
``FUSE_OUTPUT``, ``STATE_LAYOUT``, ``SEG_CHUNKS``, ...) couple the stages: changing one changes several launches.

The stage-wise search (:mod:`dtune.tune.pattern`) moves one stage's parameters at a time and compares only that
stage's time; since the launches are separate kernels, such a move also rebuilds only that stage's kernels (Triton
caches each specialisation on disk, shared by the compile pool and the timing workers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageSpec:
    """One stage: its own parameters and the launch names whose summed time is its time."""

    name: str
    params: tuple[str, ...]
    launches: tuple[str, ...]


@dataclass(frozen=True)
class StageMap:
    """All stages of a space (empty: a one-launch template, every parameter is searched against the whole time)."""

    stages: tuple[StageSpec, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.stages)

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def get(self, name: str) -> StageSpec | None:
        return next((s for s in self.stages if s.name == name), None)

    def stage_of(self, param: str) -> str | None:
        """The stage that owns ``param``, or None for a coupling parameter."""
        return next((s.name for s in self.stages if param in s.params), None)

    def coupling(self, params: Iterable[str]) -> list[str]:
        """The parameters (of ``params``, in order) that no stage owns."""
        return [p for p in params if self.stage_of(p) is None]

    def stage_of_launch(self, launch: str) -> str:
        """The stage a launch belongs to; a launch no stage claims is a stage of its own, under its own name."""
        return next((s.name for s in self.stages if launch in s.launches), launch)

    def group(self, launches: Iterable[str]) -> dict[str, list[str]]:
        """Launch names (in launch order) grouped by stage, stages in order of their first launch."""
        out: dict[str, list[str]] = {}
        for launch in launches:
            out.setdefault(self.stage_of_launch(launch), []).append(launch)
        return out

    def launch_table(self) -> dict[str, list[str]]:
        """``{stage: [launch, ...]}``: what a trial job carries to the worker (JSON)."""
        return {s.name: list(s.launches) for s in self.stages}

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> StageMap:
        """The inverse of :meth:`launch_table` (parameters are not needed in the worker)."""
        return cls(tuple(StageSpec(n, (), tuple(ls)) for n, ls in table.items()))


def moved_stage(stages: StageMap, base: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
    """The one stage whose parameters alone differ between ``base`` and ``config``; None when nothing differs,
    a coupling parameter differs, or two stages' parameters differ (such a config is timed as a whole)."""
    changed = [p for p in config if base.get(p) != config[p]]
    owners = {stages.stage_of(p) for p in changed}
    if len(owners) != 1 or None in owners:
        return None
    return owners.pop()
