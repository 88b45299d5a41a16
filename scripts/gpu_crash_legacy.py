"""The stage-1 kernel of the chunk forward as it was at commit bce1546 (``INTRA = "rows"``, the guarded KDA
diagonal as a data-dependent branch inside the key loop), kept verbatim for ``scripts/gpu_crash.py`` only: on the
H200 (Triton 3.6) the configuration BT = BC = 64, intra_BK = 32, 4 warps hit "Out-of-range shared or local
address" at the W dot in one block at B8 T4096 H16 D128. The library's kernel now runs the exact diagonal as a
second launch (no branch); this copy lets a GPU sitting show whether the branch was the trigger. Not part of the
library; nothing imports it but that script.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_bounds(chunk_info, i_c, T, BT: tl.constexpr, VARLEN: tl.constexpr):
    if VARLEN:
        bos = tl.load(chunk_info + 2 * i_c).to(tl.int64)
        eos = tl.load(chunk_info + 2 * i_c + 1).to(tl.int64)
    else:
        NT = tl.cdiv(T, BT)
        i_b = i_c // NT
        bos = i_b.to(tl.int64) * T + (i_c % NT) * BT
        eos = i_b.to(tl.int64) * T + T
    return bos, eos


@triton.jit
def _diag_exact(b_k, b_q, b_gam, BC: tl.constexpr):
    """Diagonal block, element-wise: column c is Σ_d k_i[d] k_c[d] exp(min(γ_i[d] − γ_c[d], 0)) (rows i < c masked
    later). Exact for any gate; BC exp's per key channel per row."""
    o_c = tl.arange(0, BC)
    b_D = tl.zeros([BC, BC], dtype=tl.float32)
    b_Dq = tl.zeros([BC, BC], dtype=tl.float32)
    for c in range(BC):
        sel = (o_c == c)[:, None]
        b_kj = tl.sum(tl.where(sel, b_k, 0.0), 0)
        b_gj = tl.sum(tl.where(sel, b_gam, 0.0), 0)
        b_e = tl.exp(tl.minimum(b_gam - b_gj[None, :], 0.0)) * b_kj[None, :]
        b_D += tl.where((o_c == c)[None, :], tl.sum(b_k * b_e, 1)[:, None], 0.0)
        b_Dq += tl.where((o_c == c)[None, :], tl.sum(b_q * b_e, 1)[:, None], 0.0)
    return b_D, b_Dq


