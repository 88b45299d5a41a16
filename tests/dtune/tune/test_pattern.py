"""The pattern strategy on known cost functions, without workers or a GPU: it finds the optimum of a separable
cost in few evaluations, moves one stage at a time, re-times combinations as a whole, repairs coupling moves."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from dtune.tune.pattern import PatternSearch
from dtune.tune.stages import StageMap, StageSpec, moved_stage
from dtune.tune.strategy import Candidate, Result, neighbours

CHOICES: dict[str, tuple[Any, ...]] = {
    "BT": (16, 32, 64),  # couples both stages
    "a_tile": (16, 32, 64, 128),
    "a_warps": (1, 2, 4, 8),
    "b_tile": (16, 32, 64, 128),
    "b_warps": (1, 2, 4, 8),
    "b_fast": (False, True),
}
STAGES = StageMap(
    (StageSpec("a", ("a_tile", "a_warps"), ("a",)), StageSpec("b", ("b_tile", "b_warps", "b_fast"), ("b",)))
)
DEFAULT = {"BT": 16, "a_tile": 16, "a_warps": 1, "b_tile": 128, "b_warps": 8, "b_fast": False}


def stage_times(p: dict[str, Any]) -> dict[str, float]:
    """Separable per stage; the best tile of each stage depends on BT (the coupling parameter)."""
    best_a = {16: 64, 32: 64, 64: 32}[p["BT"]]
    a = 1.0 + abs(CHOICES["a_tile"].index(p["a_tile"]) - CHOICES["a_tile"].index(best_a)) * 0.3
    a += abs(CHOICES["a_warps"].index(p["a_warps"]) - 1) * 0.2 + {16: 0.4, 32: 0.0, 64: 0.1}[p["BT"]]
    b = (
        2.0
        + abs(CHOICES["b_tile"].index(p["b_tile"]) - 1) * 0.25
        + abs(CHOICES["b_warps"].index(p["b_warps"]) - 2) * 0.15
    )
    b -= 0.3 * p["b_fast"]
    return {"a": a, "b": b}


OPTIMUM = min(sum(stage_times(dict(zip(CHOICES, v))).values()) for v in itertools.product(*CHOICES.values()))


def drive(search: PatternSearch, times: Callable[[dict[str, Any]], dict[str, float]], room: int = 8) -> list[Result]:
    """Run the strategy to its end, evaluating candidates in batches of ``room`` (as a compile pool would)."""
    out: list[Result] = []
    while True:
        cands = search.propose(room)
        if cands is None:
            return out
        assert cands, "the strategy waits although nothing is in flight"
        for c in cands:
            assert c.params is not None
            st = times(c.params)
            if c.kind == "whole":
                r = Result(c, dict(c.params), True, sum(st.values()), st, number=len(out))
            else:
                assert c.base is not None and c.stage is not None
                value = c.base.value - c.base.stage_ms[c.stage] + st[c.stage]
                r = Result(c, dict(c.params), True, value, {c.stage: st[c.stage]}, number=len(out))
            out.append(r)
            search.observe(r)


def make(
    starts: list[dict[str, Any]] | None = None, legal: Callable[[dict[str, Any]], bool] = lambda p: True
) -> PatternSearch:
    starts = starts or [DEFAULT]
    cands = [Candidate(dict(s), source="default" if i == 0 else "seed") for i, s in enumerate(starts)]
    return PatternSearch(CHOICES, cands, STAGES, legal)


def test_finds_the_optimum_of_a_separable_cost_in_few_evaluations() -> None:
    results = drive(make(), stage_times)
    best = min((r for r in results if r.candidate.kind == "whole"), key=lambda r: r.value or 1e9)
    assert best.value == pytest.approx(OPTIMUM)
    space = 1
    for c in CHOICES.values():
        space *= len(c)
    assert len(results) <= 60, f"{len(results)} evaluations of a space of {space}"
    assert len({(*sorted(r.params.items()), r.candidate.kind) for r in results}) == len(results)  # no repeats


def test_every_stage_move_changes_one_stage_of_its_base() -> None:
    results = drive(make(), stage_times)
    by_number = {r.number: r for r in results}
    stage_moves = [r for r in results if r.candidate.kind == "stage"]
    assert stage_moves
    for r in stage_moves:
        base = r.candidate.base
        assert base is not None and by_number[base.number].candidate.kind == "whole"  # the base was timed as a whole
        changed = [p for p in CHOICES if r.params[p] != by_number[base.number].params[p]]
        assert len(changed) == 1, changed
        assert moved_stage(STAGES, by_number[base.number].params, r.params) == r.candidate.stage


def test_combined_stage_moves_are_timed_as_a_whole_before_they_count() -> None:
    results = drive(make(), stage_times)
    whole = [r for r in results if r.candidate.kind == "whole"]
    combined = [r for r in whole if r.candidate.source == "combine"]
    assert combined, "improving stage moves must be combined and re-timed as a whole"
    # at least one combination took improving moves of both stages at once (never measured together before)
    assert any(r.params["a_tile"] != DEFAULT["a_tile"] and r.params["b_tile"] != DEFAULT["b_tile"] for r in combined)


def test_coupling_moves_repair_illegal_stage_parameters() -> None:
    def legal(p: dict[str, Any]) -> bool:  # a register rule: big chunks need small tiles
        return p["BT"] * p["a_tile"] <= 2048

    results = drive(make(legal=legal), stage_times)
    assert all(legal(r.params) for r in results)
    coupling = [r for r in results if r.candidate.source == "coupling" and r.params["BT"] == 64]
    assert coupling, "BT = 64 should be reached by repairing a_tile"
    best = min((r for r in results if r.candidate.kind == "whole"), key=lambda r: r.value or 1e9)
    legal_optimum = min(
        sum(stage_times(p).values())
        for p in (dict(zip(CHOICES, v)) for v in itertools.product(*CHOICES.values()))
        if legal(p)
    )
    assert best.value == pytest.approx(legal_optimum)


def test_a_good_start_converges_in_fewer_evaluations() -> None:
    """What transfer buys: starting next to the optimum, the search ends after a fraction of a cold search."""
    cold = drive(make(), stage_times)
    best = min((r for r in cold if r.candidate.kind == "whole"), key=lambda r: r.value or 1e9)
    warm = drive(make([DEFAULT, best.params]), stage_times)
    reach = next(i for i, r in enumerate(warm) if r.value == pytest.approx(OPTIMUM) and r.candidate.kind == "whole")
    reach_cold = next(
        i for i, r in enumerate(cold) if r.value == pytest.approx(OPTIMUM) and r.candidate.kind == "whole"
    )
    assert reach <= reach_cold / 3


def test_seeds_past_the_first_wave_wait_for_the_first_descent() -> None:
    """The default, the transferred configs and the first ``seed_wave`` seeds are timed first; the search descends from
    the best of them before it times the other seeds (a short budget goes to the descent), then descends again from
    the best start not yet descended from."""
    # seeds no descent from the default visits (a_tile 128, b_warps 1: away from the optimum's 64 and 4)
    far = [{**DEFAULT, "a_tile": 128, "b_warps": 1, "a_warps": w, "b_tile": t} for w in (1, 2, 4, 8) for t in (16, 64)]
    cands = [Candidate(dict(DEFAULT), source="default", is_default=True)]
    cands += [Candidate(dict(p), source="seed") for p in far[:3]]
    cands += [Candidate({**DEFAULT, "a_tile": 32}, source="transfer:shipped")]  # listed after seeds: first wave too
    cands += [Candidate(dict(p), source="seed") for p in far[3:]]
    results = drive(PatternSearch(CHOICES, cands, STAGES, lambda p: True, seed_wave=4), stage_times)
    sources = [r.candidate.source for r in results]
    first_move = sources.index("stage")
    assert sources[:first_move].count("seed") == 4 and "transfer:shipped" in sources[:first_move]
    late = [i for i, r in enumerate(results) if r.candidate.source == "seed"][4:]
    assert len(late) == 4 and min(late) > first_move
    assert sources[min(late) - 1] != "seed"  # the first descent ran to its end in between
    assert "stage" in sources[max(late) :]  # ... and a second one after the late seeds
    assert min(r.value or 1e9 for r in results if r.candidate.kind == "whole") == pytest.approx(OPTIMUM)
    # with every seed in the first wave, all are timed before the first move
    results = drive(PatternSearch(CHOICES, cands, STAGES, lambda p: True, seed_wave=100), stage_times)
    assert [r.candidate.source for r in results].index("stage") == len(cands)


def test_failed_and_cancelled_moves() -> None:
    """A failing config is never proposed again; a cancelled one (never ran to its end) may be."""
    search = make()
    first = search.propose(10)
    assert first is not None and len(first) == 1
    (c,) = first
    assert c.params is not None
    search.observe(Result(c, dict(c.params), True, 3.0, {"a": 1.0, "b": 2.0}, number=0))
    moves = search.propose(100)
    assert moves and all(m.kind == "stage" for m in moves)
    for i, m in enumerate(moves):
        assert m.params is not None
        search.observe(Result(m, dict(m.params), False, number=i + 1, reason="gate" if i % 2 else "cancelled"))
    assert search.propose(100) is not None  # the coupling level follows
    failed = {tuple(sorted(m.params.items())) for i, m in enumerate(moves) if i % 2 and m.params}
    assert failed <= set(search.failed)


def test_neighbours() -> None:
    assert neighbours((16, 32, 64, 128), 32) == [16, 64]
    assert neighbours((16, 32, 64, 128), 16) == [32]
    assert neighbours((False, True), False) == [True]
    assert neighbours(("kv", "vk", "xx"), "vk") == ["kv", "xx"]
    assert neighbours((16, 32), 8) == [16, 32]
