"""Backward, last stage (chunk-parallel, one program per chunk and value head): the per-row reductions.

* ``dβ = Σ_slots dbeta_part`` (the ``v`` part from :mod:`.bwd_dv`, or fused from key tile 0 of :mod:`.bwd_dqk`, and
  the key-tile partials of :mod:`.bwd_dqk`), stored in beta's dtype;
* Gated DeltaNet: ``dγ = Σ_tiles dg_part`` (:mod:`.bwd_dqk`'s key-tile partials), then ``dg_t = Σ_{i >= t} dγ_i``
  inside the chunk, zero where the gate was below the floor (the clamp's gradient), stored in g's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_bounds


@triton.jit(do_not_specialize=["T", "SS"])
def chunk_bwd_finish_kernel(
    g,
    dbeta_part,
    dg_part,
    dbeta,
    dg,
    chunk_info,
    T,
    SS,
    HV: tl.constexpr,
    BT: tl.constexpr,
    NSLOT: tl.constexpr,
    NKG: tl.constexpr,
    GATE: tl.constexpr,
    VARLEN: tl.constexpr,
    FLOOR: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    off = bos * HV + i_hv + o_t * HV
    b_db = tl.zeros([BT], dtype=tl.float32)
    p_db = dbeta_part + off
    for _ in range(NSLOT):  # slot by slot (pointer steps: no 32-bit slot offsets)
        b_db += tl.load(p_db, mask=m_t, other=0)
        p_db += SS
    tl.store(dbeta + off, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if GATE == 1:
        b_dgam = tl.zeros([BT], dtype=tl.float32)
        p_dg = dg_part + off
        for _ in range(NKG):
            b_dgam += tl.load(p_dg, mask=m_t, other=0)
            p_dg += SS
        b_dg = tl.cumsum(b_dgam, 0, reverse=True)
        b_g = tl.load(g + off, mask=m_t, other=0).to(tl.float32)
        tl.store(dg + off, tl.where(b_g < FLOOR, 0.0, b_dg).to(dg.dtype.element_ty), mask=m_t)
