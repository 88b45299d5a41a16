"""Pattern search, stage by stage: local search for ~10-50 compiles per shape (``--strategy pattern``).

Start from the template's default, configs transferred from tuned buckets and the space's first ``seed_wave``
seeds (all timed as a whole); from the best, repeat the two levels below; then time the other seeds and descend again
from the best start not yet descended from (``copies`` descents in all). A short budget so goes to the descent from
the best known start rather than to seeds written for other shapes (the backward's step takes seconds a trial: the
H100's first stage-wise backward searches spent half their budget, KDA's all of it, on 17-23 seeds). Repeat:

1. **Inner level, per stage** (when the space has a ``[stages]`` map): every one-step move of one stage's own
   parameters (:func:`dtune.tune.strategy.neighbours`: the next smaller and larger tile or warp count, every other
   value of a flag), all compiled in parallel as one batch, each judged by *its stage's* time alone (a move in
   ``state`` only rebuilds and only times the state pass). Per stage the best move that gains at least
   ``min_gain``; the improving moves of all stages are combined into one config, which is re-gated and re-timed
   as a whole (a combination never measured together is never trusted); it becomes the incumbent if it beats it
   as a whole (else the single best move is tried as a whole). Repeat while a stage improves.
2. **Outer level, coupling parameters** (those no stage owns: ``BT``, ``BC``, ``INTRA``, ``FUSE_OUTPUT``,
   ``STATE_LAYOUT``, ...): every one-step move, with the stage parameters repaired minimally where the move makes
   them illegal, timed as a whole. The best move that beats the incumbent is taken; otherwise the ``outer_top``
   closest (within ``outer_margin`` of the incumbent) get their stages re-tuned (level 1) first, since a new chunk
   size usually wants other tiles. Without a stage map this level is a plain pattern search over every parameter.

The search ends when no move improves (or the budget is spent). Configs already measured (in this search or, via
the driver, in the study) are never measured again, and a stage's time is remembered by that stage's own and the
coupling parameters only (the launches are separate kernels): a move back to a stage setting measured under any
other setting of the other stages is answered from memory. The pattern is Helion's autotuner's (one-parameter moves
around the incumbent, batches compiled in parallel, several starting copies); the stage split and the outer level
are dtune's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from dtune.tune.stages import StageMap
from dtune.tune.strategy import Candidate, Result, neighbours

Key = tuple[tuple[str, Any], ...]
Batch = Generator[list[Candidate], list[Result], Any]


def key(params: Mapping[str, Any]) -> Key:
    return tuple(sorted(params.items()))


def _ratio(r: Result, x: Result) -> float:
    """How much a stage-local move ``r`` cut its stage's time relative to the incumbent ``x``."""
    stage = r.candidate.stage or ""
    return r.stage_ms[stage] / x.stage_ms[stage]


