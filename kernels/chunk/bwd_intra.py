"""Backward stage 3a, KDA only (per-channel gate): the pairwise terms of dq, dk, dβ and dγ, one program per row block.

One program per (chunk, row block ``I`` of ``BC`` rows, ``BK`` key channels, value head). With ``dA_qk`` (scale
folded in) and ``dA_kk`` from :mod:`.bwd_dv` and ``D_ij = exp(γ_i − γ_j)`` per channel:

* rows ``i ∈ I`` ("row" side): ``dq_i = Σ_{j <= i} dA_qk[i,j] k_j D_ij`` and ``R_i = Σ_{j < i} dA_kk[i,j] k_j D_ij``;
* rows ``j ∈ I`` as columns ("column" side): ``C_j = Σ_{i >= j} dA_qk[i,j] q_i D_ij + Σ_{i > j} dA_kk[i,j] β_i k_i D_ij``.

Outputs (float32 ``[tokens, HV, K]``, added by :mod:`.bwd_dqk`): ``dq``, ``dk = β R + C``, ``dγ = q ⊙ dq +
k ⊙ (β R − C)``; and the ``dβ`` partial ``Σ_d k ⊙ R`` in its slot of ``dbeta_part``.

NUMERICS (as the forward's stage 1; no factor ever exceeds 1 off the diagonal):

* blocks ``J < I`` (row side) share the reference point ``b = γ`` at the row before block ``I``:
  ``(dA[I, J] (k_J e^{b − γ_J})) ⊙ e^{γ_I − b}``; blocks ``I' > I`` (column side) share ``s = γ`` at block ``I``'s
  last row: ``(dA[I', I]ᵀ (x_{I'} e^{γ_{I'} − s})) ⊙ e^{s − γ_I}``. An underflowing factor only drops terms below
  ``exp(−87)`` relative.
* the diagonal block: one dot around the block's middle row ``m`` (factors ``e^{±(γ_i − γ_m)}``, exact while the
  block's half span stays below 80 nats); a block whose half span exceeds 80 (strong decays, gates at the floor)
  takes the element-wise loop ``Σ_j dA[i,j] k_j exp(min(γ_i − γ_j, 0))`` instead: exact for any gate.
* gates are clamped at load to ``FLOOR`` (a full forget in float32, see :mod:`.backward`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_bounds


@triton.jit
def _rows(base, rows, stride, o_x, m_r, m_x):
    """A [BC, BX] float32 tile of rows ``rows`` (masked rows and columns read 0)."""
    return tl.load(base + (rows[:, None] * stride + o_x[None, :]), mask=m_r[:, None] & m_x[None, :], other=0).to(
        tl.float32
    )


@triton.jit
def _diag_exact(b_aq, b_ak, b_q, b_k, b_kb, b_gam, BC: tl.constexpr):
    """The diagonal block element-wise (any gate): row side ``Σ_j dA[i,j] k_j e^{min(γ_i − γ_j, 0)}`` of ``dA_qk``
    and ``dA_kk``, column side ``Σ_i dA[i,j] x_i e^{min(γ_i − γ_j, 0)}`` (``x = q`` for dA_qk, ``β k`` for dA_kk).
    The strictly upper entries of the dA blocks are zero, so the clamp at 0 only keeps masked terms finite."""
    o_c = tl.arange(0, BC)
    b_dq = tl.zeros(b_k.shape, dtype=tl.float32)
    b_R = tl.zeros(b_k.shape, dtype=tl.float32)
    b_C = tl.zeros(b_k.shape, dtype=tl.float32)
    for c in range(BC):
        col = (o_c == c)[None, :]
        row = (o_c == c)[:, None]
        b_gc = tl.sum(tl.where(row, b_gam, 0.0), 0)  # γ of row c
        # row side: column c of the dA blocks against k_c
        b_kc = tl.sum(tl.where(row, b_k, 0.0), 0)
        b_e = tl.exp(tl.minimum(b_gam - b_gc[None, :], 0.0))  # e^{γ_i − γ_c} for i >= c
        b_dq += tl.sum(tl.where(col, b_aq, 0.0), 1)[:, None] * (b_e * b_kc[None, :])
        b_R += tl.sum(tl.where(col, b_ak, 0.0), 1)[:, None] * (b_e * b_kc[None, :])
        # column side: row c of the dA blocks against q_c, β_c k_c
        b_qc = tl.sum(tl.where(row, b_q, 0.0), 0)
        b_kbc = tl.sum(tl.where(row, b_kb, 0.0), 0)
        b_f = tl.exp(tl.minimum(b_gc[None, :] - b_gam, 0.0))  # e^{γ_c − γ_j} for j <= c
        b_aqr = tl.sum(tl.where(row, b_aq, 0.0), 0)  # dA_qk[c, j] over j
        b_akr = tl.sum(tl.where(row, b_ak, 0.0), 0)
        b_C += (b_aqr[:, None] * b_qc[None, :] + b_akr[:, None] * b_kbc[None, :]) * b_f
    return b_dq, b_R, b_C


@triton.jit(do_not_specialize=["T", "SLOT", "SS"])
def chunk_bwd_intra_kernel(
    q,
    k,
    g,
    beta,
    daq,
    dak,
    pq,
    pk,
    pg,
    dbeta_part,
    chunk_info,
    T,
    SLOT,
    SS,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    NB: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
):
    i_cb, i_k, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_b = i_cb // NB, i_cb % NB
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    r0 = i_b * BC
    if r0 >= L:
        return
    DT = q.dtype.element_ty  # operand dtype of the off-diagonal dots (the diagonal block's are float32)
    NBv = tl.cdiv(L, BC)  # row blocks holding valid rows
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    rows = r0 + o_c
    m_r = rows < L
    SK = H * K  # row stride of q, k
    SG = HV * K  # row stride of g and the outputs
    SA = HV * BT  # row stride of dA
    q_b = q + (bos * H + i_h) * K
    k_b = k + (bos * H + i_h) * K
    g_b = g + (bos * HV + i_hv) * K
    a_b = (bos * HV + i_hv) * BT
    be_b = beta + bos * HV + i_hv

    # γ before this block (the row side's reference point) and γ of this block's rows
    b_gall = tl.load(g_b + o_t[:, None] * SG + o_k[None, :], mask=(o_t < r0)[:, None] & m_k[None, :], other=0)
    b_base = tl.sum(tl.maximum(b_gall.to(tl.float32), FLOOR), 0)
    b_gi = tl.maximum(_rows(g_b, rows, SG, o_k, m_r, m_k), FLOOR)
    b_gi = tl.where(m_r[:, None], b_gi, 0.0)
    b_gam = tl.cumsum(b_gi, 0) + b_base[None, :]
    b_s = b_base + tl.sum(b_gi, 0)  # γ at the block's last row (the column side's reference point)
    b_qi = _rows(q_b, rows, SK, o_k, m_r, m_k)
    b_ki = _rows(k_b, rows, SK, o_k, m_r, m_k)
    b_bi = tl.load(be_b + rows * HV, mask=m_r, other=0).to(tl.float32)

    # ---- row side, blocks J < I: reference b = γ before block I -----------------------------------------------
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_R = tl.zeros([BC, BK], dtype=tl.float32)
    b_gj0 = tl.zeros([BK], dtype=tl.float32)  # γ before block J
    for J in range(i_b):
        rj = J * BC + o_c
        b_gj = tl.maximum(_rows(g_b, rj, SG, o_k, rj < L, m_k), FLOOR)
        b_gamj = tl.cumsum(b_gj, 0) + b_gj0[None, :]
        b_gj0 += tl.sum(b_gj, 0)
        b_kc = (_rows(k_b, rj, SK, o_k, rj < L, m_k) * tl.exp(b_base[None, :] - b_gamj)).to(DT)
        b_aq = _rows(daq + a_b, rows, SA, rj, m_r, rj < BT).to(DT)
        b_ak = _rows(dak + a_b, rows, SA, rj, m_r, rj < BT).to(DT)
        b_dq += tl.dot(b_aq, b_kc, input_precision=DOT_PREC)
        b_R += tl.dot(b_ak, b_kc, input_precision=DOT_PREC)
    b_er = tl.exp(b_gam - b_base[None, :])
    b_dq *= b_er
    b_R *= b_er

    # ---- column side, blocks I' > I: reference s = γ at block I's last row -----------------------------------
    b_C = tl.zeros([BC, BK], dtype=tl.float32)
    b_gp0 = b_s  # γ before block I'
    for Ip in range(i_b + 1, NBv):
        rp = Ip * BC + o_c
        m_p = rp < L
        b_gp = tl.where(m_p[:, None], tl.maximum(_rows(g_b, rp, SG, o_k, m_p, m_k), FLOOR), 0.0)
        b_gamp = tl.cumsum(b_gp, 0) + b_gp0[None, :]
        b_gp0 += tl.sum(b_gp, 0)
        b_ep = tl.exp(b_gamp - b_s[None, :])
        b_qp = (_rows(q_b, rp, SK, o_k, m_p, m_k) * b_ep).to(DT)
        b_bp = tl.load(be_b + rp * HV, mask=m_p, other=0).to(tl.float32)
        b_kp = (_rows(k_b, rp, SK, o_k, m_p, m_k) * b_ep).to(DT)
        b_aq = _rows(daq + a_b, rp, SA, rows, m_p, rows < BT)
        b_ak = _rows(dak + a_b, rp, SA, rows, m_p, rows < BT) * b_bp[:, None]
        b_C += tl.dot(tl.trans(b_aq.to(DT)), b_qp, input_precision=DOT_PREC)
        b_C += tl.dot(tl.trans(b_ak.to(DT)), b_kp, input_precision=DOT_PREC)
    b_C *= tl.exp(b_s[None, :] - b_gam)

    # ---- the diagonal block --------------------------------------------------------------------------------------
    b_aq = _rows(daq + a_b, rows, SA, rows, m_r, rows < BT)
    b_ak = _rows(dak + a_b, rows, SA, rows, m_r, rows < BT)
    b_kb = b_ki * b_bi[:, None]
    b_gm = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
    b_first = tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0)
    b_half = tl.max(tl.maximum(b_first - b_gm, b_gm - b_s), 0)
    if b_half > 80.0:
        b_ddq, b_dR, b_dC = _diag_exact(b_aq, b_ak, b_qi, b_ki, b_kb, b_gam, BC)
    else:
        b_eL = tl.exp(b_gam - b_gm[None, :])  # e^{γ_i − γ_m}
        b_eR = tl.exp(b_gm[None, :] - b_gam)  # e^{γ_m − γ_j}
        b_kR = b_ki * b_eR
        b_ddq = tl.dot(b_aq, b_kR, input_precision=DOT_PREC) * b_eL
        b_dR = tl.dot(b_ak, b_kR, input_precision=DOT_PREC) * b_eL
        b_dC = tl.dot(tl.trans(b_aq), b_qi * b_eL, input_precision=DOT_PREC)
        b_dC += tl.dot(tl.trans(b_ak), b_kb * b_eL, input_precision=DOT_PREC)
        b_dC *= b_eR
    b_dq += b_ddq
    b_R += b_dR
    b_C += b_dC

    # ---- outputs -------------------------------------------------------------------------------------------------
    b_dkr = b_bi[:, None] * b_R
    off = (bos * HV + i_hv) * K + rows[:, None] * SG + o_k[None, :]
    m_rk = m_r[:, None] & m_k[None, :]
    tl.store(pq + off, b_dq, mask=m_rk)
    tl.store(pk + off, b_dkr + b_C, mask=m_rk)
    tl.store(pg + off, b_qi * b_dq + b_ki * (b_dkr - b_C), mask=m_rk)
    tl.store(dbeta_part + (SLOT + i_k).to(tl.int64) * SS + bos * HV + i_hv + rows * HV, tl.sum(b_ki * b_R, 1), mask=m_r)
