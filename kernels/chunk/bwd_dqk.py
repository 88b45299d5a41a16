"""Backward stage 3 (chunk-parallel, one program per chunk, ``BK`` key channels and value head): dq, dk and the gate.

Over value tiles of ``BV`` channels, with the chunk-start state ``S_c`` (forward) and its adjoint ``X_{c+1}``
(reverse state pass), both ``[K, V]`` per chunk:

* ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``, ``dKβ = −dVβ S_cᵀ`` (``[BT, BK]``) and ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``.

Then, with ``e^γ`` and ``e^{γ_C − γ}`` (factors ≤ 1):

* local terms: ``dq = scale e^γ dq̃``; ``dk_row = β e^γ dKβ``; ``dk_col = e^{γ_C − γ} dk̃``; ``dβ += Σ_d dKβ k e^γ``;
* pairwise terms (``dA_qk``, ``dA_kk`` from stage 2): DeltaNet and Gated DeltaNet here, over the whole chunk, with
  the ``[BT, BT]`` decay ``D_ij = exp(γ_i − γ_j)`` formed masked (safe at every ``BT``):
  ``dq += (dA_qk ⊙ D) k``, ``dk_col += (dA_qk ⊙ D)ᵀ q + (β ⊙ dA_kk ⊙ D)ᵀ k``, ``R = (dA_kk ⊙ D) k``,
  ``dk_row += β R``, ``dβ += Σ_d k ⊙ R``; KDA's per-channel pairwise terms come from :mod:`.bwd_intra`
  (``dq``, ``dk`` and ``dγ`` partials, float32), added here;
* the gate: ``dγ = q ⊙ dq + k ⊙ (dk_row − dk_col)``, plus ``dγ_C = Σ_i k̃_i ⊙ dk̃_i + e^{γ_C} d(e^{γ_C})`` on the
  chunk's last row; KDA stores ``dg_t = Σ_{i >= t} dγ_i`` (zero where the gate was below the floor: the clamp's
  gradient); Gated DeltaNet sums ``dγ`` over this key tile and stores it for :mod:`.bwd_finish`.

``dq``, ``dk`` are per value head (summed over a group's value heads by the caller when ``HV > H``), ``dβ``
partials go to their own slot of ``dbeta_part`` (``[slots, tokens, HV]``, slot stride ``SS = tokens · HV``, summed
by :mod:`.bwd_finish`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_bounds


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
    pq,
    pk,
    pg,
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
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    GATE: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
):
    i_c, i_k, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    DT = vnew.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = o_t < L
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = bos * HV + i_hv  # first row of the chunk in [tokens, HV, ...]
    off_hk = row * K + o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] of [tokens, HV, K]
    off_qk = (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
    b_q = tl.load(q + off_qk, mask=m_tk, other=0).to(tl.float32)
    b_k = tl.load(k + off_qk, mask=m_tk, other=0).to(tl.float32)
    b_beta = tl.load(beta + row + o_t * HV, mask=m_t, other=0).to(tl.float32)

    # ---- contractions over V ----------------------------------------------------------------------------------
    h_b = (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_dqt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkb = tl.zeros([BT, BK], dtype=tl.float32)
    b_dec = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(NV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        off_v = row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        off_h = h_b + o_k[:, None] * V + o_v[None, :]
        m_h = m_k[:, None] & m_v[None, :]
        b_do = tl.load(do + off_v, mask=m_tv, other=0).to(DT)
        b_vn = tl.load(vnew + off_v, mask=m_tv, other=0)
        b_dvb = tl.load(dvb + off_v, mask=m_tv, other=0)
        b_h = tl.load(hbuf + off_h, mask=m_h, other=0)
        b_x = tl.load(dh + off_h, mask=m_h, other=0)
        b_dqt += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dkt += tl.dot(b_vn, tl.trans(b_x), input_precision=DOT_PREC)
        b_dkb -= tl.dot(b_dvb, tl.trans(b_h), input_precision=DOT_PREC)
        if GATE != 0:
            b_dec += tl.sum(b_h.to(tl.float32) * b_x.to(tl.float32), 1)

    # ---- the gate's factors (both <= 1) ----------------------------------------------------------------------
    if GATE == 2:
        b_graw = tl.load(g + off_hk, mask=m_tk, other=0).to(tl.float32)
        b_gam = tl.cumsum(tl.maximum(b_graw, FLOOR), 0)
        b_gC = tl.sum(tl.where(m_t[:, None], tl.maximum(b_graw, FLOOR), 0.0), 0)  # γ at the last valid row
        b_e = tl.exp(b_gam)
        b_ekc = tl.exp(b_gC[None, :] - b_gam)
    elif GATE == 1:
        b_graw = tl.load(g + row + o_t * HV, mask=m_t, other=0).to(tl.float32)
        b_gam1 = tl.cumsum(tl.maximum(b_graw, FLOOR), 0)
        b_gC1 = tl.sum(tl.where(m_t, tl.maximum(b_graw, FLOOR), 0.0), 0)
        b_e = tl.exp(b_gam1)[:, None]
        b_ekc = tl.exp(b_gC1 - b_gam1)[:, None]
    else:
        b_e = tl.full([BT, BK], 1.0, dtype=tl.float32)
        b_ekc = b_e

    # ---- local terms --------------------------------------------------------------------------------------------
    b_dq = scale * b_e * b_dqt
    b_kbe = b_k * b_e  # k e^γ
    b_dkrow = b_beta[:, None] * b_e * b_dkb
    b_dkcol = b_ekc * b_dkt
    b_db = tl.sum(b_dkb * b_kbe, 1)

    # ---- pairwise terms -----------------------------------------------------------------------------------------
    if GATE != 2:  # (KDA's pairwise dq, dk, dγ are added below, after dγ's local terms)
        off_a = row * BT + o_t[:, None] * (HV * BT) + o_t[None, :]
        b_daq = tl.load(daq + off_a, mask=m_t[:, None], other=0)
        b_dak = tl.load(dak + off_a, mask=m_t[:, None], other=0)
        if GATE == 1:
            b_D = tl.exp(tl.where(o_t[None, :] <= o_t[:, None], b_gam1[:, None] - b_gam1[None, :], float("-inf")))
            b_daq *= b_D
            b_dak *= b_D
        b_qc = b_q.to(DT)
        b_kc = b_k.to(DT)
        b_dq += tl.dot(b_daq.to(DT), b_kc, input_precision=DOT_PREC)
        b_dkcol += tl.dot(tl.trans(b_daq.to(DT)), b_qc, input_precision=DOT_PREC)
        b_dkcol += tl.dot(tl.trans((b_dak * b_beta[:, None]).to(DT)), b_kc, input_precision=DOT_PREC)
        b_R = tl.dot(b_dak.to(DT), b_kc, input_precision=DOT_PREC)
        b_dkrow += b_beta[:, None] * b_R
        b_db += tl.sum(b_k * b_R, 1)

    # ---- the gate -------------------------------------------------------------------------------------------------
    if GATE != 0:
        b_dgam = b_q * b_dq + b_k * (b_dkrow - b_dkcol)
        b_dgc = tl.sum(b_k * b_ekc * b_dkt, 0)  # Σ_i k̃_i ⊙ dk̃_i  [BK]
        last = (o_t == L - 1)[:, None]
        if GATE == 2:
            b_dgam += tl.load(pg + off_hk, mask=m_tk, other=0)
            b_dgc += tl.exp(b_gC) * b_dec
            b_dgam += tl.where(last, b_dgc[None, :], 0.0)
            b_dg = tl.cumsum(b_dgam, 0, reverse=True)
            b_dg = tl.where(b_graw < FLOOR, 0.0, b_dg)
            tl.store(dg + off_hk, b_dg.to(dg.dtype.element_ty), mask=m_tk)
        else:
            b_dgc1 = tl.sum(b_dgc, 0) + tl.exp(b_gC1) * tl.sum(b_dec, 0)
            b_dgam1 = tl.sum(b_dgam, 1) + tl.where(o_t == L - 1, b_dgc1, 0.0)
            tl.store(dg + i_k.to(tl.int64) * SS + row + o_t * HV, b_dgam1, mask=m_t)  # partial over this key tile

    b_dk = b_dkrow + b_dkcol
    if GATE == 2:
        b_dq += tl.load(pq + off_hk, mask=m_tk, other=0)
        b_dk += tl.load(pk + off_hk, mask=m_tk, other=0)
    tl.store(dq + off_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta_part + (SLOT + i_k).to(tl.int64) * SS + row + o_t * HV, b_db, mask=m_t)