class PatternSearch:
    """The strategy (see the module docstring); ``legal(params)`` says whether a config may be proposed."""

    def __init__(
        self,
        choices: Mapping[str, Sequence[Any]],
        starts: list[Candidate],
        stages: StageMap,
        legal: Callable[[dict[str, Any]], bool],
        *,
        min_gain: float = 0.005,
        copies: int = 2,
        seed_wave: int = 4,
        outer_top: int = 2,
        outer_margin: float = 1.10,
        max_rounds: int = 50,
    ) -> None:
        if not starts:
            raise ValueError("pattern search needs at least one starting config")
        self.choices = {n: tuple(c) for n, c in choices.items()}
        self.starts = starts
        self.stages = stages
        self.legal = legal
        self.min_gain, self.copies, self.outer_top = min_gain, max(1, copies), outer_top
        self.seed_wave = seed_wave
        self.outer_margin, self.max_rounds = outer_margin, max_rounds
        self.whole: dict[Key, Result] = {}  # whole measurements (ok or not)
        self.stage_ms: dict[tuple[str, Key], float] = {}  # a stage's time by (stage, its own + coupling params)
        self.failed: dict[Key, Result] = {}
        self.best: Result | None = None
        self._gen = self._search()
        self._started = False
        self._batch: list[Candidate] = []
        self._outstanding = 0
        self._results: list[Result] = []
        self._done = False

    # ---- the Strategy protocol: hand out the generator's batches, collect their results -----------------
    def propose(self, room: int) -> list[Candidate] | None:
        if self._done:
            return None
        if not self._batch:
            if self._outstanding:
                return []
            try:
                self._batch = self._gen.send(self._results) if self._started else next(self._gen)
            except StopIteration:
                self._done = True
                return None
            self._started, self._results = True, []
        out, self._batch = self._batch[:room], self._batch[room:]
        self._outstanding += len(out)
        return out

    def observe(self, result: Result) -> None:
        self._outstanding -= 1
        self._results.append(result)

    # ---- measuring, with memory ----------------------------------------------------------------------------
    def _known(self, c: Candidate) -> Result | None:
        assert c.params is not None
        k = key(c.params)
        if k in self.failed:
            return self.failed[k]
        if c.kind == "whole":
            return self.whole.get(k)
        assert c.stage is not None
        ms = self.stage_ms.get(self._stage_key(c.stage, c.params))
        if ms is not None:
            return Result(c, dict(c.params), True, None, {c.stage: ms}, reused=True)
        return None

    def _stage_key(self, stage: str, params: Mapping[str, Any]) -> tuple[str, Key]:
        """What a stage's time depends on: its own parameters and the coupling ones."""
        return stage, key({p: v for p, v in params.items() if self.stages.stage_of(p) in (None, stage)})

    def _learn(self, r: Result) -> None:
        k = key(r.params)
        if not r.ok:
            if r.reason not in ("cancelled", "interrupted", "timeout"):
                self.failed[k] = r
            return
        for stage, ms in r.stage_ms.items():
            self.stage_ms[self._stage_key(stage, r.params)] = ms
        if r.candidate.kind == "whole" and r.value is not None:
            self.whole[k] = r
            if self.best is None or (self.best.value is not None and r.value < self.best.value):
                self.best = r

    def _run(self, cands: list[Candidate]) -> Batch:
        """Measure ``cands`` (what is known is not measured again); results in the order of ``cands``."""
        out: list[Result | None] = []
        new: list[Candidate] = []
        seen: dict[tuple[Key, str, str | None], Candidate] = {}
        alias: dict[int, Candidate] = {}
        for c in cands:
            known = self._known(c)
            if known is not None:
                out.append(known)
                continue
            assert c.params is not None
            tag = (key(c.params), c.kind, c.stage)
            if tag in seen:
                alias[id(c)] = seen[tag]
            else:
                seen[tag] = c
                new.append(c)
            out.append(None)
        if new:
            got = yield new
            by_id = {id(r.candidate): r for r in got}
            for r in got:
                self._learn(r)
            for i, c in enumerate(cands):
                if out[i] is None:
                    got_r = by_id.get(id(alias.get(id(c), c)))
                    assert c.params is not None
                    out[i] = got_r if got_r is not None else Result(c, dict(c.params), False, reason="cancelled")
        return [r for r in out if r is not None]

    # ---- the search -----------------------------------------------------------------------------------------
    def _search(self) -> Batch:
        later = [c for c in self.starts if c.source == "seed"][self.seed_wave :]
        first = [c for c in self.starts if not any(c is x for x in later)]
        results = yield from self._run(first)
        descended: set[Key] = set()
        for copy in range(self.copies):
            if copy == 1 and later:  # the other seeds: after the first descent, before the next
                results += yield from self._run(later)
            ok = [r for r in results if r.ok and r.value is not None and key(r.params) not in descended]
            if not ok:
                return
            start = min(ok, key=lambda r: r.value or math.inf)
            descended.add(key(start.params))
            yield from self._descend(start)

    def _descend(self, x: Result) -> Batch:
        for _ in range(self.max_rounds):
            x = yield from self._inner(x)
            y = yield from self._outer(x)
            if y is None:
                return x
            x = y
        return x

    def _gains(self, x: Result, results: list[Result]) -> dict[str, Result]:
        """Per stage, the move that cut that stage's time most (by at least ``min_gain``)."""
        best: dict[str, Result] = {}
        for r in results:
            stage = r.candidate.stage
            if not r.ok or stage is None or stage not in r.stage_ms or stage not in x.stage_ms:
                continue
            if r.stage_ms[stage] < x.stage_ms[stage] * (1 - self.min_gain) and (
                stage not in best or r.stage_ms[stage] < best[stage].stage_ms[stage]
            ):
                best[stage] = r
        return best

    def _inner(self, x: Result) -> Batch:
        """Stage-local moves around ``x`` until no stage improves; returns the incumbent (a whole result)."""
        if not self.stages:
            return x
        for _ in range(self.max_rounds):
            base = x.measured()
            cands = []
            for st in self.stages.stages:
                if st.name not in x.stage_ms:  # this config does not launch the stage (e.g. output when fused)
                    continue
                for p in st.params:
                    if p not in self.choices:
                        continue
                    for v in neighbours(self.choices[p], x.params[p]):
                        y = {**x.params, p: v}
                        if self.legal(y):
                            cands.append(Candidate(y, "stage", st.name, base=base, source="stage"))
            if not cands:
                return x
            results = yield from self._run(cands)
            gains = self._gains(x, results)
            if not gains:
                return x
            combined = dict(x.params)
            for stage, r in gains.items():
                spec = self.stages.get(stage)
                assert spec is not None
                combined.update({p: r.params[p] for p in spec.params if p in r.params})
            single = min(gains.values(), key=lambda r: _ratio(r, x))
            tries = [combined] if self.legal(combined) else []
            if key(single.params) != key(combined):
                tries.append(single.params)
            for params in tries:
                (w,) = yield from self._run([Candidate(dict(params), "whole", source="combine")])
                if w.ok and w.value is not None and x.value is not None and w.value < x.value:
                    x = w
                    break
            else:
                return x
        return x

    def _repair(self, y: dict[str, Any], fixed: str) -> dict[str, Any] | None:
        """``y`` if legal, else the legal config nearest to it changing one or two stage parameters (any other
        parameter without a stage map); None if there is none."""
        if self.legal(y):
            return y
        free = [p for p in self.choices if p != fixed and (not self.stages or self.stages.stage_of(p) is not None)]

        def moves(p: str) -> list[Any]:
            values = list(self.choices[p])
            if y[p] not in values:
                return values
            i = values.index(y[p])
            return sorted((v for v in values if v != y[p]), key=lambda v: abs(values.index(v) - i))

        for depth in (1, 2):
            for params in itertools.combinations(free, depth):
                for values in itertools.product(*(moves(p) for p in params)):
                    z = {**y, **dict(zip(params, values))}
                    if self.legal(z):
                        return z
        return None

    def _outer(self, x: Result) -> Batch:
        """Coupling moves around ``x``: a better incumbent (a whole result), or None."""
        coupling = self.stages.coupling(self.choices) if self.stages else list(self.choices)
        cands, seen = [], set()
        for p in coupling:
            for v in neighbours(self.choices[p], x.params[p]):
                y = self._repair({**x.params, p: v}, p)
                if y is not None and key(y) not in seen:
                    seen.add(key(y))
                    cands.append(Candidate(y, "whole", source="coupling"))
        if not cands or x.value is None:
            return None
        results = yield from self._run(cands)
        ok = sorted((r for r in results if r.ok and r.value is not None), key=lambda r: r.value or math.inf)
        if not ok:
            return None
        if (ok[0].value or math.inf) < x.value * (1 - self.min_gain):
            return ok[0]
        if not self.stages:
            return None
        for r in ok[: self.outer_top]:
            if (r.value or math.inf) > x.value * self.outer_margin:
                break
            refined = yield from self._inner(r)
            if refined.value is not None and refined.value < x.value * (1 - self.min_gain):
                return refined
        return None
