"""Stage 1 of the chunk forward: gate cumsum, A_kk / A_qk, the triangular solve and W, U (one program per chunk and value head).

The chunk of ``BT`` rows is processed in ``NB = BT // BC`` row blocks (sub-chunks) ``I``. For block ``I``:

1. Over key tiles of ``BK`` channels, accumulate the off-diagonal row block ``A[I, :I]`` (``[BC, BT]``, columns
   before the block) and the diagonal block ``A[I, I]`` (``[BC, BC]``) of both ``A_kk`` and ``A_qk``.
   Per-channel gates (KDA) use the reference row ``r`` = first row of ``I`` for the off-diagonal part:
   ``k_i·exp(γ_i − γ_r)`` and ``k_j·exp(γ_r − γ_j)`` are both ≤ 1, so it is one tensor-core dot with no overflow
   at any distance. The diagonal block is one dot around the block's middle row ``m`` (exact to rounding while
   every ``|γ_i − γ_m|`` stays below 80 nats). With ``SAFE_DIAG`` the kernel runs twice, as in :mod:`.intra_blocks`:
   the first pass (``DIAG = 1``) flags every chunk where a diagonal block's half span exceeds 80 (any block, any key
   tile); the second (``DIAG = 2``) redoes only those chunks with the element-wise loop over each block's ``BC``
   columns (exponent clamped at 0: exact for any gate), the others return at once. The exact loop was once a
   data-dependent branch inside the key loop: the configuration BT = BC = 64, 4 warps took it in rare chunks and hit
   an illegal shared-memory access on the H200 (Triton 3.6; ``tests/kernels/test_chunk_crash_gpu.py``). Without ``SAFE_DIAG``
   (``DIAG = 0``) a too-steep block overflows to inf/NaN (see the package docstring).
2. ``T_II = (I + A[I, I])⁻¹`` by forward substitution over the ``BC`` rows (registers, CUDA cores).
3. Block forward substitution directly on W and U:
   ``W_I = T_II (β_I K_I exp(γ_I) − A[I, :I] W[:I])`` and ``U_I = T_II (β_I V_I − A[I, :I] U[:I])``, where
   ``W[:I]``, ``U[:I]`` are the rows this program stored for the earlier blocks (read back after a barrier).
4. Store ``A_qk`` rows (scale included; zeros right of the diagonal) and, for KDA, ``q̃ = scale·q·exp(γ)``,
   ``k̃ = k·exp(γ_C − γ)`` and ``exp(γ_C)`` so that the later stages never touch the gate again; for the
   scalar gate the cumulative gate ``γ`` itself ([tokens, HV], float32).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from ..options import gate_act
from .buffers import Intermediates
from .call import ChunkCall, intra_launch_options
from .common import (
    chunk_bounds,
    diag_exact,
    diag_ref,
    load_beta,
    load_channel_gate,
    load_scalar_gate,
    row_rnorm,
    store_row_factors,
)


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
    flags,
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
    DIAG: tl.constexpr,
    NB: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    A_log=None,
    dt_bias=None,
    lower_bound=0.0,
    GACT: tl.constexpr = 0,
    L2NORM: tl.constexpr = False,
    BETA_ACT: tl.constexpr = 0,
    rq=None,
    rk=None,
):
    """``g`` is the log gate, or with ``GACT`` (fla's ``use_gate_in_kernel``: ``InKernel.gate_code``) the raw gate
    that every load activates with ``A_log``, ``dt_bias`` and ``lower_bound``; ``L2NORM``: q and k l2-normalised
    (their rows' factors on the products and on W's operand; DeltaNet and Gated DeltaNet store them in ``rq``, ``rk``
    for the later stages); ``BETA_ACT``: beta's activation (:func:`load_beta`)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if DIAG == 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        # second pass of the guarded KDA diagonal: only the chunks the first pass flagged
        if tl.load(flags + i_c * HV + i_hv) == 0:
            return
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)  # valid rows of this chunk
    b_flag = tl.full(
        [], 0.0, tl.float32
    )  # DIAG == 1: the largest half span of a diagonal block (any row block, any key tile)

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
    act = gate_act(A_log, dt_bias, lower_bound, i_hv, K, GATE, GACT)
    if L2NORM:  # the l2norm factors of the chunk's key rows (the columns of A_kk and A_qk)
        b_rk_all = row_rnorm(k_b, o_t, H * K, m_t, K, BK, NK)

    # Scalar gate: the whole chunk's cumulative gate, once (it is one number per row).
    if GATE == 1:
        b_g_all = load_scalar_gate(g_b + o_t * HV, m_t, act, GACT)
        b_gam_all = tl.cumsum(b_g_all, 0)
        tl.store(gout + (bos * HV + i_hv) + o_t * HV, b_gam_all, mask=m_t)

    for I in range(NB):  # a dynamic loop: 4-8x less code to compile than unrolled, same registers
        r0 = I * BC
        if r0 < L:
            rows = r0 + o_c
            m_r = rows < L
            b_beta = load_beta(beta + (bos * HV + i_hv) + rows * HV, m_r, BETA_ACT)
            if L2NORM:
                b_rk = row_rnorm(k_b, rows, H * K, m_r, K, BK, NK)
                b_rq = row_rnorm(q_b, rows, H * K, m_r, K, BK, NK)
                if GATE != 2:
                    store_row_factors(rq, rk, bos, rows, m_r, b_rq, b_rk, i_h, i_hv, H, HV)
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
                    b_gt = load_channel_gate(p_gt, m_t[:, None] & m_k[None, :], act, o_k, m_k, GACT)
                    b_gamt = tl.cumsum(b_gt, 0)  # γ of the whole chunk, this key tile
                    # γ_r: cumulative gate at the block's first row
                    b_gr = tl.sum(tl.where((o_t == r0)[:, None], b_gamt, 0.0), 0)
                    b_gam = tl.cumsum(
                        load_channel_gate(g_b + (rows[:, None] * (HV * K) + o_k[None, :]), m_rk, act, o_k, m_k, GACT), 0
                    )
                    b_gam = b_gam - tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0)[None, :] + b_gr[None, :]
                    # off-diagonal: rows scaled by exp(γ_i - γ_r) <= 1, columns (j < r) by exp(γ_r - γ_j) <= 1
                    b_er = tl.exp(b_gam - b_gr[None, :])
                    b_ec = tl.exp(tl.where((o_t < r0)[:, None], b_gr[None, :] - b_gamt, float("-inf")))
                    b_kc = (b_kt * b_ec).to(DT)
                    b_A += tl.dot((b_k * b_er).to(DT), tl.trans(b_kc), input_precision=DOT_PREC)
                    b_Aq += tl.dot((b_q * b_er).to(DT), tl.trans(b_kc), input_precision=DOT_PREC)
                    if DIAG == 2:
                        b_dD, b_dDq = diag_exact(b_k, b_q, b_gam, BC)
                    else:
                        b_dD, b_dDq = diag_ref(b_k, b_q, b_gam, BC, DOT_PREC)
                    if DIAG == 1:
                        # the block's half span around its middle row m (γ non-increasing): the middle-row dot's
                        # factors exp(±(γ_i − γ_m)) stay finite while it is < 80; above, the second pass redoes the
                        # chunk (no data-dependent branch around the dots here: see test_chunk_crash_gpu.py)
                        b_mid = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
                        b_half = tl.maximum(
                            tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0) - b_mid,
                            b_mid - tl.sum(tl.where((o_c == BC - 1)[:, None], b_gam, 0.0), 0),
                        )
                        b_flag = tl.maximum(b_flag, tl.max(b_half, 0))
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

            if L2NORM:  # A_kk = diag(r_k) K Kᵀ diag(r_k), A_qk = diag(r_q) Q Kᵀ diag(r_k)
                b_A *= b_rk[:, None] * b_rk_all[None, :]
                b_Aq *= b_rq[:, None] * b_rk_all[None, :]
                b_D *= b_rk[:, None] * b_rk[None, :]
                b_Dq *= b_rq[:, None] * b_rk[None, :]
            m_off = (o_t < r0)[None, :] & m_r[:, None]
            m_low = (o_c[None, :] < o_c[:, None]) & m_r[:, None]
            m_cau = (o_c[None, :] <= o_c[:, None]) & m_r[:, None]
            if GATE == 1:
                b_gr1 = tl.sum(tl.where(o_t == r0 - 1, b_gam_all, 0.0), 0)  # γ before the block (0 for I = 0)
                b_gam1 = load_scalar_gate(g_b + rows * HV, m_r, act, GACT)
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
                if L2NORM:
                    b_k *= b_rk[:, None]
                if GATE == 1:
                    b_x = b_k * (b_beta * tl.exp(b_gam1))[:, None]
                elif GATE == 2:
                    b_gt = load_channel_gate(
                        g_b + (o_t[:, None] * (HV * K) + o_k[None, :]), m_t[:, None] & m_k[None, :], act, o_k, m_k, GACT
                    )
                    b_gC = tl.sum(b_gt, 0)  # γ_C (rows past the end hold 0)
                    b_base = tl.sum(tl.where((o_t < r0)[:, None], b_gt, 0.0), 0)
                    b_gam = load_channel_gate(
                        g_b + (rows[:, None] * (HV * K) + o_k[None, :]), m_rk, act, o_k, m_k, GACT
                    )
                    b_gam = tl.cumsum(b_gam, 0) + b_base[None, :]
                    b_x = b_k * tl.exp(b_gam) * b_beta[:, None]
                    b_q = tl.load(q_b + (rows[:, None] * (H * K) + o_k[None, :]), mask=m_rk, other=0).to(tl.float32)
                    if L2NORM:
                        b_q *= b_rq[:, None]
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
    if DIAG == 1:  # a diagonal block too steep for the middle-row dot: the second pass redoes this chunk exactly
        tl.store(flags + i_c * HV + i_hv, (b_flag > 80.0).to(tl.int32))


def launch_intra_rows(call: ChunkCall, inter: Intermediates) -> Any:
    """Stage 1, ``INTRA = "rows"``: one program per chunk and value head; with KDA's guarded diagonal, a second
    launch redoes the flagged chunks exactly."""
    if call.NC == 0:
        return None
    args = (
        call.q, call.k, call.v, call.g, call.beta, inter.w, inter.u, inter.aqk, inter.qg, inter.kg, inter.gout,
        call.tables.chunk_info, inter.flags, call.scale, call.T,
    )  # fmt: skip
    grid = (call.NC, call.HV)
    kw = intra_launch_options(call) | inter.rnorm_args()
    two_pass = inter.flags is not None
    first = chunk_intra_kernel[grid](*args, DIAG=1 if two_pass else 0, **kw)
    if two_pass:  # redo, exactly, the chunks the first pass flagged (the others return at once)
        chunk_intra_kernel[grid](*args, DIAG=2, **kw)
    return first
