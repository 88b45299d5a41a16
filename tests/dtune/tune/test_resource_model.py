"""The resource model drops the H200's disasters and keeps its winners (configs and ptxas figures of the searches of
2026-11-29/30, data/h200-2026-11-30), and the search prunes what it drops before compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from dtune.kernels import get_kernel

from dtune.gpu import get_profile
from dtune.shape import Shape
from dtune.tune import resource_model as rm
from dtune.tune.search import SearchConfig, ShapeSearch
from dtune.tune.space import load_space
from dtune.tune.strategy import Candidate

H200_SMEM = get_profile("h200").smem_per_block
WINNERS = [  # the best of each H200 search, and the default
    ("chunk_kda", 128, {"STATE_LAYOUT": "vk", "h_BV": 64}),  # 1.600 ms
    ("chunk_kda", 64, {"SAFE_DIAG": False}),  # 0.886 ms
    ("chunk_gated_delta_rule", 128, {"STATE_LAYOUT": "vk", "h_BV": 64}),  # 0.843 ms
    ("chunk_delta_rule", 128, {}),
]
DISASTERS = [  # spilled 560, 634, 168 and 146 bytes on the H200; 21.8, 3.96, 2.81 and 1.78 ms
    ("chunk_kda", 128, {"BT": 128, "BC": 64, "intra_BK": 32, "intra_BV": 128, "intra_num_warps": 4,
                        "intra_num_stages": 2, "FUSE_OUTPUT": False, "STATE_LAYOUT": "vk", "o_BK": 128, "o_BV": 32,
                        "o_num_warps": 8, "h_num_stages": 1, "SAFE_DIAG": False}),
    ("chunk_gated_delta_rule", 128, {"BT": 128, "BC": 32, "intra_num_warps": 4, "intra_num_stages": 2,
                                     "h_num_warps": 8, "h_num_stages": 1, "FUSE_OUTPUT": False, "STATE_LAYOUT": "vk",
                                     "o_BK": 32}),
    ("chunk_kda", 128, {"BT": 64, "STATE_LAYOUT": "vk", "h_BV": 64}),
    ("chunk_kda", 64, {"BT": 64, "STATE_LAYOUT": "vk", "h_BV": 64}),
]  # fmt: skip


def pred(kernel: str, dim: int, cfg: dict[str, Any]) -> dict[str, rm.StagePrediction] | None:
    full = get_kernel(kernel).check_config(dim, dim, cfg)
    return rm.predict(kernel, full, dim, dim, "bf16")


@pytest.mark.parametrize(("kernel", "dim", "cfg"), WINNERS)
def test_winners_are_kept(kernel: str, dim: int, cfg: dict[str, Any]) -> None:
    assert rm.drop_reason(pred(kernel, dim, cfg), H200_SMEM) is None


@pytest.mark.parametrize(("kernel", "dim", "cfg"), DISASTERS)
def test_disasters_are_dropped(kernel: str, dim: int, cfg: dict[str, Any]) -> None:
    reason = rm.drop_reason(pred(kernel, dim, cfg), H200_SMEM)
    assert reason is not None and "heavy spills" in reason


def test_hits_against_what_the_kernels_used() -> None:
    p = pred("chunk_kda", 128, {"BT": 64})
    assert (p is not None and rm.predicted_spills(p) == ["intra", "state"]) or rm.predicted_spills(p) == ["intra"]
    assert rm.hit(p, {"intra": [255, 168, 12544], "state": [200, 0, 1000]}) is (not p["state"].spills)
    assert rm.hit(p, {"intra": [255, 0, 12544]}) is False  # predicted a spill that did not happen
    assert rm.hit(p, {"intra": [None, None, None]}) is None  # the interpreter: nothing to compare
    assert rm.actual_spills({"intra": [255, 12, 1], "state": [255, 100, 1]}) == ["state"]  # 12 bytes: harmless
    assert rm.predict("fused_recurrent_kda", {}, 128, 128, "bf16") is None  # no model: never dropped
    huge = rm.StagePrediction(100.0, 10**6, 255)
    assert "shared memory" in (rm.drop_reason({"state": huge}, H200_SMEM) or "")


class _Evaluator:
    capacity = 1


def test_the_search_prunes_what_the_model_drops(tmp_path: Path) -> None:
    shape = Shape(8, 4096, 16, 16, 128, 128)
    kernel, _, disaster = DISASTERS[2]
    cfg = SearchConfig(
        kernel=kernel, gpu=get_profile("h200"), space=load_space(kernel), shapes=[shape], out=tmp_path, seeds=False
    )
    storage = optuna.storages.InMemoryStorage()
    search = ShapeSearch(cfg, shape, storage, _Evaluator())  # type: ignore[arg-type]
    config = get_kernel(kernel).check_config(128, 128, disaster)
    reason, message = search.rejected(Candidate(disaster), config)
    assert reason == "predicted" and "intra" in message
    assert search.rejected(Candidate(disaster, is_default=True), config) == (None, "")  # the baseline always runs
    cfg.resource_model = False
    assert search.rejected(Candidate(disaster), config) == (None, "")


def test_a_register_cap_is_the_stages_cap() -> None:
    """``intra_maxnreg`` / ``h_maxnreg`` lower the cap the model holds the stage's demand against (KDA's stage 1 at
    96 registers spilled 2.2 KB in a sm_90a compile: dropped), and leave the other stages' caps alone."""
    capped = pred("chunk_kda", 128, {"intra_maxnreg": 96, "h_maxnreg": 168})
    plain = pred("chunk_kda", 128, {})
    assert capped is not None and plain is not None
    assert capped["intra"].cap == 96 and capped["state"].cap == min(168, plain["state"].cap)
    assert plain["intra"].cap > 96
    reason = rm.drop_reason(capped, H200_SMEM)
    assert reason is not None and "stage intra" in reason and "cap 96" in reason