@triton.jit
def _diag_ref(b_k, b_q, b_gam, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Diagonal block as one dot around the middle row m: (k_i e^{γ_i − γ_m}) · (k_j e^{γ_m − γ_j}), float32 operands.
    Finite (and exact to rounding) while |γ_i − γ_m| < ~88 for every row; overflows to inf/NaN beyond."""
    o_c = tl.arange(0, BC)
    b_gm = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
    b_kR = b_k * tl.exp(b_gm[None, :] - b_gam)
    b_eL = tl.exp(b_gam - b_gm[None, :])
    b_D = tl.dot(b_k * b_eL, tl.trans(b_kR), input_precision=DOT_PREC)
    b_Dq = tl.dot(b_q * b_eL, tl.trans(b_kR), input_precision=DOT_PREC)
    return b_D, b_Dq


@triton.jit(do_not_specialize=["T"])
def chunk_intra_kernel(
    q,
    k,
    v,
    g,
    beta,
    w,
    u,
    aqk,
    qg,
    kg,
    gout,
    chunk_info,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    SAFE_DIAG: tl.constexpr,
    NB: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)  # valid rows of this chunk

    DT = w.dtype.element_ty  # storage / dot-operand dtype of the intermediates

    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    m_t = o_t < L
    # Scalar (int64) base pointers of this chunk; offsets inside the chunk are int32 tiles.
    k_b = k + (bos * H + i_h) * K
    q_b = q + (bos * H + i_h) * K
    v_b = v + (bos * HV + i_hv) * V
    w_b = w + (bos * HV + i_hv) * K
    u_b = u + (bos * HV + i_hv) * V
    if GATE == 2:
        g_b = g + (bos * HV + i_hv) * K
    elif GATE == 1:
        g_b = g + (bos * HV + i_hv)

    # Scalar gate: the whole chunk's cumulative gate, once (it is one number per row).
    if GATE == 1:
        b_g_all = tl.load(g_b + o_t * HV, mask=m_t, other=0).to(tl.float32)
        b_gam_all = tl.cumsum(b_g_all, 0)
        tl.store(gout + (bos * HV + i_hv) + o_t * HV, b_gam_all, mask=m_t)

    for I in range(NB):  # a dynamic loop: 4-8x less code to compile than unrolled, same registers
        r0 = I * BC
        if r0 < L:
            rows = r0 + o_c
            m_r = rows < L
            b_beta = tl.load(beta + (bos * HV + i_hv) + rows * HV, mask=m_r, other=0).to(tl.float32)
            b_A = tl.zeros([BC, BT], dtype=tl.float32)  # A_kk[I, :I] (without beta)
            b_Aq = tl.zeros([BC, BT], dtype=tl.float32)  # A_qk[I, :I] (without scale)
            b_D = tl.zeros([BC, BC], dtype=tl.float32)  # A_kk[I, I]
            b_Dq = tl.zeros([BC, BC], dtype=tl.float32)  # A_qk[I, I]
            for i_k in range(NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_rk = m_r[:, None] & m_k[None, :]
                m_tk = (m_t & (o_t < r0))[:, None] & m_k[None, :]
                p_kr = k_b + (rows[:, None] * (H * K) + o_k[None, :])
                p_qr = q_b + (rows[:, None] * (H * K) + o_k[None, :])
                p_kt = k_b + (o_t[:, None] * (H * K) + o_k[None, :])
                if GATE == 2:
                    b_k = tl.load(p_kr, mask=m_rk, other=0).to(tl.float32)
                    b_q = tl.load(p_qr, mask=m_rk, other=0).to(tl.float32)
                    b_kt = tl.load(p_kt, mask=m_tk, other=0).to(tl.float32)
                    p_gt = g_b + (o_t[:, None] * (HV * K) + o_k[None, :])
                    b_gt = tl.load(p_gt, mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
                    b_gamt = tl.cumsum(b_gt, 0)  # γ of the whole chunk, this key tile
                    # γ_r: cumulative gate at the block's first row
                    b_gr = tl.sum(tl.where((o_t == r0)[:, None], b_gamt, 0.0), 0)
                    b_gam = tl.load(g_b + (rows[:, None] * (HV * K) + o_k[None, :]), mask=m_rk, other=0).to(tl.float32)
                    b_gam = tl.cumsum(b_gam, 0)
                    b_gam = b_gam - tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0)[None, :] + b_gr[None, :]
                    # off-diagonal: rows scaled by exp(γ_i - γ_r) <= 1, columns (j < r) by exp(γ_r - γ_j) <= 1
                    b_er = tl.exp(b_gam - b_gr[None, :])
                    b_ec = tl.exp(tl.where((o_t < r0)[:, None], b_gr[None, :] - b_gamt, float("-inf")))
                    b_kc = (b_kt * b_ec).to(DT)
                    b_A += tl.dot((b_k * b_er).to(DT), tl.trans(b_kc), input_precision=DOT_PREC)
                    b_Aq += tl.dot((b_q * b_er).to(DT), tl.trans(b_kc), input_precision=DOT_PREC)
                    if SAFE_DIAG:
                        # the block's half span around its middle row m (γ non-increasing): the middle-row dot's
                        # factors exp(±(γ_i − γ_m)) stay finite while it is < 80
                        b_mid = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
                        b_half = tl.max(
                            tl.maximum(
                                tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0) - b_mid,
                                b_mid - tl.sum(tl.where((o_c == BC - 1)[:, None], b_gam, 0.0), 0),
                            ),
                            0,
                        )
                        if b_half > 80.0:
                            b_dD, b_dDq = _diag_exact(b_k, b_q, b_gam, BC)
                        else:
                            b_dD, b_dDq = _diag_ref(b_k, b_q, b_gam, BC, DOT_PREC)
                    else:
                        b_dD, b_dDq = _diag_ref(b_k, b_q, b_gam, BC, DOT_PREC)
                    b_D += b_dD
                    b_Dq += b_dDq
                else:
                    b_k = tl.load(p_kr, mask=m_rk, other=0).to(DT)
                    b_q = tl.load(p_qr, mask=m_rk, other=0).to(DT)
                    b_kt = tl.load(p_kt, mask=m_tk, other=0).to(DT)
                    b_A += tl.dot(b_k, tl.trans(b_kt), input_precision=DOT_PREC)
                    b_Aq += tl.dot(b_q, tl.trans(b_kt), input_precision=DOT_PREC)
                    b_D += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
                    b_Dq += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)

            m_off = (o_t < r0)[None, :] & m_r[:, None]
            m_low = (o_c[None, :] < o_c[:, None]) & m_r[:, None]
            m_cau = (o_c[None, :] <= o_c[:, None]) & m_r[:, None]
            if GATE == 1:
                b_gr1 = tl.sum(tl.where(o_t == r0 - 1, b_gam_all, 0.0), 0)  # γ before the block (0 for I = 0)
                b_gam1 = tl.load(g_b + rows * HV, mask=m_r, other=0).to(tl.float32)
                b_gam1 = tl.cumsum(b_gam1, 0) + b_gr1
                b_A *= tl.exp(tl.where(m_off, b_gam1[:, None] - b_gam_all[None, :], float("-inf")))
                b_Aq *= tl.exp(tl.where(m_off, b_gam1[:, None] - b_gam_all[None, :], float("-inf")))
                b_ed = tl.exp(tl.where(m_cau, b_gam1[:, None] - b_gam1[None, :], float("-inf")))
                b_D *= b_ed
                b_Dq *= b_ed
            b_A = tl.where(m_off, b_A, 0.0) * b_beta[:, None]
            b_Aq = tl.where(m_off, b_Aq, 0.0) * scale
            b_D = tl.where(m_low, b_D, 0.0) * b_beta[:, None]
            b_Dq = tl.where(m_cau, b_Dq, 0.0) * scale

            # A_qk rows of this block: [0, r0) off-diagonal, [r0, r0 + BC) diagonal block, zeros after
            p_aq = aqk + (bos * HV + i_hv) * BT + rows[:, None] * (HV * BT)
            tl.store(p_aq + o_t[None, :], b_Aq.to(aqk.dtype.element_ty), mask=m_off)
            tl.store(p_aq + r0 + o_c[None, :], b_Dq.to(aqk.dtype.element_ty), mask=m_r[:, None])
            if r0 + BC < BT:
                m_z = m_r[:, None] & (o_t >= r0 + BC)[None, :]
                tl.store(p_aq + o_t[None, :], tl.zeros([BC, BT], dtype=aqk.dtype.element_ty), mask=m_z)

            # T_II = (I + D)^-1 by forward substitution: row i <- row i + sum_j row_i[j] * (finished row j)
            b_T = -b_D
            for i in range(1, BC):
                sel = (o_c == i)[:, None]
                b_row = tl.sum(tl.where(sel, b_T, 0.0), 0)
                b_row += tl.sum(b_row[:, None] * b_T, 0)
                b_T = tl.where(sel, b_row[None, :], b_T)
            b_T += (o_c[:, None] == o_c[None, :]).to(tl.float32)
            b_Tc = b_T.to(DT)
            b_Ac = b_A.to(DT)

            # W_I = T_II (beta K exp(γ) - A[I, :I] W[:I])
            for i_k in range(NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_rk = m_r[:, None] & m_k[None, :]
                b_k = tl.load(k_b + (rows[:, None] * (H * K) + o_k[None, :]), mask=m_rk, other=0).to(tl.float32)
                if GATE == 1:
                    b_x = b_k * (b_beta * tl.exp(b_gam1))[:, None]
                elif GATE == 2:
                    b_gt = tl.load(
                        g_b + (o_t[:, None] * (HV * K) + o_k[None, :]),
                        mask=m_t[:, None] & m_k[None, :],
                        other=0,
                    ).to(tl.float32)
                    b_gC = tl.sum(b_gt, 0)  # γ_C (rows past the end hold 0)
                    b_base = tl.sum(tl.where((o_t < r0)[:, None], b_gt, 0.0), 0)
                    b_gam = tl.load(g_b + (rows[:, None] * (HV * K) + o_k[None, :]), mask=m_rk, other=0).to(tl.float32)
                    b_gam = tl.cumsum(b_gam, 0) + b_base[None, :]
                    b_x = b_k * tl.exp(b_gam) * b_beta[:, None]
                    b_q = tl.load(q_b + (rows[:, None] * (H * K) + o_k[None, :]), mask=m_rk, other=0).to(tl.float32)
                    p_r = rows[:, None] * (HV * K) + o_k[None, :]
                    tl.store(
                        qg + (bos * HV + i_hv) * K + p_r,
                        (b_q * tl.exp(b_gam) * scale).to(qg.dtype.element_ty),
                        mask=m_rk,
                    )
                    tl.store(
                        kg + (bos * HV + i_hv) * K + p_r,
                        (b_k * tl.exp(b_gC[None, :] - b_gam)).to(kg.dtype.element_ty),
                        mask=m_rk,
                    )
                    if I == 0:
                        tl.store(gout + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.exp(b_gC), mask=m_k)
                else:
                    b_x = b_k * b_beta[:, None]
                if I > 0:
                    m_tk = (o_t < r0)[:, None] & m_k[None, :]
                    b_wp = tl.load(
                        w_b + (o_t[:, None] * (HV * K) + o_k[None, :]),
                        mask=m_tk,
                        other=0,
                        cache_modifier=".cg",
                    )
                    b_x -= tl.dot(b_Ac, b_wp.to(DT), input_precision=DOT_PREC)
                b_w = tl.dot(b_Tc, b_x.to(DT), input_precision=DOT_PREC)
                tl.store(w_b + (rows[:, None] * (HV * K) + o_k[None, :]), b_w.to(DT), mask=m_rk)

            # U_I = T_II (beta V - A[I, :I] U[:I])
            for i_v in range(NV):
                o_v = i_v * BV + tl.arange(0, BV)
                m_v = o_v < V
                m_rv = m_r[:, None] & m_v[None, :]
                b_v = tl.load(v_b + (rows[:, None] * (HV * V) + o_v[None, :]), mask=m_rv, other=0).to(tl.float32)
                b_x = b_v * b_beta[:, None]
                if I > 0:
                    m_tv = (o_t < r0)[:, None] & m_v[None, :]
                    b_up = tl.load(
                        u_b + (o_t[:, None] * (HV * V) + o_v[None, :]),
                        mask=m_tv,
                        other=0,
                        cache_modifier=".cg",
                    )
                    b_x -= tl.dot(b_Ac, b_up.to(DT), input_precision=DOT_PREC)
                b_u = tl.dot(b_Tc, b_x.to(DT), input_precision=DOT_PREC)
                tl.store(u_b + (rows[:, None] * (HV * V) + o_v[None, :]), b_u.to(DT), mask=m_rv)
            if I + 1 < NB:
                # the next blocks read W[:I+1], U[:I+1] back: make this block's stores visible to the whole CTA
                tl.debug_barrier()
