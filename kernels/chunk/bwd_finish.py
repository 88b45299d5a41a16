"""Backward, last stage (chunk-parallel, one program per chunk and value head): the per-row reductions.

* ``dβ = Σ_slots dbeta_part`` (the ``v`` part from :mod:`.bwd_dv`, or fused from key tile 0 of :mod:`.bwd_dqk`, and
  the key-tile partials of :mod:`.bwd_dqk`), stored in beta's dtype;
* Gated DeltaNet: ``dγ = Σ_tiles dg_part`` (:mod:`.bwd_dqk`'s key-tile partials), then ``dg_t = Σ_{i >= t} dγ_i``
  inside the chunk plus the chunk's end term ``P_{c+1} = ⟨S_{c+1}, X_{c+1}⟩`` (its end state against that state's
  adjoint), zero where the gate was below the floor (the clamp's gradient), stored in g's dtype.

``P_{c+1}`` comes from the later chunks' sums. With ``P_c = ⟨S_c, X_c⟩``, the adjoint ``X_c = (scale e^γ ⊙ Q)ᵀ dO −
Wᵀ dV_new + e^{γ_C} X_{c+1}`` and ``S_{c+1} = e^{γ_C} S_c + K̃ᵀ V_new`` give ``P_c − P_{c+1} = Σ_i dγ_i`` (the local
terms of :mod:`.bwd_local`; its pairwise terms sum to zero over a chunk, row sums less column sums), so ``P_{c+1}`` is
the sum of every ``dγ`` of the sequence's later chunks plus ``P_N = ⟨S_N, dS_N⟩`` (``pn``, ``[N, HV]``, from the
final state and its gradient; zero without one): ``dg_t = P_N + Σ_{i >= t} dγ_i`` over the rest of the sequence.
The dq/dk stage then never forms ``Σ S_c ⊙ X_{c+1}``; each of its programs sums its ``dγ`` into ``dg_tot``
(``[key tiles, HV, chunks]``), which this stage adds up over the later chunks of the sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_bounds

TAIL_BLOCK: tl.constexpr = tl.constexpr(256)  # later chunks' sums read per step


@triton.jit(do_not_specialize=["T", "SS"])
def chunk_bwd_finish_kernel(
    g,
    dbeta_part,
    dg_part,
    dbeta,
    dg,
    dg_tot,
    pn,
    chunk_seq,
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
    USE_PN: tl.constexpr,
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
        # + the sums of dγ over the sequence's later chunks (P_{c+1} − P_N)
        n_after = (tl.cdiv(eos - bos, BT) - 1).to(tl.int32)
        o_b = tl.arange(0, TAIL_BLOCK)
        b_tail = tl.zeros([TAIL_BLOCK], dtype=tl.float32)
        p_tot = dg_tot + i_hv.to(tl.int64) * tl.num_programs(0) + i_c + 1
        for _ in range(NKG):
            for s in range(0, n_after, TAIL_BLOCK):
                b_tail += tl.load(p_tot + s + o_b, mask=s + o_b < n_after, other=0)
            p_tot += HV * tl.num_programs(0)
        b_dg += tl.sum(b_tail, 0)
        if USE_PN:  # the sequence's ⟨S_N, dS_N⟩
            if VARLEN:
                i_n = tl.load(chunk_seq + i_c)
            else:
                i_n = i_c // tl.cdiv(T, BT)
            b_dg += tl.load(pn + i_n * HV + i_hv)
        b_g = tl.load(g + off, mask=m_t, other=0).to(tl.float32)
        tl.store(dg + off, tl.where(b_g < FLOOR, 0.0, b_dg).to(dg.dtype.element_ty), mask=m_t)
