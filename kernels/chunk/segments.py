"""Phase 2 of the sequence-parallel state pass: the segments' entering states, sequentially over the few segments
of each sequence (one program per sequence, value head and V tile).

``S_start(s0) = h0`` (or 0), ``S_start(s + 1) = M_s S_start(s) + N_s`` with ``N_s``, ``M_s`` from phase 1
(``ext[s, hv] = [N_s | M_s]``, float32 ``[K, V + K]``). Two kernels (``SEG_COMBINE``):

* ``"tiles"`` (:func:`chunk_segment_starts_kernel`): the product runs over the key channels in tiles of ``BKJ``:
  each step stores ``S_start(s)`` (the phase-3 input) and reads its row tiles back after a barrier, so only
  ``[K, BKJ]`` of ``M_s`` and ``[K, BV]`` of state are live. Every step waits on about five dependent global
  round trips (N, then M and S tile by tile): ~6 µs per segment on the H200 (2026-11-30).
* ``"regs"`` (:func:`chunk_segment_starts_regs_kernel`): the state stays in registers from step to step and
  ``M_s`` is loaded whole (``[K, K]``) as one dot operand; ``M_s`` and ``N_s`` do not depend on the chain, so the
  software pipeline (``num_stages = 2``) loads step ``s + 1``'s while step ``s`` multiplies: a step is one
  tensor-core product and a store, bound by moving ``M_s`` (``4 K²`` bytes) into the SM. ``K <= 128`` (``M_s`` in
  shared memory); larger K runs ``"tiles"``.

The dot's precision is the call's (tf32 for 16-bit inputs, ``F32_DOT`` for float32 ones). A non-finite entering
state (NaN or inf from an earlier segment's values or the initial state) reaches the next one even where ``M_s`` was
skipped as zero (``SEG_DECAY``): the product takes it (``0 · inf`` is NaN), as it must. An empty sequence has
no segments: its final state is its initial state, stored here (every other final state is stored by phase 3, at
the end of the last segment).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from ..config import Config, next_power_of_2
from .buffers import Outputs, SegmentScratch
from .call import ChunkCall, tile

BKJ_COMBINE = 32  # key-channel tile of the product M_s S
REGS_MAX_K = 128  # "regs" holds M_s [K, K] float32 in shared memory (two pipeline stages): K <= 128


@triton.jit
def chunk_segment_starts_kernel(
    ext,
    h0,
    starts,
    ht,
    seq_segments,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BKJ: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    s0 = tl.load(seq_segments + i_n)
    s1 = tl.load(seq_segments + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]
    LD = V + K  # row stride of the extended state
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
    if s1 > s0:
        tl.store(starts + (s0.to(tl.int64) * HV + i_hv) * K * V + off_h, b_h, mask=m_h)
    elif STORE_HT:  # an empty sequence
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_h, b_h, mask=m_h)
    for s in range(s0, s1 - 1):
        e_b = ext + (s * HV + i_hv).to(tl.int64) * (K * LD)
        h_b = starts + (s * HV + i_hv).to(tl.int64) * (K * V)
        b_h = tl.load(e_b + o_k[:, None] * LD + o_v[None, :], mask=m_h, other=0)  # N_s
        tl.debug_barrier()  # S_start(s), stored just before, is visible to the whole CTA
        for j in range(0, K, BKJ):
            o_j = j + tl.arange(0, BKJ)
            m_j = o_j < K
            b_m = tl.load(e_b + o_k[:, None] * LD + V + o_j[None, :], mask=m_k[:, None] & m_j[None, :], other=0)
            b_s = tl.load(
                h_b + o_j[:, None] * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0, cache_modifier=".cg"
            )
            b_h += tl.dot(b_m, b_s, input_precision=DOT_PREC)
        tl.store(h_b + K * V * HV + off_h, b_h, mask=m_h)  # S_start(s + 1)


@triton.jit
def chunk_segment_starts_regs_kernel(
    ext,
    h0,
    starts,
    ht,
    seq_segments,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TRANS: tl.constexpr,
):
    """``SEG_COMBINE = "regs"``: ``S ← M_s S + N_s`` with S in registers, ``[K, BV]`` or transposed (``TRANS``:
    ``Sᵀ ← Sᵀ M_sᵀ + N_sᵀ``, the state the dot's left operand)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    s0 = tl.load(seq_segments + i_n)
    s1 = tl.load(seq_segments + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    LD = V + K  # row stride of the extended state
    if TRANS:
        m_h = m_v[:, None] & m_k[None, :]
        off_h = o_k[None, :] * V + o_v[:, None]  # [BV, BK]: S transposed
        off_n = o_k[None, :] * LD + o_v[:, None]  # N_s transposed
        off_m = o_k[None, :] * LD + V + o_k[:, None]  # [BK, BK]: element (j, i) is M_s[i, j]
        b_h = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        m_h = m_k[:, None] & m_v[None, :]
        off_h = o_k[:, None] * V + o_v[None, :]
        off_n = o_k[:, None] * LD + o_v[None, :]
        off_m = o_k[:, None] * LD + V + o_k[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    m_m = m_k[:, None] & m_k[None, :]
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
    if s1 > s0:
        tl.store(starts + (s0.to(tl.int64) * HV + i_hv) * K * V + off_h, b_h, mask=m_h)
    elif STORE_HT:  # an empty sequence
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_h, b_h, mask=m_h)
    for s in range(s0, s1 - 1):
        e_b = ext + (s * HV + i_hv).to(tl.int64) * (K * LD)
        b_m = tl.load(e_b + off_m, mask=m_m, other=0)
        b_n = tl.load(e_b + off_n, mask=m_h, other=0)
        if TRANS:
            b_h = tl.dot(b_h, b_m, b_n, input_precision=DOT_PREC)
        else:
            b_h = tl.dot(b_m, b_h, b_n, input_precision=DOT_PREC)
        tl.store(starts + ((s + 1) * HV + i_hv).to(tl.int64) * (K * V) + off_h, b_h, mask=m_h)


def segment_starts_spec(config: Config, K: int, V: int) -> tuple[Any, dict[str, Any]]:
    """The phase-2 kernel ``config`` selects for head dims ``K``, ``V``, with its tile constexprs and launch options
    (``BK``, ``BV``, ``BKJ`` or ``TRANS``, ``num_warps``, ``num_stages``): the launcher's and the sm_90 profiler's."""
    BK = tile(next_power_of_2(K), K)
    BV = tile(int(config["seg_BV"]), V)
    if config["SEG_COMBINE"] == "regs" and BK <= REGS_MAX_K:
        # sm_90 compile, K = 128: 4 warps hold [K, BV] and the dot's fragments in 100 / 148 registers at BV = 16 / 32;
        # at 64, 8 warps keep it at 128. Two stages: the next segment's M_s is in flight during this one's product
        # (147-197 KB of shared memory: one program per SM).
        launch = {"TRANS": False, "num_warps": 8 if BV >= 64 else 4, "num_stages": 2}
        return chunk_segment_starts_regs_kernel, {"BK": BK, "BV": BV, **launch}
    tiles = {"BK": BK, "BV": BV, "BKJ": min(BKJ_COMBINE, BK), "num_warps": 4, "num_stages": 1}
    return chunk_segment_starts_kernel, tiles


def launch_segment_starts(call: ChunkCall, out: Outputs, scratch: SegmentScratch) -> Any:
    """Phase 2: ``scratch.starts`` of every segment from ``scratch.transitions`` and the initial state."""
    seg = call.tables.segments
    assert seg is not None
    kernel, opts = segment_starts_spec(call.config, call.K, call.V)
    grid = (triton.cdiv(call.V, opts["BV"]), call.N * call.HV)
    return kernel[grid](
        scratch.transitions, call.h0, scratch.starts, out.final_state, seg.seq_segments,
        HV=call.HV, K=call.K, V=call.V, USE_H0=call.h0 is not None, STORE_HT=call.output_final_state,
        DOT_PREC=call.dot_prec, **opts,
    )  # fmt: skip
