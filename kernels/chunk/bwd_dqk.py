"""Backward's chunk-parallel stage (one program per chunk, ``BK`` key channels and value head): dq, dk and the gate;
with ``FUSED`` (``FUSE_DV``) also dv and both dA.

Over value tiles of ``BV`` channels, with the chunk-start state ``S_c`` (forward) and its adjoint ``X_{c+1}``
(reverse state pass), both ``[K, V]`` per chunk:

* ``FUSED``: ``dVβ = Tᵀ dV_new`` (``T = (I + A_kk)⁻¹`` from the forward's stage 1), ``dA_qk += dO V_newᵀ``,
  ``dA_kk −= dVβ V_newᵀ`` (``[BT, BT]`` in registers; every key tile computes them, key tile 0 also stores
  ``dv = β dVβ`` and dβ's ``v`` part ``Σ_v dVβ ⊙ v``); with ``DVB_GIVEN`` (``REVERSE_DV``) the reverse pass did the
  ``dVβ``, ``dv`` and ``v``-part work and ``dVβ`` is read; unfused, ``dVβ`` and both dA come from :mod:`.bwd_dv`;
* ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``, ``dKβ = −dVβ S_cᵀ`` (``[BT, BK]``) and ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``.

Then the chunk-local formulas of :mod:`.bwd_local`: local and
pairwise terms (KDA's per channel by blocks of ``BC`` rows, :mod:`.bwd_pairwise`, which reads dA by blocks from
memory: the dv stage's, or, fused, this program's own copy, written just before) and the gate; KDA stores ``dg``
itself, Gated DeltaNet this key tile's ``dγ`` for :mod:`.bwd_finish`.

``dq``, ``dk`` are per value head (summed over a group's value heads by the caller when ``HV > H``), ``dβ``
partials go to their own slot of ``dbeta_part`` (``[slots, tokens, HV]``, slot stride ``SS = tokens · HV``, summed
by :mod:`.bwd_finish`; slot ``SLOT − 1`` is the ``v`` part, ``SLOT + i_k`` this key tile's).

Grid: one program per chunk, key tile and value head, each doing the value side (``dVβ``, ``dv``, both dA: the same
for every key tile) again; or with ``KLOOP`` (``dqk_KLOOP``) one program per chunk and value head: the value side
once (``dVβ`` written over ``dV_new`` in ``dvb``, rows only this program reads; KDA's dA into one scratch copy), then
its ``NK`` key tiles one after the other, each with its own pass over the value tiles for ``dq̃``, ``dk̃``, ``dKβ``
(``dO``, ``V_new``, ``dVβ`` re-read, from L2) and its local and pairwise terms. The register peak is one key tile's.

Register budget (sm_90a, Triton 3.6, bf16, K = V = 128, 8 warps): 245-255 registers without spills at ``BT = 32``
(with ``KLOOP``: at ``BC = 32``, one pairwise block, or ``BK = 16``); KDA at ``BT = 64`` spills except at ``BK = 16``
or with one 64-row block (124-660 bytes; with ``KLOOP`` 152-860). What tips it is the pairwise diagonal's exact
element-wise branch (compiled without it, ``KLOOP`` at ``BT = 64``, ``BK = 16`` has no spills).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .bwd_local import chunk_local_grads
from .common import chunk_bounds, floor_gate


@triton.jit
def _v_contractions(
    do,
    vnew,
    dvb,
    v,
    dv,
    hbuf,
    dh,
    b_Tt,
    b_beta,
    row,
    h_b,
    o_t,
    o_k,
    m_t,
    m_k,
    L0,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    GATE: tl.constexpr,
    VSIDE: tl.constexpr,
    KSIDE: tl.constexpr,
    DVB_GIVEN: tl.constexpr,
    STORE_DVB: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr = False,
    vn_td=None,
    do_td=None,
    dvb_td=None,
    v_td=None,
    h_td=None,
    x_td=None,
    r0=0,
    c0=0,
    rh=0,
):
    """One pass over the value tiles: with ``VSIDE`` the value side (``dVβ = Tᵀ dV_new`` unless ``DVB_GIVEN``, ``dv``
    and dβ's ``v`` part for rows ``< L0``, ``dA_qk`` unscaled, ``dA_kk`` negated; ``STORE_DVB``: ``dVβ`` written over
    ``dV_new`` in ``dvb``), with ``KSIDE`` the key tile's ``dq̃``, ``dk̃``, ``dKβ``, ``d(e^{γ_C})`` (``dvb`` holds
    ``dVβ`` unless the value side computes it in this pass). Returns ``(dq̃, dk̃, dKβ, d(e^{γ_C}), dA_qk, dA_kk, dβ_v)``
    (float32; what a side does not compute stays zero). ``TMA``: the token tiles through the descriptors ``*_td`` at
    row ``r0`` (the chunk's first token; rows past the chunk zeroed after the load) and columns ``c0 + i_v·BV``, the
    state tiles at row ``rh`` (this chunk, value head and key tile of the ``[chunks·HV·K, V]`` view)."""
    b_dqt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkb = tl.zeros([BT, BK], dtype=tl.float32)
    b_dec = tl.zeros([BK], dtype=tl.float32)
    b_daq = tl.zeros([BT, BT], dtype=tl.float32)
    b_dak = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbv = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(NV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        c_v = (c0 + i_v * BV).to(tl.int32)
        if TMA:
            b_vn = tl.where(m_t[:, None], vn_td.load([r0, c_v]), 0)
            b_do = tl.where(m_t[:, None], do_td.load([r0, c_v]), 0).to(DT)
        else:
            b_vn = tl.load(vnew + off_v, mask=m_tv, other=0)
            b_do = tl.load(do + off_v, mask=m_tv, other=0).to(DT)
        if VSIDE and not DVB_GIVEN:
            if TMA:
                b_dvn = tl.where(m_t[:, None], dvb_td.load([r0, c_v]), 0)
            else:
                b_dvn = tl.load(dvb + off_v, mask=m_tv, other=0)
            b_dvbf = tl.dot(b_Tt, b_dvn, input_precision=DOT_PREC)  # dVβ = Tᵀ dV_new
            b_dvb = b_dvbf.to(DT)
            m_first = (o_t < L0)[:, None] & m_v[None, :]
            if TMA:
                b_v = tl.where(m_first, v_td.load([r0, c_v]), 0).to(tl.float32)
            else:
                b_v = tl.load(v + off_v, mask=m_first, other=0).to(tl.float32)
            b_dbv += tl.sum(b_dvbf * b_v, 1)
            tl.store(dv + off_v, (b_dvbf * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_first)
            if STORE_DVB:  # this program's rows only: its own key loop reads them back
                tl.store(dvb + off_v, b_dvb, mask=m_tv)
        elif TMA:  # dVβ from the reverse pass (REVERSE_DV), from this program's value side, or the dv stage's
            b_dvb = tl.where(m_t[:, None], dvb_td.load([r0, c_v]), 0)
        else:
            b_dvb = tl.load(dvb + off_v, mask=m_tv, other=0)
        if VSIDE:
            b_daq += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
            b_dak -= tl.dot(b_dvb, tl.trans(b_vn), input_precision=DOT_PREC)
        if KSIDE:
            off_h = h_b + o_k[:, None] * V + o_v[None, :]
            m_h = m_k[:, None] & m_v[None, :]
            if TMA:
                b_h = h_td.load([rh, i_v * BV])
                b_x = x_td.load([rh, i_v * BV])
            else:
                b_h = tl.load(hbuf + off_h, mask=m_h, other=0)
                b_x = tl.load(dh + off_h, mask=m_h, other=0)
            b_dqt += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
            b_dkt += tl.dot(b_vn, tl.trans(b_x), input_precision=DOT_PREC)
            b_dkb -= tl.dot(b_dvb, tl.trans(b_h), input_precision=DOT_PREC)
            if GATE != 0:
                b_dec += tl.sum(b_h.to(tl.float32) * b_x.to(tl.float32), 1)
    return b_dqt, b_dkt, b_dkb, b_dec, b_daq, b_dak, b_dbv


@triton.jit
def _key_tile(
    q,
    k,
    g,
    beta,
    hbuf,
    dh,
    do,
    vnew,
    dvb,
    v,
    dv,
    dq,
    dk,
    dg,
    dbeta_part,
    b_Tt,
    b_daq,
    b_dak,
    a_b,
    ak_b,
    b_beta,
    i_k,
    i_c,
    i_h,
    i_hv,
    bos,
    row,
    o_t,
    m_t,
    L,
    L0,
    scale,
    r0,
    SLOT,
    SS,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    GATE: tl.constexpr,
    VSIDE: tl.constexpr,
    DVB_GIVEN: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
    TMA: tl.constexpr = False,
    vn_td=None,
    do_td=None,
    dvb_td=None,
    v_td=None,
    h_td=None,
    x_td=None,
    b_g1=None,
    DA_DECAYED: tl.constexpr = False,
):
    """Key tile ``i_k`` of the chunk: its V contractions (with ``VSIDE`` also the value side, as one pass), the local
    and pairwise terms and the gate, and its stores (dq, dk, KDA's dg, Gated DeltaNet's dγ partial, dβ's k part);
    with ``VSIDE`` also dβ's ``v`` part and KDA's dA scratch copy (this key tile's slot). Returns the dA the pass built
    (``VSIDE``) or ``b_daq``, ``b_dak`` as given."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    off_hk = row * K + o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] of [tokens, HV, K]
    h_b = (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_dqt, b_dkt, b_dkb, b_dec, b_daqv, b_dakv, b_dbv = _v_contractions(
        do, vnew, dvb, v, dv, hbuf, dh, b_Tt, b_beta, row, h_b, o_t, o_k, m_t, m_k, L0,
        HV, K, V, BT, BK, BV, NV, GATE, VSIDE, True, DVB_GIVEN, False, DT, DOT_PREC,
        TMA=TMA, vn_td=vn_td, do_td=do_td, dvb_td=dvb_td, v_td=v_td, h_td=h_td, x_td=x_td, r0=bos.to(tl.int32),
        c0=i_hv * V, rh=((i_c * HV + i_hv) * K + i_k * BK).to(tl.int32),
    )  # fmt: skip
    if VSIDE:
        b_daq, b_dak = _finish_da(
            b_daqv, b_dakv, b_dbv, a_b, ak_b, dbeta_part, row, o_t, m_t, L0, scale, SLOT, SS, HV, BT, GATE, DVB_GIVEN,
            DT, FLOOR, b_g1 if DA_DECAYED else None,
        )  # fmt: skip
    b_dq, b_dk, b_db, b_dg = chunk_local_grads(
        b_dqt, b_dkt, b_dkb, b_dec, b_daq, b_dak, a_b, ak_b, b_beta, q + (bos * H + i_h) * K,
        k + (bos * H + i_h) * K, g, beta + row, i_k * BK, o_t, tl.arange(0, BK), m_t, m_k, L, scale, r0,
        H, HV, K, BT, BC, HV * BT, GATE, DT, DOT_PREC, FLOOR, b_g1, DA_DECAYED,
    )  # fmt: skip
    if GATE == 2:
        tl.store(dg + off_hk, b_dg.to(dg.dtype.element_ty), mask=m_tk)
    elif GATE == 1:
        tl.store(dg + SS.to(tl.int64) * i_k + row + o_t * HV, b_dg, mask=m_t)  # partial over this key tile
    tl.store(dq + off_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta_part + (SLOT + i_k).to(tl.int64) * SS + row + o_t * HV, b_db, mask=m_t)
    return b_daq, b_dak


@triton.jit
def _finish_da(
    b_daq,
    b_dak,
    b_dbv,
    a_b,
    ak_b,
    dbeta_part,
    row,
    o_t,
    m_t,
    L0,
    scale,
    SLOT,
    SS,
    HV: tl.constexpr,
    BT: tl.constexpr,
    GATE: tl.constexpr,
    DVB_GIVEN: tl.constexpr,
    DT: tl.constexpr,
    FLOOR: tl.constexpr = 0.0,
    b_g1=None,
):
    """The value side's results: dA masked (scale folded into ``dA_qk``) in the intermediates' dtype, as the unfused
    stages keep it in memory (with ``b_g1``, Gated DeltaNet's gate row: times the decay ``D_ij = exp(γ_i − γ_j)``
    first, in float32, as ``dqk_DECAY = "value"`` has the local formulas expect); dβ's ``v`` part stored (rows ``< L0``);
    KDA's dA written to its scratch copy at ``a_b``, ``ak_b`` (read by blocks, across threads, after the barrier)."""
    m_low = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    if b_g1 is not None:  # Gated DeltaNet: the decay D_ij = exp(γ_i − γ_j) applied before the rounding
        b_gam = tl.cumsum(floor_gate(b_g1, FLOOR), 0)
        b_D = tl.exp(tl.where(o_t[None, :] <= o_t[:, None], b_gam[:, None] - b_gam[None, :], float("-inf")))
        b_daq = b_daq * b_D
        b_dak = b_dak * b_D
    b_daq = (tl.where(m_low, b_daq, 0.0) * scale).to(DT)
    b_dak = tl.where(m_t[:, None] & (o_t[None, :] < o_t[:, None]), b_dak, 0.0).to(DT)
    if not DVB_GIVEN:
        tl.store(dbeta_part + (SLOT - 1).to(tl.int64) * SS + row + o_t * HV, b_dbv, mask=o_t < L0)
    if GATE == 2:  # KDA reads dA by blocks of rows and columns: through the scratch copy
        tl.store(a_b + o_t[:, None] * (HV * BT) + o_t[None, :], b_daq, mask=m_t[:, None])
        tl.store(ak_b + o_t[:, None] * (HV * BT) + o_t[None, :], b_dak, mask=m_t[:, None])
        tl.debug_barrier()  # the block reads cross threads
    return b_daq, b_dak


@triton.jit(do_not_specialize=["T", "SLOT", "SS"])
def chunk_bwd_dqk_kernel(
    q,
    k,
    g,
    beta,
    hbuf,
    dh,
    do,
    vnew,
    dvb,
    daq,
    dak,
    ai,
    v,
    dv,
    dq,
    dk,
    dg,
    dbeta_part,
    chunk_info,
    scale,
    T,
    SLOT,
    SS,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    GATE: tl.constexpr,
    FUSED: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
    DVB_GIVEN: tl.constexpr = False,
    KLOOP: tl.constexpr = False,
    NK: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    vn_td=None,
    do_td=None,
    dvb_td=None,
    v_td=None,
    h_td=None,
    x_td=None,
    DA_DECAYED: tl.constexpr = False,
):
    i_c, i_kp, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    DT = vnew.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    row = bos * HV + i_hv  # first row of the chunk in [tokens, HV, ...]
    b_beta = tl.load(beta + row + o_t * HV, mask=m_t, other=0).to(tl.float32)
    b_g1 = None
    if GATE == 2:
        g_b = g + row * K
    elif GATE == 1:
        g_b = g + row
        b_g1 = tl.load(g_b + o_t * HV, mask=m_t, other=0).to(tl.float32)  # before the V contractions, off the tail
    else:
        g_b = g
    m_low = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    off_a = row * BT + o_t[:, None] * (HV * BT) + o_t[None, :]
    if FUSED and not DVB_GIVEN:  # the dv stage's work: dVβ = Tᵀ dV_new, dA_qk, dA_kk; dv, dβ's v part
        b_Tt = tl.trans(tl.load(ai + off_a, mask=m_low, other=0).to(DT))
    else:
        b_Tt = tl.zeros([1], dtype=tl.float32)  # (unused)
    # KDA's dA by blocks from memory: a scratch copy per key tile's program (fused; one per chunk with KLOOP), or the
    # dv stage's; the others keep dA in registers
    if GATE == 2:
        if FUSED:  # (with KLOOP the grid has one key column: i_kp = 0)
            a_b = daq + i_kp.to(tl.int64) * SS * BT + row * BT
            ak_b = dak + i_kp.to(tl.int64) * SS * BT + row * BT
        else:
            a_b = daq + row * BT
            ak_b = dak + row * BT
    else:
        a_b = dq  # (unused: dA in registers)
        ak_b = dq
    if FUSED:
        b_daq = tl.zeros([BT, BT], dtype=DT)  # (built by the value side)
        b_dak = b_daq
    elif GATE == 2:
        b_daq = tl.zeros([1], dtype=tl.float32)  # (unused: KDA reads dA from memory)
        b_dak = b_daq
    else:
        b_daq = tl.load(daq + off_a, mask=m_t[:, None], other=0)
        b_dak = tl.load(dak + off_a, mask=m_t[:, None], other=0)

    if KLOOP:  # one program per chunk: the value side once, then the key tiles one after the other
        if FUSED:
            _, _, _, _, b_daqv, b_dakv, b_dbv = _v_contractions(
                do, vnew, dvb, v, dv, hbuf, dh, b_Tt, b_beta, row, 0, o_t, tl.arange(0, BK), m_t, m_t, L,
                HV, K, V, BT, BK, BV, NV, GATE, True, False, DVB_GIVEN, not DVB_GIVEN, DT, DOT_PREC,
                TMA=TMA, vn_td=vn_td, do_td=do_td, dvb_td=dvb_td, v_td=v_td, r0=bos.to(tl.int32), c0=i_hv * V,
            )  # fmt: skip
            b_daq, b_dak = _finish_da(
                b_daqv, b_dakv, b_dbv, a_b, ak_b, dbeta_part, row, o_t, m_t, L, scale, SLOT, SS, HV, BT, GATE,
                DVB_GIVEN, DT, FLOOR, b_g1 if DA_DECAYED else None,
            )  # fmt: skip
            if GATE != 2:
                tl.debug_barrier()  # dVβ in dvb, read back across threads
        for i_k in range(NK):
            r0 = (i_k * L) // (NK * L + 1)  # zero (i_k < NK), not provably loop-invariant: see kda_pairwise
            _key_tile(
                q, k, g_b, beta, hbuf, dh, do, vnew, dvb, v, dv, dq, dk, dg, dbeta_part, b_Tt, b_daq, b_dak, a_b, ak_b,
                b_beta, i_k, i_c, i_h, i_hv, bos, row, r0 + o_t, m_t, L, L, scale, r0, SLOT, SS,
                H, HV, K, V, BT, BC, BK, BV, NV, GATE, False, True, DT, DOT_PREC, FLOOR,
                TMA=TMA, vn_td=vn_td, do_td=do_td, dvb_td=dvb_td, v_td=v_td, h_td=h_td, x_td=x_td, b_g1=b_g1,
                DA_DECAYED=DA_DECAYED,
            )  # fmt: skip
    else:  # one program per key tile: each does the value side (key tile 0 stores dv and dβ's v part)
        _key_tile(
            q, k, g_b, beta, hbuf, dh, do, vnew, dvb, v, dv, dq, dk, dg, dbeta_part, b_Tt, b_daq, b_dak, a_b, ak_b,
            b_beta, i_kp, i_c, i_h, i_hv, bos, row, o_t, m_t, L, tl.where(i_kp == 0, L, 0), scale, 0, SLOT, SS,
            H, HV, K, V, BT, BC, BK, BV, NV, GATE, FUSED, DVB_GIVEN or not FUSED, DT, DOT_PREC, FLOOR,
            TMA=TMA, vn_td=vn_td, do_td=do_td, dvb_td=dvb_td, v_td=v_td, h_td=h_td, x_td=x_td, b_g1=b_g1,
            DA_DECAYED=DA_DECAYED,
        )  # fmt: skip


def descriptors(
    do: torch.Tensor,
    vnew: torch.Tensor,
    dvb: torch.Tensor,
    v: torch.Tensor | None,
    hbuf: torch.Tensor,
    dh: torch.Tensor,
    HV: int,
    K: int,
    V: int,
    BT: int,
    BK: int,
    BV: int,
    on: bool,
) -> dict[str, Any]:
    """``dqk_TMA``: TMA descriptors of the dq/dk stage's value-side tiles (``[tokens, HV·V]`` views of dO, V_new, dVβ
    or dV_new, v: ``[BT, BV]`` blocks) and state tiles (``[chunks·HV·K, V]`` views of the chunk states and their
    adjoints: ``[BK, BV]`` blocks), with the constexpr ``TMA``. Empty (pointer loads) unless ``on`` and every tile lies
    inside one head (``BK`` dividing K, ``BV`` dividing V) with the inputs 16-byte aligned."""
    tokens = do.shape[0] * do.shape[1]
    if not on or K % BK or V % BV or not tokens or not hbuf.numel():
        return {}
    if any(t.data_ptr() % 16 for t in (do, vnew, dvb, hbuf, dh) + ((v,) if v is not None else ())):
        return {}

    def tok(t: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor(t.view(tokens, HV * V), [tokens, HV * V], [HV * V, 1], [BT, BV])

    def state(t: torch.Tensor) -> TensorDescriptor:
        rows = t.numel() // V
        return TensorDescriptor(t.view(rows, V), [rows, V], [V, 1], [BK, BV])

    tds: dict[str, Any] = {"TMA": True, "do_td": tok(do), "vn_td": tok(vnew), "dvb_td": tok(dvb)}
    tds |= {"h_td": state(hbuf), "x_td": state(dh)}
    if v is not None:
        tds["v_td"] = tok(v)
    return tds
