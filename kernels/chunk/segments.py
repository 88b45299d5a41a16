"""Phase 2 of the sequence-parallel state pass: the segments' entering states, sequentially over the few segments
of each sequence (one program per sequence, value head and V tile).

``S_start(s0) = h0`` (or 0), ``S_start(s + 1) = M_s S_start(s) + N_s`` with ``N_s``, ``M_s`` from phase 1
(``ext[s, hv] = [N_s | M_s]``, float32 ``[K, V + K]``). The product runs over the key channels in tiles of
``BKJ``: each step stores ``S_start(s)`` (the phase-3 input) and reads its row tiles back after a barrier, so only
``[K, BKJ]`` of ``M_s`` and ``[K, BV]`` of state are live. An empty sequence has no segments: its final state is
its initial state, stored here (every other final state is stored by phase 3, at the end of the last segment).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from .buffers import Outputs, SegmentScratch
from .call import ChunkCall

BV_COMBINE = 32  # V tile of this kernel (it is small: ~K·K·V·2 flops per segment and value head)
BKJ_COMBINE = 32  # key-channel tile of the product M_s S


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


def launch_segment_starts(call: ChunkCall, out: Outputs, scratch: SegmentScratch) -> Any:
    """Phase 2: ``scratch.starts`` of every segment from ``scratch.transitions`` and the initial state."""
    seg = call.tables.segments
    assert seg is not None
    BK = call.BK
    BV = max(16, min(BV_COMBINE, triton.next_power_of_2(call.V)))
    grid = (triton.cdiv(call.V, BV), call.N * call.HV)
    return chunk_segment_starts_kernel[grid](
        scratch.transitions,
        call.h0,
        scratch.starts,
        out.final_state,
        seg.seq_segments,
        HV=call.HV,
        K=call.K,
        V=call.V,
        BK=BK,
        BKJ=min(BKJ_COMBINE, BK),
        BV=BV,
        USE_H0=call.h0 is not None,
        STORE_HT=call.output_final_state,
        DOT_PREC=call.dot_prec,
        num_warps=4,
        num_stages=1,
    )
