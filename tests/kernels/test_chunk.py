"""Chunkwise templates against the float64 loop and the fused-recurrent ops, under Triton's interpreter.

Outputs are NaN-poisoned by the autouse fixture (tests/conftest.py), intermediates included: an element a
stage fails to write shows up as NaN (rel_err returns inf). Gates are strong (per-step log decay down to −5).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.reference import naive_recurrent

from dtune import ops
from dtune.inputs import Gate, Problem, make_inputs
from tests.conftest import rel_err

CHUNK = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
RECURRENT = {
    Gate.NONE: "fused_recurrent_delta_rule",
    Gate.SCALAR: "fused_recurrent_gated_delta_rule",
    Gate.CHANNEL: "fused_recurrent_kda",
}
TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def run(name: str, x: dict[str, Any], config: dict[str, Any] | None = None, final: bool = True) -> tuple:
    return ops.run_kernel(
        name,
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        output_final_state=final,
        cu_seqlens=x["cu_seqlens"],
        config=config,
    )


def check(problem: Problem, x: dict[str, Any], config: dict[str, Any] | None = None, tol: float | None = None) -> None:
    """Chunk op vs the float64 loop (output and final state), and vs the fused-recurrent op."""
    tol = TOL[x["v"].dtype] if tol is None else tol
    o, s = run(CHUNK[problem.gate], x, config)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o_ref, s_ref = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert s is not None and s_ref is not None
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.3g}"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.3g}"
    o_rec, s_rec = run(RECURRENT[problem.gate], x)
    assert rel_err(o, o_rec) < 2 * tol, f"output vs fused recurrent {rel_err(o, o_rec):.3g}"
    assert s_rec is not None and rel_err(s, s_rec) < 2 * tol


def case_id(p: Problem, seq_lens: list[int] | None, extra: str = "") -> str:
    head = f"varlen{'-'.join(map(str, seq_lens))}" if seq_lens else f"B{p.B}-T{p.T}"
    op = {"none": "dn", "scalar": "gdn", "channel": "kda"}[p.gate.value]
    return f"{head}-H{p.H}-HV{p.HV}-K{p.K}-V{p.V}-{op}{extra}"


# (problem, seq_lens, initial_state, config); BT = 32 in most cases to keep the interpreter quick.
SMALL = {"BT": 32, "BC": 16}
CASES: dict[str, tuple[Problem, list[int] | None, bool, dict[str, Any] | None]] = {}


def add(
    p: Problem, seq_lens: list[int] | None = None, h0: bool = True, config: dict | None = None, extra: str = ""
) -> None:
    CASES[case_id(p, seq_lens, extra)] = (p, seq_lens, h0, config)


for gate in Gate:
    add(Problem(2, 1, 2, 2, 32, 32, 2, gate), config=SMALL)  # T = 1
    add(Problem(2, 31, 2, 4, 32, 48, 2, gate), config=SMALL)  # T = BT - 1, grouped value heads, K != V
    add(Problem(1, 33, 1, 2, 16, 32, 1, gate), h0=False, config=SMALL, extra="-noh0")  # T = BT + 1
    add(Problem(1, 63, 1, 1, 32, 16, 1, gate), extra="-default")  # default config (BT = 64, BC = 16): T = BT - 1
    add(Problem(1, 0, 1, 2, 32, 32, 5, gate, True), seq_lens=[1, 17, 0, 40, 2], config=SMALL)  # varlen, empty seq
    add(Problem(1, 50, 1, 1, 32, 32, 1, gate), config={"BT": 16, "BC": 16, "FUSE_OUTPUT": True}, extra="-fused")
add(Problem(1, 20, 1, 1, 256, 32, 1, Gate.CHANNEL), config=SMALL)  # K = 256: key tiles in every stage
add(Problem(1, 20, 1, 1, 32, 256, 1, Gate.SCALAR), config=SMALL)  # V = 256
add(Problem(1, 17, 1, 1, 256, 256, 1, Gate.NONE), config={"BT": 16, "BC": 16, "FUSE_OUTPUT": True})
add(Problem(1, 70, 1, 1, 16, 16, 1, Gate.CHANNEL), config={"BT": 64, "BC": 16, "SAFE_DIAG": False}, extra="-ref")
add(Problem(1, 70, 1, 1, 16, 16, 1, Gate.SCALAR), config={"BT": 128, "BC": 32}, extra="-BT128")
# the other stage-1 variant: blocks one after the other through memory (any BT / BC, e.g. 8 blocks)
ROWS = {"BT": 32, "BC": 16, "INTRA": "rows"}
for gate in Gate:
    add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config=ROWS, extra="-rows")
    add(Problem(1, 0, 1, 2, 32, 32, 4, gate, True), seq_lens=[1, 40, 0, 33], config=ROWS, extra="-rows")
add(Problem(1, 140, 1, 1, 16, 16, 1, Gate.CHANNEL), config={"BT": 128, "BC": 16, "INTRA": "rows"}, extra="-rows8")
# "blocks" with A_qk in a pass of its own: 4, 2 and 1 sub-chunks, every gate, varlen
SPLIT = {"BT": 64, "BC": 16, "INTRA": "blocks_split"}
for gate in Gate:
    add(Problem(1, 0, 1, 2, 32, 48, 3, gate, True), seq_lens=[70, 0, 45], config=SPLIT, extra="-split4")
    add(Problem(2, 45, 2, 4, 32, 32, 2, gate), config={**SPLIT, "BT": 32}, extra="-split2")
add(Problem(1, 40, 1, 1, 32, 32, 1, Gate.CHANNEL), config={**SPLIT, "BT": 32, "BC": 32}, extra="-split1")
# the transposed state pass (STATE_LAYOUT = "vk"), fused and unfused, with every gate
for gate in Gate:
    for fused in (False, True):
        vk = {"BT": 32, "BC": 16, "STATE_LAYOUT": "vk", "FUSE_OUTPUT": fused, "h_BV": 16}
        tag = f"-vk{'-fused' if fused else ''}"
        add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config=vk, extra=tag)  # odd T, grouped heads, K != V
        add(Problem(1, 0, 1, 2, 32, 32, 4, gate, True), seq_lens=[1, 40, 0, 33], config=vk, extra=tag)
add(Problem(1, 20, 1, 1, 24, 40, 1, Gate.CHANNEL), config={"BT": 16, "BC": 16, "STATE_LAYOUT": "vk"}, extra="-vk")
# q and k fed to the state pass's dots as loaded (QK_DIRECT): the scale and the scalar gate's factors on the products
# and on V_new's rows; both layouts, fused (the output's factor) and unfused (the state update's factor only)
for gate in (Gate.NONE, Gate.SCALAR):
    for layout, fused in (("kv", True), ("vk", True), ("vk", False)):
        qd = {"BT": 32, "BC": 16, "STATE_LAYOUT": layout, "FUSE_OUTPUT": fused, "h_BV": 16, "QK_DIRECT": True}
        tag = f"-qkdirect-{layout}{'-fused' if fused else ''}"
        add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config=qd, extra=tag)
    add(Problem(1, 0, 1, 2, 32, 32, 4, gate, True), seq_lens=[1, 40, 0, 33], config=qd, extra="-qkdirect-varlen")
# KDA's one-pass stage 1 (INTRA = "onepass"): 2 sub-chunks of 16 and of 32, 1 sub-chunk; the diagonal's dots in the
# intermediates' dtype (DIAG_BF16: bfloat16 only, so a no-op here: the path runs, its numerics are the GPU's) and the
# squaring inverse; odd T, grouped heads, K != V, varlen with an empty sequence, no initial state, unguarded
ONEPASS = {"BT": 32, "BC": 16, "INTRA": "onepass"}
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.CHANNEL), config=ONEPASS, extra="-onepass")
add(Problem(1, 0, 1, 2, 32, 32, 5, Gate.CHANNEL, True), seq_lens=[1, 17, 0, 40, 2], config=ONEPASS, extra="-onepass")
add(Problem(1, 33, 1, 2, 16, 32, 1, Gate.CHANNEL), h0=False, config={**ONEPASS, "BT": 16}, extra="-onepass1")
add(Problem(1, 70, 1, 2, 64, 32, 1, Gate.CHANNEL), config={**ONEPASS, "BT": 64, "BC": 32, "intra_BK": 32,
    "DIAG_BF16": True}, extra="-onepass-BC32")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 48, 3, Gate.CHANNEL, True), seq_lens=[40, 0, 29], config={**ONEPASS, "SOLVE": "squaring",
    "DIAG_BF16": True}, extra="-onepass-squaring")  # fmt: skip
add(Problem(1, 45, 1, 1, 24, 40, 1, Gate.CHANNEL), config={**ONEPASS, "SAFE_DIAG": False}, extra="-onepass-unguarded")
# KDA's stage 1 storing P = β ⊙ K ⊙ e^γ and T (WU = "recomputed"), the state pass forming V_new = T (β ⊙ V − P S):
# one-pass and "blocks" stage 1 (1, 2 and 4 sub-chunks), both layouts, pointer and TMA tiles (rows past a packed
# sequence's end are the next one's), the warp-specialised loop, unfused, segments; T = 1, odd T, grouped value heads,
# K != V, K not a power of two, varlen with an empty sequence, no initial state
KREC = {**ONEPASS, "WU": "recomputed", "h_BV": 16}
for layout in ("kv", "vk"):
    add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.CHANNEL), config={**KREC, "STATE_LAYOUT": layout},
        extra=f"-onepass-wurec-{layout}")  # fmt: skip
    add(Problem(1, 0, 1, 2, 32, 48, 4, Gate.CHANNEL, True), seq_lens=[1, 40, 0, 33], config={**KREC,
        "STATE_LAYOUT": layout, "STATE_TMA": True}, extra=f"-onepass-wurec-{layout}-tma")  # fmt: skip
add(Problem(2, 1, 2, 2, 32, 32, 2, Gate.CHANNEL), config={**KREC, "STATE_LAYOUT": "vk", "STATE_TMA": True},
    extra="-onepass-wurec-tma")  # fmt: skip
add(Problem(1, 33, 1, 2, 16, 32, 1, Gate.CHANNEL), h0=False, config={**KREC, "BT": 16}, extra="-onepass1-wurec")
add(Problem(1, 70, 1, 2, 64, 32, 1, Gate.CHANNEL), config={**KREC, "BT": 64, "BC": 32, "intra_BK": 32,
    "STATE_TMA": True, "h_BV": 32}, extra="-onepass-BC32-wurec-tma")  # fmt: skip
add(Problem(1, 37, 1, 1, 24, 40, 1, Gate.CHANNEL), config={**KREC, "STATE_TMA": True}, extra="-onepass-wurec-K24")
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.CHANNEL), config={**SMALL, "WU": "recomputed", "h_BV": 16},
    extra="-blocks-wurec")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.CHANNEL, True), seq_lens=[70, 0, 45], config={"BT": 64, "BC": 16,
    "WU": "recomputed", "h_BV": 16, "STATE_LAYOUT": "vk", "STATE_TMA": True}, extra="-blocks4-wurec-tma")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.CHANNEL, True), seq_lens=[40, 0, 29], config={**KREC, "STATE_TMA": True,
    "STATE_LAYOUT": "vk", "h_num_stages": 2, "STATE_LOOP": "specialized"}, extra="-onepass-wurec-ws")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.CHANNEL, True), seq_lens=[40, 0, 29], config={**KREC, "FUSE_OUTPUT": False,
    "STATE_TMA": True}, extra="-onepass-wurec-unfused")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.CHANNEL, True), seq_lens=[70, 0, 45], config={**KREC, "SEG_CHUNKS": 2,
    "STATE_LAYOUT": "vk"}, extra="-onepass-wurec-segments")  # fmt: skip
add(Problem(2, 70, 2, 2, 32, 32, 1, Gate.CHANNEL), config={**KREC, "SEG_CHUNKS": 1, "STATE_TMA": True,
    "FUSE_OUTPUT": False}, extra="-onepass-wurec-segments-unfused")  # fmt: skip
# the diagonal blocks' inverse by repeated squaring (SOLVE = "squaring"): 1, 2 and 4 sub-chunks, blocks_split
for gate in Gate:
    sq = {"SOLVE": "squaring", "BC": 16}
    add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config={**sq, "BT": 32}, extra="-squaring2")
    add(Problem(1, 0, 1, 2, 32, 32, 3, gate, True), seq_lens=[70, 0, 45], config={**sq, "BT": 64}, extra="-squaring4")
add(Problem(1, 20, 1, 1, 32, 32, 1, Gate.SCALAR), config={"BT": 16, "BC": 16, "SOLVE": "squaring"}, extra="-squaring1")
add(Problem(1, 50, 1, 2, 32, 32, 1, Gate.CHANNEL), config={"BT": 64, "BC": 16, "SOLVE": "squaring",
    "INTRA": "blocks_split"}, extra="-squaring-split")  # fmt: skip
# the state pass forming V_new = T (β ⊙ (V − e^γ ⊙ K S)) from stage 1's inverse T (WU) and A_qk from q and k (AQK)
# itself, both layouts; and its tiles through TMA descriptors (K a power of two, h_BV dividing V: the descriptor path
# runs, and in a packed batch the rows past a sequence's end are the next sequence's tokens)
RECOMP = {"BT": 32, "BC": 16, "FUSE_OUTPUT": True, "h_BV": 16}
for gate in (Gate.NONE, Gate.SCALAR):
    for wu, aqk in (("recomputed", "stored"), ("recomputed", "recomputed"), ("stored", "recomputed")):
        for layout in ("kv", "vk"):
            rc = {**RECOMP, "WU": wu, "AQK": aqk, "STATE_LAYOUT": layout}
            tag = f"-wu{wu[:3]}-aqk{aqk[:3]}-{layout}"
            add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config=rc, extra=tag)  # odd T, grouped value heads, K != V
            add(Problem(1, 0, 1, 2, 32, 48, 4, gate, True), seq_lens=[1, 40, 0, 33], config={**rc, "STATE_TMA": True},
                extra=f"{tag}-tma")  # fmt: skip
    both = {**RECOMP, "WU": "recomputed", "AQK": "recomputed", "STATE_LAYOUT": "vk", "STATE_TMA": True}
    add(Problem(2, 1, 2, 2, 32, 32, 2, gate), config=both, extra="-recomputed-tma")  # T = 1
    # 4 sub-chunks (T's upper blocks stored as zeros), the squaring inverse; 1 sub-chunk, no initial state
    add(Problem(1, 70, 1, 2, 32, 32, 1, gate), config={**both, "BT": 64, "AQK": "stored", "SOLVE": "squaring"},
        extra="-recomputed-tma-BT64")  # fmt: skip
    add(Problem(1, 33, 1, 2, 16, 32, 1, gate), h0=False, config={**both, "BT": 16, "STATE_TMA": False},
        extra="-recomputed-BT16-noh0")  # fmt: skip
    # W, U and A_qk stored, tiles by TMA (q scaled in registers, and q, k as loaded); the warp-specialised loop
    add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config={**SMALL, "STATE_TMA": True, "STATE_LAYOUT": "vk", "h_BV": 16},
        extra="-tma-vk")  # fmt: skip
    add(Problem(1, 0, 1, 2, 32, 32, 3, gate, True), seq_lens=[40, 0, 29], config={**SMALL, "STATE_TMA": True,
        "QK_DIRECT": True, "STATE_LAYOUT": "vk", "h_BV": 16, "h_num_stages": 2, "STATE_LOOP": "specialized"},
        extra="-tma-vk-ws")  # fmt: skip
    # unfused: the chunk states and V_new stored for the output stage
    add(Problem(1, 0, 1, 2, 32, 32, 3, gate, True), seq_lens=[40, 0, 29], config={**SMALL, "STATE_TMA": True,
        "FUSE_OUTPUT": False, "h_BV": 16}, extra="-tma-unfused")  # fmt: skip
    # TMA asked for where K is no power of two: pointer tiles (and the loop not specialised)
    add(Problem(1, 37, 1, 1, 24, 40, 1, gate), config={**both, "h_BV": 32, "STATE_LOOP": "specialized"},
        extra="-recomputed-tma-K24")  # fmt: skip
# the scalar gate's rows loaded a chunk ahead (GATE_LOADS = "prefetched"): V_new from W, U or from T, A_qk stored or
# recomputed, both layouts, pointer and TMA tiles, the warp-specialised loop, unfused, segments; T = 1, odd T, grouped
# value heads, K != V, varlen batches with an empty sequence (first: no gate row before it is read) and of one token
PF = {"BT": 32, "BC": 16, "h_BV": 16, "GATE_LOADS": "prefetched"}
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.SCALAR), config=PF, extra="-gatepf")
add(Problem(2, 1, 2, 2, 32, 32, 2, Gate.SCALAR), config={**PF, "STATE_LAYOUT": "vk"}, extra="-gatepf-vk")
add(Problem(1, 0, 1, 2, 32, 48, 4, Gate.SCALAR, True), seq_lens=[0, 40, 1, 33], config={**PF, "WU": "recomputed",
    "STATE_LAYOUT": "vk", "STATE_TMA": True}, extra="-gatepf-wurec-vk-tma")  # fmt: skip
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.SCALAR), config={**PF, "WU": "recomputed", "AQK": "recomputed"},
    extra="-gatepf-wurec-aqkrec-kv")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.SCALAR, True), seq_lens=[40, 0, 32], config={**PF, "STATE_TMA": True,
    "QK_DIRECT": True, "STATE_LAYOUT": "vk", "h_num_stages": 2, "STATE_LOOP": "specialized"},
    extra="-gatepf-tma-vk-ws")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 3, Gate.SCALAR, True), seq_lens=[70, 0, 45], config={**PF, "FUSE_OUTPUT": False,
    "SEG_CHUNKS": 2}, extra="-gatepf-segments")  # fmt: skip
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.CHANNEL), config={**SMALL, "STATE_TMA": True, "STATE_LAYOUT": "vk",
    "h_BV": 16}, extra="-tma-vk")  # fmt: skip
add(Problem(1, 0, 1, 2, 32, 32, 4, Gate.CHANNEL, True), seq_lens=[1, 40, 0, 33], config={**SMALL, "STATE_TMA": True,
    "STATE_LAYOUT": "vk", "h_BV": 16, "STATE_LOOP": "specialized"}, extra="-tma-vk-ws")  # fmt: skip
# the unfused state pass storing each chunk's state and V_new through TMA descriptors (STATES_TMA): kv and vk, two value
# tiles, odd T (a partial last chunk by pointers), grouped heads, K != V, varlen with an empty sequence and a one-token
# one, the segmented pass's phase 3 (with TMA loads too), KDA's recomputed W and U; K = 24: pointer stores
ST = {"BT": 32, "BC": 16, "h_BV": 16, "FUSE_OUTPUT": False, "STATES_TMA": True}
for gate in Gate:
    for layout in ("kv", "vk"):
        add(Problem(2, 45, 2, 4, 32, 48, 2, gate), config={**ST, "STATE_LAYOUT": layout}, extra=f"-states-tma-{layout}")
    add(Problem(1, 0, 1, 2, 32, 32, 4, gate, True), seq_lens=[1, 40, 0, 33], config={**ST, "STATE_LAYOUT": "vk",
        "STATE_TMA": True}, extra="-states-tma-loads")  # fmt: skip
    add(Problem(1, 0, 1, 2, 32, 32, 3, gate, True), seq_lens=[70, 0, 45], config={**ST, "SEG_CHUNKS": 2},
        extra="-states-tma-segments")  # fmt: skip
add(Problem(1, 37, 1, 1, 24, 40, 1, Gate.SCALAR), config=ST, extra="-states-tma-K24")
add(Problem(2, 45, 2, 4, 32, 48, 2, Gate.CHANNEL), config={**ST, "INTRA": "onepass", "WU": "recomputed",
    "STATE_TMA": True, "STATE_LAYOUT": "vk"}, extra="-states-tma-onepass-wurec")  # fmt: skip
# head dims that are not powers of two (padded tiles, masked channels), fused and unfused
add(Problem(1, 20, 1, 2, 24, 40, 1, Gate.CHANNEL), config={"BT": 16, "BC": 16, "FUSE_OUTPUT": True}, extra="-fused")
add(Problem(1, 37, 1, 1, 100, 72, 1, Gate.SCALAR), config=SMALL)
add(Problem(1, 19, 1, 1, 8, 4, 1, Gate.NONE), config={"BT": 16, "BC": 16})


@pytest.mark.parametrize("intra", ["blocks", "rows", "blocks_split", "onepass"])
@pytest.mark.parametrize("BC", [16, 32])
def test_kda_guarded_diagonal_under_extreme_decay(BC: int, intra: str) -> None:
    """Per-step log gates down to −60: diagonal blocks' half spans exceed 80 nats, so the guarded default takes the
    exact element-wise path (and the off-diagonal blocks' reference points keep every factor <= 1)."""
    p = Problem(1, 50, 1, 1, 16, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=21, gate_min=-60.0)
    check(p, x, {"BT": 32, "BC": BC, "INTRA": intra})


@pytest.mark.parametrize("intra", ["blocks", "onepass"])
@pytest.mark.parametrize("BC", [16, 32])
def test_kda_recomputed_under_extreme_decay(BC: int, intra: str) -> None:
    """The same decays with stage 1 storing P and T (WU = "recomputed"): the exact pass of the flagged chunks stores
    them too, and P's rows underflow to 0 where e^γ does."""
    p = Problem(1, 50, 1, 1, 16, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=21, gate_min=-60.0)
    check(p, x, {"BT": 32, "BC": BC, "INTRA": intra, "WU": "recomputed", "h_BV": 16, "STATE_TMA": True})


@pytest.mark.parametrize(("problem", "seq_lens", "h0", "config"), list(CASES.values()), ids=list(CASES))
def test_chunk_matches_loop(problem: Problem, seq_lens: list[int] | None, h0: bool, config: dict | None) -> None:
    x = make_inputs(problem, seed=3, seq_lens=seq_lens, initial_state=h0, gate_min=-5.0)
    check(problem, x, config)


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_float16(gate: Gate) -> None:
    p = Problem(2, 40, 1, 2, 32, 32, 2, gate)
    x = make_inputs(p, dtype=torch.float16, seed=4)
    check(p, x, SMALL)


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_no_final_state(gate: Gate) -> None:
    p = Problem(1, 20, 1, 1, 16, 16, 1, gate)
    x = make_inputs(p, seed=6)
    o, s = run(CHUNK[gate], x, SMALL, final=False)
    assert s is None
    o_ref, _ = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
    assert rel_err(o, o_ref) < TOL[torch.float32]


def random_configs(gate: Gate, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` configs drawn from the whole legal space (BC <= BT; the documented-unsafe unguarded KDA diagonal,
    SAFE_DIAG = False, with BC = 64 excluded: it is tested to fail loudly below)."""
    legal = KERNELS[CHUNK[gate]].legal_params()
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        cfg = {name: rng.choice(values) for name, values in legal.items()}
        if cfg["BC"] > cfg["BT"] or (cfg.get("SAFE_DIAG") is False and cfg["BC"] == 64):
            continue
        if cfg["INTRA"] != "rows" and cfg["BT"] // cfg["BC"] > 4:
            continue
        if cfg["INTRA"] in ("blocks", "blocks_split") and cfg["intra_num_warps"] > 4:
            continue
        if (cfg["INTRA"] == "onepass" and cfg["BT"] // cfg["BC"] > 2) or (
            cfg["SOLVE"] == "squaring" and cfg["BC"] != 16
        ):
            continue
        if cfg["WU"] == "recomputed" and cfg["INTRA"] not in ("blocks", "onepass"):
            continue
        if cfg["AQK"] == "recomputed" and (cfg["INTRA"] not in ("blocks", "blocks_split") or not cfg["FUSE_OUTPUT"]):
            continue
        out.append(cfg)
    return out


SAMPLED = [(gate, i, cfg) for gate in Gate for i, cfg in enumerate(random_configs(gate, 8, seed=2026))]


@pytest.mark.parametrize(
    ("gate", "cfg"),
    [(g, c) for g, _, c in SAMPLED],
    ids=[f"{g.value}-{i}-BT{c['BT']}-BC{c['BC']}{'-fused' if c['FUSE_OUTPUT'] else ''}" for g, i, c in SAMPLED],
)
def test_sampled_configs(gate: Gate, cfg: dict[str, Any]) -> None:
    p = Problem(1, 0, 1, 2, 32, 32, 3, gate, True)
    x = make_inputs(p, seed=8, seq_lens=[cfg["BT"] + 3, 5, cfg["BT"] - 1], gate_min=-5.0)
    check(p, x, cfg)


def test_unguarded_diagonal_fails_loudly_when_unsafe() -> None:
    """SAFE_DIAG = False (always the reference-point dot) with BC = 64 under per-step log gates down to −5:
    float32 exp overflows -> inf/NaN, never a silently small error (the correctness gate rejects it)."""
    p = Problem(1, 64, 1, 1, 16, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=9, gate_min=-5.0)
    for intra in ("blocks", "rows"):
        o, s = run("chunk_kda", x, {"BT": 64, "BC": 64, "SAFE_DIAG": False, "INTRA": intra})
        assert s is not None
        assert not (torch.isfinite(o).all() and torch.isfinite(s).all())


def test_bc_larger_than_bt_is_rejected() -> None:
    p = Problem(1, 8, 1, 1, 16, 16, 1, Gate.NONE)
    x = make_inputs(p, seed=1)
    with pytest.raises(ValueError, match="BC"):
        run("chunk_delta_rule", x, {"BT": 16, "BC": 32})


def test_blocks_variant_rejects_eight_subchunks() -> None:
    p = Problem(1, 8, 1, 1, 16, 16, 1, Gate.NONE)
    x = make_inputs(p, seed=1)
    with pytest.raises(ValueError, match="INTRA='blocks'"):
        run("chunk_delta_rule", x, {"BT": 128, "BC": 16, "INTRA": "blocks"})


@pytest.mark.parametrize("intra", ["blocks", "blocks_split"])
def test_blocks_variant_refuses_eight_warps(intra: str) -> None:
    """INTRA 'blocks' at 8 warps crashed compiled (illegal memory access, H200 and H100): refused before launch."""
    p = Problem(1, 8, 1, 1, 16, 16, 1, Gate.NONE)
    x = make_inputs(p, seed=1)
    with pytest.raises(ValueError, match="at most 4 warps"):
        run("chunk_delta_rule", x, {"INTRA": intra, "intra_num_warps": 8})
    o, _ = run("chunk_delta_rule", x, {"INTRA": intra, "intra_num_warps": 4})  # the bound itself runs
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_defaults_are_legal(gate: Gate) -> None:
    spec = KERNELS[CHUNK[gate]]
    legal = spec.legal_params()
    for K, V in [(16, 16), (64, 128), (256, 256), (100, 72)]:
        cfg = spec.default_config(K, V)
        assert set(cfg) == set(legal)
        assert all(cfg[name] in legal[name] for name in cfg)
        assert cfg["BC"] <= cfg["BT"]
        if gate is Gate.CHANNEL:
            assert cfg["SAFE_DIAG"] is True  # safe for every gate strength


def test_register_caps_are_launch_options() -> None:
    """``intra_maxnreg`` / ``h_maxnreg`` reach stage 1's, the state pass's and phase 1's launches as Triton's
    ``maxnreg`` (a GPU compile obeys it: test_chunk_compile.py), a stage without a cap launches without one, and the
    interpreter, which drops the option, computes the reference's result."""
    from dtune.kernels.chunk.call import prepare_call
    from dtune.kernels.chunk.state import transitions_tile

    p = Problem(1, 70, 1, 2, 32, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=4)
    caps = {**SMALL, "intra_maxnreg": 128, "h_maxnreg": 168, "SEG_CHUNKS": 1, "FUSE_OUTPUT": False}
    cfg = KERNELS[CHUNK[p.gate]].check_config(p.K, p.V, caps)
    call = prepare_call(x["q"], x["k"], x["v"], x["g"], x["beta"], "scalar", 0.5, None, False, None, cfg)
    assert call.warps("intra")["maxnreg"] == 128 and call.warps("h")["maxnreg"] == 168
    assert "maxnreg" not in call.warps("o")
    assert transitions_tile(cfg, p.K, p.V)[1]["maxnreg"] == 168
    default = KERNELS[CHUNK[p.gate]].check_config(p.K, p.V, SMALL)
    assert "maxnreg" not in {**transitions_tile(default, p.K, p.V)[1], **call.warps("o")}
    check(p, x, caps)


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_plan_stages_produce_outputs(fuse: bool) -> None:
    p = Problem(1, 40, 1, 2, 32, 32, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=12)
    spec = KERNELS["chunk_kda"]
    cfg = spec.check_config(32, 32, {**SMALL, "FUSE_OUTPUT": fuse})
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], "channel", 32**-0.5, x["initial_state"], True, None, cfg)
    stages, (o, s) = chunk_mod.plan(*args)
    assert [st.name for st in stages] == (["intra", "state+output"] if fuse else ["intra", "state", "output"])
    assert all(st.flops > 0 and st.bytes > 0 for st in stages)
    for st in stages:
        st.run()
    o_ref, s_ref = naive_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    assert s is not None and s_ref is not None
    assert rel_err(o, o_ref) < TOL[torch.float32] and rel_err(s, s_ref) < TOL[torch.float32]


@pytest.mark.parametrize("gate", [Gate.SCALAR, Gate.CHANNEL], ids=["scalar", "channel"])
def test_bfloat16_gate(gate: Gate) -> None:
    """Gates may come in bfloat16 (the kernels read them as float32); the reference sees the same rounded gates."""
    p = Problem(1, 45, 1, 1, 32, 32, 1, gate)
    x = make_inputs(p, seed=13)
    x["g"] = x["g"].to(torch.bfloat16)
    check(p, x, SMALL)


def with_full_forgets(x: dict[str, Any], gate: Gate, dense: bool, seed: int) -> dict[str, Any]:
    """Gates of −inf (full forgets): 10% of entries at random, the first token, and with ``dense`` a KDA key channel
    that forgets at every token (or, for the scalar gate, a whole chunk of full forgets: tokens 32..63)."""
    g = x["g"].clone()
    gen = torch.Generator().manual_seed(seed)
    g = g.masked_fill(torch.rand(g.shape, generator=gen) < 0.1, float("-inf"))
    g[:, 0] = float("-inf")
    if dense and gate is Gate.CHANNEL:
        g[..., 3] = float("-inf")
    elif dense:
        g[:, 32:64] = float("-inf")
    return {**x, "g": g}


INF_CONFIGS = {
    "blocks": {"BT": 32, "BC": 16},
    "blocks-BT64-unfused": {"BT": 64, "BC": 16, "FUSE_OUTPUT": False},
    "rows": {"BT": 32, "BC": 16, "INTRA": "rows"},
    "rows-BC32-vk": {"BT": 64, "BC": 32, "INTRA": "rows", "STATE_LAYOUT": "vk", "h_BV": 16},
    "segments": {"BT": 16, "BC": 16, "SEG_CHUNKS": 2, "h_BV": 16, "FUSE_OUTPUT": False},
    "blocks_split-BT64": {"BT": 64, "BC": 16, "INTRA": "blocks_split"},
    "onepass-squaring": {"BT": 32, "BC": 16, "INTRA": "onepass", "SOLVE": "squaring"},
    "recomputed-tma": {"BT": 32, "BC": 16, "WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True, "h_BV": 16},
    "gate-prefetched": {
        "BT": 16,
        "BC": 16,
        "WU": "recomputed",
        "STATE_LAYOUT": "vk",
        "h_BV": 16,
        "GATE_LOADS": "prefetched",
    },
}


@pytest.mark.parametrize("name", list(INF_CONFIGS))
@pytest.mark.parametrize("gate", [Gate.SCALAR, Gate.CHANNEL], ids=["scalar", "channel"])
def test_full_forget_gates(gate: Gate, name: str) -> None:
    """A log gate of −inf is a valid full forget: every path gives the float64 loop's result (no NaN from
    −inf − (−inf) in the cumulative gates; the guarded KDA diagonal sees a finite span)."""
    cfg = dict(INF_CONFIGS[name])
    if cfg.get("INTRA") == "onepass" and gate is not Gate.CHANNEL:
        cfg["INTRA"] = "blocks"  # onepass is KDA's: the scalar gate runs the squaring inverse in "blocks"
    if gate is Gate.CHANNEL:  # KDA stores W, U and A_qk (its decays are per key channel)
        cfg.pop("WU", None)
        cfg.pop("AQK", None)
        cfg.pop("GATE_LOADS", None)  # (the scalar gate's)
    p = Problem(1, 0, 1, 2, 32, 16, 3, gate, True)
    x = with_full_forgets(make_inputs(p, seed=41, seq_lens=[70, 0, 41], gate_min=-3.0), gate, True, seed=42)
    check(p, x, cfg)


@pytest.mark.parametrize("intra", ["blocks", "rows"])
def test_full_forgets_unguarded_diagonal(intra: str) -> None:
    """SAFE_DIAG = False (one dot per diagonal block): each −inf step counts as 20 nats of the block's half span, so
    isolated full forgets stay exact at BC = 16 (a key channel forgetting at every token does not: see the docs)."""
    p = Problem(1, 70, 1, 1, 32, 16, 1, Gate.CHANNEL)
    x = with_full_forgets(make_inputs(p, seed=43, gate_min=-3.0), Gate.CHANNEL, False, seed=44)
    check(p, x, {"BT": 32, "BC": 16, "SAFE_DIAG": False, "INTRA": intra})


def test_cu_seqlens_read_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op validates cu_seqlens on the host once (check_inputs) and the chunk tables reuse that copy: the
    launcher's own device-to-host read never runs on the op's path (it serves direct plan() callers)."""
    import dtune.kernels.chunk.call as call_mod

    def no_second_copy(cu_seqlens: torch.Tensor) -> list[int]:
        raise AssertionError("cu_seqlens copied to the host a second time")

    p = Problem(1, 0, 1, 1, 16, 16, 3, Gate.SCALAR, True)
    x = make_inputs(p, seed=45, seq_lens=[40, 0, 9])
    monkeypatch.setattr(call_mod, "host_offsets", no_second_copy)
    check(p, x, {"BT": 16, "BC": 16, "SEG_CHUNKS": 1, "h_BV": 16})
    with pytest.raises(AssertionError, match="second time"):
        cfg = KERNELS["chunk_gated_delta_rule"].check_config(16, 16, None)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], "scalar", 0.25, None, True, x["cu_seqlens"], cfg)
        chunk_mod.plan(*args)


@pytest.mark.parametrize("intra", ["blocks", "blocks_split", "rows", "onepass"])
@pytest.mark.parametrize("gate", [Gate.SCALAR, Gate.CHANNEL], ids=["scalar", "channel"])
def test_mild_gates_reach_far_blocks(gate: Gate, intra: str) -> None:
    """Log gates down to −0.1: the blocks far below the diagonal (4 sub-chunks of 16; "onepass": 2 of 32) carry
    weight, which under the usual strong gates (−5 per step, e^-35 across a sub-chunk) they do not, so errors there
    would not show."""
    if intra == "onepass" and gate is not Gate.CHANNEL:
        pytest.skip("onepass is KDA's")
    p = Problem(1, 0, 1, 2, 32, 16, 2, gate, True)
    x = make_inputs(p, seed=46, seq_lens=[70, 45], gate_min=-0.1)
    check(p, x, {"BT": 64, "BC": 32 if intra == "onepass" else 16, "INTRA": intra})


@pytest.mark.parametrize(
    ("gate", "cfg"),
    [
        (Gate.NONE, {"BT": 32, "BC": 16, "SOLVE": "squaring"}),
        (Gate.SCALAR, {"BT": 64, "BC": 16, "SOLVE": "squaring"}),
        (Gate.CHANNEL, {"BT": 32, "BC": 16, "SOLVE": "squaring", "INTRA": "onepass"}),
        (Gate.CHANNEL, {"BT": 64, "BC": 16, "SOLVE": "squaring", "INTRA": "blocks_split"}),
        (Gate.CHANNEL, {"BT": 32, "BC": 32, "INTRA": "onepass"}),
    ],
    ids=["dn-BC16", "gdn-BT64", "kda-onepass", "kda-split", "kda-onepass-subst-BC32"],
)
def test_inverse_with_nearly_repeated_keys(gate: Gate, cfg: dict[str, Any]) -> None:
    """Keys within 5% of one direction, beta near 1, mild gates: (I + A_kk) is far from the identity and every power
    of its strictly lower part matters (under random keys and strong gates N^8 is negligible), so each factor of the
    squaring inverse shows."""
    p = Problem(1, 45, 1, 1, 32, 32, 1, gate)
    x = make_inputs(p, seed=49, gate_min=-0.02)
    gen = torch.Generator().manual_seed(50)
    k0 = torch.randn(1, 1, 1, 32, generator=gen)
    x["k"] = torch.nn.functional.normalize(k0 + 0.05 * torch.randn(x["k"].shape, generator=gen), dim=-1)
    x["beta"] = 0.9 + 0.1 * torch.rand(x["beta"].shape, generator=gen)
    check(p, x, cfg)


def test_onepass_float16_keeps_float32_diagonal() -> None:
    """DIAG_BF16 only lowers the diagonal's operands for bfloat16 inputs: float16's range (e^±11) would overflow the
    factors (up to e^±80); with float16 inputs and strong gates the result stays at float16's accuracy."""
    p = Problem(1, 45, 1, 2, 32, 32, 1, Gate.CHANNEL)
    x = make_inputs(p, dtype=torch.float16, seed=48, gate_min=-5.0)
    check(p, x, {**ONEPASS, "DIAG_BF16": True})


def test_squaring_needs_16_row_blocks() -> None:
    p = Problem(1, 8, 1, 1, 16, 16, 1, Gate.NONE)
    with pytest.raises(ValueError, match="squaring"):
        run("chunk_delta_rule", make_inputs(p, seed=1), {"BT": 32, "BC": 32, "SOLVE": "squaring"})


def test_onepass_is_kda_only() -> None:
    p = Problem(1, 8, 1, 1, 16, 16, 1, Gate.SCALAR)
    with pytest.raises(ValueError, match="INTRA"):
        run("chunk_gated_delta_rule", make_inputs(p, seed=1), {"INTRA": "onepass"})
    with pytest.raises(ValueError, match="onepass"):
        run("chunk_kda", make_inputs(Problem(1, 8, 1, 1, 16, 16, 1, Gate.CHANNEL), seed=1), {"BT": 64, "BC": 16,
            "INTRA": "onepass"})  # fmt: skip


def test_forward_with_intermediates_documented_layouts() -> None:
    """The intermediates a backward pass recomputes from have the documented shapes and meaning: per chunk,
    O = q̃ S_c + A_qk V_new rebuilt from them alone gives the op's output (KDA, unfused, varlen)."""
    p = Problem(1, 0, 1, 2, 32, 16, 2, Gate.CHANNEL, True)
    x = make_inputs(p, seed=47, seq_lens=[40, 21], gate_min=-1.0)
    cfg = KERNELS["chunk_kda"].check_config(32, 16, {"BT": 16, "BC": 16, "FUSE_OUTPUT": False})
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], "channel", 32**-0.5, x["initial_state"], True)
    res = chunk_mod.forward_with_intermediates(*args, x["cu_seqlens"], cfg)
    it, tabs = res.intermediates, res.call.tables
    NC, tokens = 3 + 2, 61
    assert it.w.shape == (tokens, 2, 32) and it.u.shape == (tokens, 2, 16) and it.aqk.shape == (tokens, 2, 16)
    assert it.qg is not None and it.kg is not None and it.gout is not None and it.gout.shape == (NC, 2, 32)
    assert it.h is not None and it.h.shape == (NC, 2, 32, 16) and it.v_new is not None
    assert tabs.chunk_info is not None
    o = torch.empty_like(res.o)
    for c, (start, end) in enumerate(tabs.chunk_info.tolist()):
        rows = slice(start, min(start + 16, end))
        n = rows.stop - rows.start
        for hv in range(2):
            qg, aqk = it.qg[rows, hv].float(), it.aqk[rows, hv, :n].float()
            o[0, rows, hv] = qg @ it.h[c, hv].float() + aqk @ it.v_new[rows, hv].float()
    assert rel_err(o, res.o) < 1e-5


SEG_RECOMP = [
    (gate, wu, aqk, layout, tma)
    for gate in (Gate.NONE, Gate.SCALAR)
    for wu, aqk, layout, tma in (
        ("recomputed", "stored", "vk", True),
        ("recomputed", "recomputed", "kv", False),
        ("stored", "recomputed", "vk", True),
    )
]


@pytest.mark.parametrize(
    ("gate", "wu", "aqk", "layout", "tma"),
    SEG_RECOMP,
    ids=[f"{g.value}-wu{w[:3]}-aqk{a[:3]}-{lay}{'-tma' if t else ''}" for g, w, a, lay, t in SEG_RECOMP],
)
def test_segmented_pass_recomputed(gate: Gate, wu: str, aqk: str, layout: str, tma: bool) -> None:
    """The sequence-parallel pass with V_new / A_qk formed in the state pass: phase 1's transitions from T (the M
    columns' values are 0), phase 3 per segment, TMA tiles in phase 3. Mild gates (down to −0.1 per step), so that a
    wrong transition shows (tests/kernels/test_chunk_seqpar.py says why); three segments in the 70-token sequence."""
    p = Problem(1, 0, 1, 2, 16, 32, 5, gate, True)
    x = make_inputs(p, seed=51, seq_lens=[70, 5, 0, 33, 1], gate_min=-0.1)
    cfg = {"BT": 16, "BC": 16, "SEG_CHUNKS": 2, "h_BV": 16, "FUSE_OUTPUT": True}
    check(p, x, {**cfg, "WU": wu, "AQK": aqk, "STATE_LAYOUT": layout, "STATE_TMA": tma})


@pytest.mark.parametrize("gate", [Gate.NONE, Gate.SCALAR], ids=["none", "scalar"])
def test_recomputed_with_mild_gates(gate: Gate) -> None:
    """Log gates down to −0.1: every entry of T and of A_qk across the chunk's 4 sub-chunks carries weight (under the
    strong gates of the case table the far blocks are ~e^-35), so an error in T's far blocks or A_qk's decay shows."""
    p = Problem(1, 0, 1, 2, 32, 16, 2, gate, True)
    x = make_inputs(p, seed=52, seq_lens=[70, 45], gate_min=-0.1)
    check(p, x, {"BT": 64, "BC": 16, "WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True, "h_BV": 16})


@pytest.mark.parametrize("gate", [Gate.NONE, Gate.SCALAR], ids=["delta", "gated"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_recomputed_w_u_with_the_output_stage(gate: Gate, tma: bool) -> None:
    """WU = "recomputed" without the fused output: the state pass forms V_new from T and stores it with the chunk
    states for the output stage (as the training forward does with fh_U), grouped heads, K != V, odd length."""
    p = Problem(2, 37, 2, 4, 16, 32, 2, gate)
    x = make_inputs(p, seed=3, gate_min=-8.0)
    check(p, x, {"BT": 32, "BC": 16, "WU": "recomputed", "FUSE_OUTPUT": False, "STATE_TMA": tma, "h_BV": 16})


@pytest.mark.parametrize(
    ("gate", "cfg", "match"),
    [
        (Gate.SCALAR, {"WU": "recomputed", "INTRA": "rows"}, "WU='recomputed'"),
        (Gate.SCALAR, {"WU": "recomputed", "INTRA": "blocks_split", "BT": 64}, "WU='recomputed'"),
        (Gate.NONE, {"AQK": "recomputed", "FUSE_OUTPUT": False}, "FUSE_OUTPUT"),
        (Gate.SCALAR, {"AQK": "recomputed", "INTRA": "rows"}, "AQK='recomputed'"),
        (Gate.CHANNEL, {"WU": "recomputed", "INTRA": "rows"}, "WU='recomputed'"),
        (Gate.CHANNEL, {"AQK": "recomputed"}, "AQK=.recomputed. is not one of"),
    ],
    ids=["wu-rows", "wu-split", "aqk-unfused", "aqk-rows", "wu-kda-rows", "aqk-kda"],
)
def test_recomputed_needs_blocks_and_fused_output(gate: Gate, cfg: dict[str, Any], match: str) -> None:
    p = Problem(1, 8, 1, 1, 16, 16, 1, gate)
    with pytest.raises(ValueError, match=match):
        run(CHUNK[gate], make_inputs(p, seed=1), {"BT": 32, "BC": 16, "FUSE_OUTPUT": True, **cfg})


@pytest.mark.parametrize(
    ("gate", "overrides", "specialised"),
    [
        (Gate.SCALAR, {"WU": "recomputed"}, True),
        (Gate.CHANNEL, {}, True),
        (Gate.CHANNEL, {"WU": "recomputed", "INTRA": "onepass"}, False),  # its bf16 outputs came out inf on an H100
        (Gate.SCALAR, {"AQK": "recomputed", "WU": "recomputed"}, False),  # Triton 3.6 cannot split that loop
        (Gate.NONE, {"STATE_LAYOUT": "kv"}, False),
        (Gate.SCALAR, {"h_num_stages": 3}, False),  # NaN or inf outputs on an H100 (Triton 3.6)
        (Gate.CHANNEL, {"h_num_stages": 3}, False),
        (Gate.NONE, {"h_num_stages": 1}, False),  # never seen compiled
    ],
    ids=["gdn-recomputed", "kda", "kda-recomputed", "gdn-aqk", "dn-kv", "gdn-3-deep", "kda-3-deep", "dn-1-deep"],
)
def test_which_state_loops_are_warp_specialised(gate: Gate, overrides: dict[str, Any], specialised: bool) -> None:
    """``STATE_LOOP = "specialized"`` with TMA tiles: the loops Triton splits correctly get ``warp_specialize``, the
    others run as ``"range"`` (the interpreter ignores it: this is the only CPU check of the choice)."""
    from dtune.kernels.chunk.state import loop_options
    from dtune.kernels.config import GATE_CODES

    cfg = {"STATE_LAYOUT": "vk", "h_BV": 64, "STATE_TMA": True, "STATE_LOOP": "specialized", "h_num_stages": 2}
    full = KERNELS[CHUNK[gate]].check_config(128, 128, {**cfg, **overrides})
    code = GATE_CODES[gate.value]
    assert loop_options(full, tma=True, gate=code)["LOOP_WS"] is specialised
    assert loop_options(full, tma=False, gate=code)["LOOP_WS"] is False


# Compiled on a CUDA GPU (pytest -m gpu): what the interpreter cannot show. Warp specialisation (the interpreter runs
# the plain loop), TMA's hardware bounds and box splits, bfloat16 dots; grouped heads, odd T, packed sequences with an
# empty one and rows past each sequence's end, K = 96 (TMA falls back to pointers), the segmented pass.
GPU_VARIANTS: dict[str, dict[str, Any]] = {
    "wu": {"WU": "recomputed"},
    "wu-tma": {"WU": "recomputed", "STATE_TMA": True},
    "wu-tma-ws": {"WU": "recomputed", "STATE_TMA": True, "STATE_LOOP": "specialized", "h_num_stages": 2},
    "wu-aqk-tma-w8": {"WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True, "h_num_warps": 8},
    "wu-tma-BT64": {"WU": "recomputed", "STATE_TMA": True, "BT": 64, "SOLVE": "squaring", "intra_num_warps": 4},
    "tma": {"STATE_TMA": True},
    "tma-ws": {"STATE_TMA": True, "STATE_LOOP": "specialized", "h_num_stages": 2},
    # asked for the warp-specialised loop 3 deep, it runs "range" (specialised, its outputs came out NaN or inf)
    "tma-ws-3deep": {"STATE_TMA": True, "STATE_LOOP": "specialized", "h_num_stages": 3},
    # the scalar gate's rows loaded a chunk ahead in registers
    "wu-tma-gatepf": {"WU": "recomputed", "STATE_TMA": True, "GATE_LOADS": "prefetched"},
    "tma-ws-gatepf": {"STATE_TMA": True, "STATE_LOOP": "specialized", "h_num_stages": 2, "GATE_LOADS": "prefetched"},
    # phase 1 skipping the transitions a bound shows negligible (under these strong gates, every one)
    "wu-tma-segdecay": {"WU": "recomputed", "STATE_TMA": True, "GATE_LOADS": "prefetched", "SEG_DECAY": True},
    # register caps on stage 1 and the state pass (ptxas spills under them)
    "tma-maxnreg": {"STATE_TMA": True, "intra_maxnreg": 128, "h_maxnreg": 168},
    # KDA's one-pass stage 1 storing P and T, the state pass forming V_new from the v tile (asked for the
    # warp-specialised loop, it runs "range": specialised, its bfloat16 outputs came out inf)
    "kda-wu-tma": {"WU": "recomputed", "INTRA": "onepass", "STATE_TMA": True},
    "kda-wu-tma-ws": {
        "WU": "recomputed",
        "INTRA": "onepass",
        "STATE_TMA": True,
        "STATE_LOOP": "specialized",
        "h_num_stages": 2,
    },
}
GPU_BASE = {"BT": 32, "BC": 16, "STATE_LAYOUT": "vk", "h_BV": 64, "QK_DIRECT": True, "FUSE_OUTPUT": True}
# the same heads and head dims where possible, so that the cases share their compiled kernels
GPU_SHAPES: dict[str, tuple[Problem, list[int] | None, dict[str, Any]]] = {
    "B2-T777-H2-HV4-D128": (Problem(2, 777, 2, 4, 128, 128, 2, Gate.NONE), None, {}),
    "varlen-H2-HV4-D128": (Problem(1, 0, 2, 4, 128, 128, 5, Gate.NONE, True), [1, 700, 0, 333, 64], {}),
    "B1-T9000-seg": (Problem(1, 9000, 2, 4, 128, 128, 1, Gate.NONE), None, {"SEG_CHUNKS": 64}),
    "B2-T300-K96-V64": (Problem(2, 300, 2, 4, 96, 64, 2, Gate.NONE), None, {}),
}
BF16, F32 = torch.bfloat16, torch.float32
GPU_CASES = [
    (gate, v, shape, dt)
    for gate in Gate
    for v in GPU_VARIANTS
    for shape, dt in (
        ("B2-T777-H2-HV4-D128", BF16),
        ("varlen-H2-HV4-D128", BF16),
        ("B1-T9000-seg", BF16),
        ("B2-T300-K96-V64", BF16),
        ("B2-T777-H2-HV4-D128", F32),
    )
    if (gate is not Gate.CHANNEL or v in ("tma", "tma-ws", "tma-maxnreg", "kda-wu-tma", "kda-wu-tma-ws"))
    and (gate is Gate.CHANNEL or not v.startswith("kda-"))
    and (gate is Gate.SCALAR or not v.endswith(("gatepf", "segdecay")))
    and (v != "wu-tma-segdecay" or shape == "B1-T9000-seg")
    and (
        shape != "B1-T9000-seg"
        or v
        in (
            "wu-tma",
            "wu-tma-ws",
            "tma-ws",
            "wu-tma-gatepf",
            "tma-maxnreg",
            "kda-wu-tma",
            "kda-wu-tma-ws",
            "wu-tma-segdecay",
        )
    )
    and (shape != "B2-T300-K96-V64" or v in ("wu-tma", "tma-ws", "wu-tma-gatepf", "kda-wu-tma"))
    and (dt == BF16 or v in ("wu-tma-ws", "tma-ws", "tma-ws-gatepf", "kda-wu-tma-ws"))
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("gate", "variant", "shape", "dtype"),
    GPU_CASES,
    ids=[f"{g.value}-{v}-{s}-{str(d)[6:]}" for g, v, s, d in GPU_CASES],
)
def test_variants_compiled_match_reference(gate: Gate, variant: str, shape: str, dtype: torch.dtype) -> None:
    from dataclasses import replace

    from dtune.kernels.reference import chunk_reference

    from dtune.tune.space import load_space

    p, seq_lens, extra = GPU_SHAPES[shape]
    p = replace(p, gate=gate)
    kernel = CHUNK[gate]
    tol = load_space(kernel).tolerance["bf16" if dtype == torch.bfloat16 else "fp32"]
    x = make_inputs(p, dtype=dtype, device="cuda", seed=53, seq_lens=seq_lens, gate_min=-5.0)
    cfg = {**GPU_BASE, **extra, **GPU_VARIANTS[variant]}
    if gate is Gate.CHANNEL:
        cfg.pop("QK_DIRECT")
    o, s = run(kernel, x, cfg)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o_ref, s_ref = chunk_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw, chunk_size=16)
    assert s is not None and s_ref is not None
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.3g} (tolerance {tol})"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.3g} (tolerance {tol})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bfloat16", "float32"])
def test_seg_decay_skips_compiled(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SEG_DECAY`` compiled: under strong gates every transition of phase 1 is stored as zeros (the skip happens on
    the GPU, not only under the interpreter), with a head of weak gates (−0.001 per token) computed."""
    from dataclasses import replace

    from dtune.kernels.chunk import pipeline

    got: list[Any] = []
    real = pipeline.allocate_segments
    monkeypatch.setattr(pipeline, "allocate_segments", lambda call: got.append(real(call)) or got[-1])
    p, _, extra = GPU_SHAPES["B1-T9000-seg"]
    p = replace(p, gate=Gate.SCALAR)
    x = make_inputs(p, dtype=dtype, device="cuda", seed=54, gate_min=-5.0)
    assert x["g"] is not None
    x["g"][..., 1] = -0.001
    run(CHUNK[Gate.SCALAR], x, {**GPU_BASE, **extra, **GPU_VARIANTS["wu-tma-segdecay"]})
    m = got[0].transitions[:-1, :, :, p.V :]  # segments with a transition (the last has none), M columns
    strong = [h for h in range(p.HV) if h != 1]
    assert torch.all(m[:, strong] == 0), "strong gates: every transition skipped"
    assert m[:, 1].abs().amax(dim=(1, 2)).min() > 0, "weak gates: every transition computed"
