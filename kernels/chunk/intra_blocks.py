"""Stage 1 of the chunk forward, ``INTRA = "blocks"``: every sub-chunk of the chunk at once, all in registers.

Same outputs and contract as :mod:`.intra` (``INTRA = "rows"``); one program per chunk and value head. The chunk
of ``BT = NB · BC`` rows (``NB`` in {1, 2, 4}) is held as ``NB`` row blocks of ``BC`` rows, each block its own set
of register tiles, so nothing is read back from memory and no barrier is needed:

1. One pass over key tiles accumulates every lower block ``A[i, j]`` (``j < i``) and every diagonal block of
   ``A_kk`` and ``A_qk`` (``NB (NB + 1) / 2`` small dots each). KDA's per-channel gate is split around reference
   points so that no factor exceeds 1: an off-diagonal block ``(i, j)`` uses ``s_{i-1}``, the cumulative gate at the
   last row of block ``i - 1``: rows ``k_r exp(γ_r − s_{i-1})`` and columns ``k_c exp(s_j − γ_c) · exp(s_{i-1} − s_j)``
   (the column factor is computed once per block ``j``; the second factor is one vector per pair). Diagonal
   blocks use the block's middle row, as in :mod:`.intra`. With ``SAFE_DIAG`` the kernel runs twice: the first
   pass (``DIAG = 1``) flags every chunk where a diagonal block's half span exceeds 80 nats, and the second pass
   (``DIAG = 2``, exact element-wise diagonal loop) redoes only those chunks; the others return at once. The exact
   loop's code thus never weighs on the common path's registers. The same pass stores ``q̃``, ``k̃`` and ``exp(γ_C)`` (KDA) or ``γ`` (scalar gate).
2. ``T_ii = (I + A[i, i])⁻¹`` for all blocks in one forward-substitution loop (the blocks are independent, so
   their steps interleave), then the off-diagonal blocks of the inverse by block back-substitution
   ``Ai[i, j] = −T_ii Σ_{j ≤ m < i} A[i, m] Ai[m, j]`` (float32 dots).
3. ``W_i = Σ_{j ≤ i} Ai[i, j] (β K exp(γ))_j`` and ``U_i = Σ_{j ≤ i} Ai[i, j] (β V)_j`` per key / value tile.

4. ``INTRA = "blocks_split"`` (constexpr ``SPLIT_QK``): step 1 accumulates ``A_kk`` only, and ``A_qk`` is computed
   after step 3 by a second walk over the row blocks (same reference points), so that the q tiles and the ``A_qk``
   accumulators are not live in the hottest loop.

Register cost grows with ``NB · BC · BK`` (tiles of all blocks are live together): ``BT = 64`` as 4 × 16 or
``BT = 128`` as 4 × 32, not 8 blocks (use ``INTRA = "rows"`` there).
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


@triton.jit
def _rows(base, rows, stride, o_x, m_r, m_x):
    """A [BC, BX] float32 tile of rows ``rows`` (masked rows and columns read 0)."""
    return tl.load(base + (rows[:, None] * stride + o_x[None, :]), mask=m_r[:, None] & m_x[None, :], other=0).to(
        tl.float32
    )


@triton.jit
def _store_rows(base, rows, stride, o_x, m_r, m_x, x):
    tl.store(
        base + (rows[:, None] * stride + o_x[None, :]), x.to(base.dtype.element_ty), mask=m_r[:, None] & m_x[None, :]
    )


@triton.jit
def _sub_row(b_T, sel):
    """One forward-substitution step on row ``sel`` of ``T = (I + D)⁻¹ − I`` (rows above it are final)."""
    b_row = tl.sum(tl.where(sel, b_T, 0.0), 0)
    b_row += tl.sum(b_row[:, None] * b_T, 0)
    return tl.where(sel, b_row[None, :], b_T)


@triton.jit
def _inv_squaring(b_N, BC: tl.constexpr):
    """``(I + N)⁻¹`` of a strictly lower 16 × 16 block (nilpotent, ``N^16 = 0``) by repeated squaring:
    ``(I − N)(I + N²)(I + N⁴)(I + N⁸)``, six float32 dots on CUDA cores (FMA: exact products) instead of 15
    forward-substitution steps with two cross-thread reductions each.

    Only for 16 rows: the powers of N grow like binomial coefficients where keys nearly repeat and beta is near 1
    (the inverse itself stays O(1)), and the product cancels them in float32. Float64 study (``T X`` for a random X,
    blocks of ``β k kᵀ``): random keys ~4e-7 relative (substitution ~5e-8); keys within 1-5% of one direction,
    beta 0.9-1: up to ~9e-5 (substitution ~1e-7). At 32 rows the same keys give O(1) errors: not offered."""
    tl.static_assert(BC == 16, "the squaring inverse is for 16-row blocks only")
    o_c = tl.arange(0, BC)
    b_eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    b_M = tl.dot(b_N, b_N, input_precision="ieee")  # N^2
    b_P = tl.dot(b_eye - b_N, b_eye + b_M, input_precision="ieee")
    b_M = tl.dot(b_M, b_M, input_precision="ieee")  # N^4
    b_P = tl.dot(b_P, b_eye + b_M, input_precision="ieee")
    b_M = tl.dot(b_M, b_M, input_precision="ieee")  # N^8
    return tl.dot(b_P, b_eye + b_M, input_precision="ieee")


@triton.jit
def _rnorms(k_b, q_b, rows, m_r, b_like, SK, K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, L2NORM: tl.constexpr):
    """The l2norm factors of k's and q's rows ``rows`` (``L2NORM``), else ``b_like`` twice (unused)."""
    if L2NORM:
        return row_rnorm(k_b, rows, SK, m_r, K, BK, NK), row_rnorm(q_b, rows, SK, m_r, K, BK, NK)
    return b_like, b_like


@triton.jit
def _kda_diag(b_k, b_q, b_gam, b_last, BC: tl.constexpr, DIAG: tl.constexpr, DOT_PREC: tl.constexpr):
    """Diagonal block of A_kk / A_qk under a per-channel gate, and the block's half span (0 unless ``DIAG == 1``).

    ``DIAG`` 0: one dot around the middle row (unguarded); 1: the same, and the half span around the middle row
    ``max_d max(γ_first − γ_m, γ_m − γ_last)`` so that the caller can flag the chunk when it exceeds 80 nats;
    2: the exact element-wise loop (any gate)."""
    b_half = 0.0
    if DIAG == 2:
        b_D, b_Dq = diag_exact(b_k, b_q, b_gam, BC)
    else:
        b_D, b_Dq = diag_ref(b_k, b_q, b_gam, BC, DOT_PREC)
        if DIAG == 1:
            o_c = tl.arange(0, BC)
            b_first = tl.sum(tl.where((o_c == 0)[:, None], b_gam, 0.0), 0)
            b_mid = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
            b_half = tl.max(tl.maximum(b_first - b_mid, b_mid - b_last), 0)
    return b_D, b_Dq, b_half


@triton.jit
def _finish_diag(
    b_D,
    b_Dq,
    b_c,
    b_beta,
    b_rk,
    b_rq,
    a_col,
    rows,
    m_r,
    scale,
    SA,
    BC: tl.constexpr,
    GATE: tl.constexpr,
    STORE_QK: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """A diagonal block after the key loop: the l2norm's row factors (``L2NORM``: ``b_rk``, ``b_rq`` of its rows), the
    scalar gate's decay (``GATE == 1``, cumulative gate ``b_c``), store the causal ``scale · A_qk`` block at ``a_col``
    (if ``STORE_QK``), return the strictly lower ``β · A_kk`` block."""
    o_c = tl.arange(0, BC)
    if L2NORM:
        b_D *= b_rk[:, None] * b_rk[None, :]
        b_Dq *= b_rq[:, None] * b_rk[None, :]
    m_cau = o_c[None, :] <= o_c[:, None]
    if GATE == 1:
        b_ed = tl.exp(tl.where(m_cau, b_c[:, None] - b_c[None, :], float("-inf")))
        b_D *= b_ed
        b_Dq *= b_ed
    if STORE_QK:
        _store_rows(a_col, rows, SA, o_c, m_r, o_c < BC, tl.where(m_cau, b_Dq, 0.0) * scale)
    return tl.where(o_c[None, :] < o_c[:, None], b_D, 0.0) * b_beta[:, None]


@triton.jit
def _finish_off(
    b_A,
    b_Aq,
    b_ci,
    b_cj,
    b_beta,
    b_rki,
    b_rqi,
    b_rkj,
    a_col,
    rows,
    m_r,
    scale,
    SA,
    BC: tl.constexpr,
    GATE: tl.constexpr,
    STORE_QK: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """An off-diagonal block (row block i, column block j < i) after the key loop: the l2norm's row factors
    (``L2NORM``: rows ``b_rki``, ``b_rqi``, columns ``b_rkj``), the scalar gate's decay ``exp(c_i − c_j) <= 1``, store
    ``scale · A_qk`` at ``a_col`` (if ``STORE_QK``), return ``β · A_kk``."""
    o_c = tl.arange(0, BC)
    if L2NORM:
        b_A *= b_rki[:, None] * b_rkj[None, :]
        b_Aq *= b_rqi[:, None] * b_rkj[None, :]
    if GATE == 1:
        b_ed = tl.exp(b_ci[:, None] - b_cj[None, :])
        b_A *= b_ed
        b_Aq *= b_ed
    if STORE_QK:
        _store_rows(a_col, rows, SA, o_c, m_r, o_c < BC, b_Aq * scale)
    return b_A * b_beta[:, None]


@triton.jit
def _gam(g_b, act, rows, SG, o_k, m_r, m_k, b_base, GACT: tl.constexpr):
    """Cumulative per-channel gate of one row block on top of ``b_base`` (γ before the block), and γ at its end."""
    b_g = _gate_rows(g_b, act, rows, SG, o_k, m_r, m_k, GACT)
    return tl.cumsum(b_g, 0) + b_base[None, :], b_base + tl.sum(b_g, 0)


@triton.jit
def _kda_gated_rows(
    b_k, q_b, qg_b, kg_b, rows, m_r, o_k, m_k, b_gam, b_gC, b_beta, b_rq, scale, SK, SG, L2NORM: tl.constexpr
):
    """KDA, one row block and key tile: store q~ = scale q e^γ and k~ = k e^(γ_C − γ); return β k e^γ (W's operand).
    ``L2NORM``: q's rows times their factors ``b_rq`` (k's are the caller's)."""
    b_e = tl.exp(b_gam)
    b_q = _rows(q_b, rows, SK, o_k, m_r, m_k)
    if L2NORM:
        b_q *= b_rq[:, None]
    _store_rows(qg_b, rows, SG, o_k, m_r, m_k, b_q * b_e * scale)
    _store_rows(kg_b, rows, SG, o_k, m_r, m_k, b_k * tl.exp(b_gC[None, :] - b_gam))
    return b_k * b_e * b_beta[:, None]


@triton.jit
def _gate_rows(g_b, act, rows, SG, o_k, m_r, m_k, GACT: tl.constexpr):
    """A [BC, BK] tile of per-channel log gates (clamped, activated from the raw gate with ``GACT``: see
    ``common.load_channel_gate``)."""
    return load_channel_gate(
        g_b + (rows[:, None] * SG + o_k[None, :]), m_r[:, None] & m_k[None, :], act, o_k, m_k, GACT
    )


@triton.jit
def _w_operand(
    k_b,
    q_b,
    g_b,
    act,
    qg_b,
    kg_b,
    rows,
    m_r,
    o_k,
    m_k,
    b_beta,
    b_rk,
    b_rq,
    b_c,
    b_base,
    b_gC,
    scale,
    SK,
    SG,
    GATE: tl.constexpr,
    GACT: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """W's right operand for one row block and key tile, ``β k e^γ`` (float32): the scalar gate's ``γ`` is ``b_c``;
    KDA builds ``γ`` on top of ``b_base`` (γ before the block) and stores q~ and k~ on the way (``b_gC`` = γ_C).
    ``L2NORM``: k's and q's rows times their factors ``b_rk``, ``b_rq``."""
    b_x = _rows(k_b, rows, SK, o_k, m_r, m_k)
    if L2NORM:
        b_x *= b_rk[:, None]
    if GATE == 2:
        b_gam = tl.cumsum(_gate_rows(g_b, act, rows, SG, o_k, m_r, m_k, GACT), 0) + b_base[None, :]
        b_x = _kda_gated_rows(
            b_x, q_b, qg_b, kg_b, rows, m_r, o_k, m_k, b_gam, b_gC, b_beta, b_rq, scale, SK, SG, L2NORM
        )
    else:
        b_x *= b_beta[:, None]
        if GATE == 1:
            b_x *= tl.exp(b_c)[:, None]
    return b_x


@triton.jit
def _row_blocks(
    k_b,
    q_b,
    g_b,
    act,
    ri,
    mi,
    r1,
    m1,
    r2,
    m2,
    r3,
    m3,
    dt_ref,
    SK,
    SG,
    K: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    NK: tl.constexpr,
    NJ: tl.constexpr,
    GATE: tl.constexpr,
    DIAG: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GACT: tl.constexpr,
):
    """Row block ``i`` (rows ``ri``) of A_kk and A_qk over all key tiles: the diagonal block and the ``NJ`` blocks
    left of it (columns ``r1``, ``r2``, ``r3``), without beta, scale or the scalar gate's decay. Returns
    ``(D, Dq, A_i1, Aq_i1, A_i2, Aq_i2, A_i3, Aq_i3, half)`` (blocks past ``NJ`` are zeros; ``half``: the
    diagonal block's largest half span over key tiles, see :func:`_kda_diag`)."""
    DT = dt_ref.dtype.element_ty
    b_D = tl.zeros([BC, BC], dtype=tl.float32)
    b_Dq = tl.zeros([BC, BC], dtype=tl.float32)
    b_A1 = tl.zeros([BC, BC], dtype=tl.float32)
    b_Aq1 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A2 = tl.zeros([BC, BC], dtype=tl.float32)
    b_Aq2 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A3 = tl.zeros([BC, BC], dtype=tl.float32)
    b_Aq3 = tl.zeros([BC, BC], dtype=tl.float32)
    b_half = 0.0
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        if GATE == 2:
            # γ of the earlier blocks (columns) and of this one; the reference point is γ before this block
            b_ref = tl.zeros([BK], dtype=tl.float32)
            if NJ >= 1:
                b_gam1, b_ref = _gam(g_b, act, r1, SG, o_k, m1, m_k, b_ref, GACT)
            if NJ >= 2:
                b_gam2, b_ref = _gam(g_b, act, r2, SG, o_k, m2, m_k, b_ref, GACT)
            if NJ >= 3:
                b_gam3, b_ref = _gam(g_b, act, r3, SG, o_k, m3, m_k, b_ref, GACT)
            b_gami, b_si = _gam(g_b, act, ri, SG, o_k, mi, m_k, b_ref, GACT)
            b_ki = _rows(k_b, ri, SK, o_k, mi, m_k)
            b_qi = _rows(q_b, ri, SK, o_k, mi, m_k)
            b_d, b_dq, b_h = _kda_diag(b_ki, b_qi, b_gami, b_si, BC, DIAG, DOT_PREC)
            b_half = tl.maximum(b_half, b_h)
            b_D += b_d
            b_Dq += b_dq
            if NJ >= 1:
                # rows k_r e^(γ_r − ref) <= 1, columns k_c e^(ref − γ_c) <= 1
                b_er = tl.exp(b_gami - b_ref[None, :])
                b_kr = (b_ki * b_er).to(DT)
                b_qr = (b_qi * b_er).to(DT)
                b_col = _rows(k_b, r1, SK, o_k, m1, m_k) * tl.exp(b_ref[None, :] - b_gam1)
                b_col = tl.trans(b_col.to(DT))
                b_A1 += tl.dot(b_kr, b_col, input_precision=DOT_PREC)
                b_Aq1 += tl.dot(b_qr, b_col, input_precision=DOT_PREC)
                if NJ >= 2:
                    b_col = _rows(k_b, r2, SK, o_k, m2, m_k) * tl.exp(b_ref[None, :] - b_gam2)
                    b_col = tl.trans(b_col.to(DT))
                    b_A2 += tl.dot(b_kr, b_col, input_precision=DOT_PREC)
                    b_Aq2 += tl.dot(b_qr, b_col, input_precision=DOT_PREC)
                if NJ >= 3:
                    b_col = _rows(k_b, r3, SK, o_k, m3, m_k) * tl.exp(b_ref[None, :] - b_gam3)
                    b_col = tl.trans(b_col.to(DT))
                    b_A3 += tl.dot(b_kr, b_col, input_precision=DOT_PREC)
                    b_Aq3 += tl.dot(b_qr, b_col, input_precision=DOT_PREC)
        else:
            b_ki = _rows(k_b, ri, SK, o_k, mi, m_k).to(DT)
            b_qi = _rows(q_b, ri, SK, o_k, mi, m_k).to(DT)
            b_col = tl.trans(b_ki)
            b_D += tl.dot(b_ki, b_col, input_precision=DOT_PREC)
            b_Dq += tl.dot(b_qi, b_col, input_precision=DOT_PREC)
            if NJ >= 1:
                b_col = tl.trans(_rows(k_b, r1, SK, o_k, m1, m_k).to(DT))
                b_A1 += tl.dot(b_ki, b_col, input_precision=DOT_PREC)
                b_Aq1 += tl.dot(b_qi, b_col, input_precision=DOT_PREC)
            if NJ >= 2:
                b_col = tl.trans(_rows(k_b, r2, SK, o_k, m2, m_k).to(DT))
                b_A2 += tl.dot(b_ki, b_col, input_precision=DOT_PREC)
                b_Aq2 += tl.dot(b_qi, b_col, input_precision=DOT_PREC)
            if NJ >= 3:
                b_col = tl.trans(_rows(k_b, r3, SK, o_k, m3, m_k).to(DT))
                b_A3 += tl.dot(b_ki, b_col, input_precision=DOT_PREC)
                b_Aq3 += tl.dot(b_qi, b_col, input_precision=DOT_PREC)
    return b_D, b_Dq, b_A1, b_Aq1, b_A2, b_Aq2, b_A3, b_Aq3, b_half


@triton.jit(do_not_specialize=["T"])
def chunk_intra_blocks_kernel(
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
    SPLIT_QK: tl.constexpr = False,
    ai=None,
    STORE_AI: tl.constexpr = False,
    SOLVE: tl.constexpr = 0,
    WU_OUT: tl.constexpr = True,
    QK_OUT: tl.constexpr = True,
    U_OUT: tl.constexpr = True,
    A_log=None,
    dt_bias=None,
    lower_bound=0.0,
    GACT: tl.constexpr = 0,
    L2NORM: tl.constexpr = False,
    BETA_ACT: tl.constexpr = 0,
    rq=None,
    rk=None,
):
    """``g`` is the log gate, or with ``GACT`` (fla's ``use_gate_in_kernel``) the raw gate that its loads activate;
    ``L2NORM``: q and k l2-normalised (their rows' factors on A's blocks and on W's operand, q~ and k~; DeltaNet and
    Gated DeltaNet store them in ``rq``, ``rk`` for the later stages); ``BETA_ACT``: beta's activation
    (:func:`.common.load_beta`)."""
    tl.static_assert(NB == 1 or NB == 2 or NB == 4, "INTRA='blocks' holds 1, 2 or 4 sub-chunks per chunk")
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if DIAG == 2:  # noqa: SIM102 (a constexpr test, then a runtime one)
        # second pass of the guarded KDA diagonal: only the chunks the first pass flagged
        if tl.load(flags + i_c * HV + i_hv) == 0:
            return
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)  # valid rows of this chunk
    # WU_OUT = False (the state pass recomputes W and U from T, which STORE_AI stores; "blocks" only; KDA: W's operand
    # P = β k e^γ stored in W's place, with q~ and k~) and QK_OUT = False (it recomputes A_qk): what is not stored is
    # never written, its pointer may be any (the launcher passes T's)
    tl.static_assert(WU_OUT or (STORE_AI and not SPLIT_QK), "T without W, U: 'blocks' with T stored")
    tl.static_assert(QK_OUT or GATE != 2, "A_qk recomputed: DeltaNet / Gated DeltaNet")
    # U_OUT = False (the training forward's fh_U = "recomputed"): W and T stored, no U (its state pass forms V_new
    # from T, the backward reads W)
    tl.static_assert(U_OUT or (WU_OUT and STORE_AI and GATE != 2), "W without U: DeltaNet, Gated DeltaNet, T stored")
    STORE_QK: tl.constexpr = QK_OUT and not SPLIT_QK
    DT = w.dtype.element_ty

    o_c = tl.arange(0, BC)
    k_b = k + (bos * H + i_h) * K
    q_b = q + (bos * H + i_h) * K
    v_b = v + (bos * HV + i_hv) * V
    w_b = w + (bos * HV + i_hv) * K
    u_b = u + (bos * HV + i_hv) * V
    a_b = aqk + (bos * HV + i_hv) * BT
    a_2 = a_b + BC  # A_qk's column blocks 2-4 of the chunk's rows
    a_3 = a_b + 2 * BC
    a_4 = a_b + 3 * BC
    if GATE == 2:
        g_b = g + (bos * HV + i_hv) * K
        qg_b = qg + (bos * HV + i_hv) * K
        kg_b = kg + (bos * HV + i_hv) * K
    elif GATE == 1:
        g_b = g + (bos * HV + i_hv)
        qg_b = q_b  # unused without KDA's per-channel gate
        kg_b = q_b
    else:
        g_b = g
        qg_b = q_b
        kg_b = q_b
    be_b = beta + (bos * HV + i_hv)
    act = gate_act(A_log, dt_bias, lower_bound, i_hv, K, GATE, GACT)
    SK = H * K  # row stride of q, k
    SG = HV * K  # row stride of per-channel gates and of W, q~, k~

    r1 = o_c
    m1 = r1 < L
    b_be1 = load_beta(be_b + r1 * HV, m1, BETA_ACT)
    b_rk1, b_rq1 = _rnorms(k_b, q_b, r1, m1, b_be1, SK, K, BK, NK, L2NORM)
    if L2NORM and GATE != 2:
        store_row_factors(rq, rk, bos, r1, m1, b_rq1, b_rk1, i_h, i_hv, H, HV)
    if NB >= 2:
        r2 = BC + o_c
        m2 = r2 < L
        b_be2 = load_beta(be_b + r2 * HV, m2, BETA_ACT)
        b_rk2, b_rq2 = _rnorms(k_b, q_b, r2, m2, b_be2, SK, K, BK, NK, L2NORM)
        if L2NORM and GATE != 2:
            store_row_factors(rq, rk, bos, r2, m2, b_rq2, b_rk2, i_h, i_hv, H, HV)
    if NB >= 4:
        r3 = 2 * BC + o_c
        r4 = 3 * BC + o_c
        m3 = r3 < L
        m4 = r4 < L
        b_be3 = load_beta(be_b + r3 * HV, m3, BETA_ACT)
        b_rk3, b_rq3 = _rnorms(k_b, q_b, r3, m3, b_be3, SK, K, BK, NK, L2NORM)
        if L2NORM and GATE != 2:
            store_row_factors(rq, rk, bos, r3, m3, b_rq3, b_rk3, i_h, i_hv, H, HV)
        b_be4 = load_beta(be_b + r4 * HV, m4, BETA_ACT)
        b_rk4, b_rq4 = _rnorms(k_b, q_b, r4, m4, b_be4, SK, K, BK, NK, L2NORM)
        if L2NORM and GATE != 2:
            store_row_factors(rq, rk, bos, r4, m4, b_rq4, b_rk4, i_h, i_hv, H, HV)

    # scalar gate: the cumulative gate of every block (a vector each), stored for the later stages; other gates
    # pass zeros to the helpers below, which only read them under GATE == 1
    b_c1 = tl.zeros([BC], dtype=tl.float32)
    b_c2 = b_c1
    b_c3 = b_c1
    b_c4 = b_c1
    if GATE == 1:
        b_gl = load_scalar_gate(g_b + r1 * HV, m1, act, GACT)
        b_c1 = tl.cumsum(b_gl, 0)
        tl.store(gout + (bos * HV + i_hv) + r1 * HV, b_c1, mask=m1)
        if NB >= 2:
            b_gl = load_scalar_gate(g_b + r2 * HV, m2, act, GACT)
            b_c2 = tl.cumsum(b_gl, 0) + tl.sum(tl.where(o_c == BC - 1, b_c1, 0.0), 0)
            tl.store(gout + (bos * HV + i_hv) + r2 * HV, b_c2, mask=m2)
        if NB >= 4:
            b_gl = load_scalar_gate(g_b + r3 * HV, m3, act, GACT)
            b_c3 = tl.cumsum(b_gl, 0) + tl.sum(tl.where(o_c == BC - 1, b_c2, 0.0), 0)
            tl.store(gout + (bos * HV + i_hv) + r3 * HV, b_c3, mask=m3)
            b_gl = load_scalar_gate(g_b + r4 * HV, m4, act, GACT)
            b_c4 = tl.cumsum(b_gl, 0) + tl.sum(tl.where(o_c == BC - 1, b_c3, 0.0), 0)
            tl.store(gout + (bos * HV + i_hv) + r4 * HV, b_c4, mask=m4)

    # ---- 1. A_kk and A_qk, one row block at a time (only that row's accumulators are live); store A_qk -------------
    b_D1, b_Dq1, _a, _b, _c, _d, _e, _f, b_flag = _row_blocks(
        k_b, q_b, g_b, act, r1, m1, r1, m1, r1, m1, r1, m1, w, SK, SG, K, BK, BC, NK, 0, GATE, DIAG, DOT_PREC, GACT
    )
    SA = HV * BT  # row stride of A_qk
    b_D1 = _finish_diag(b_D1, b_Dq1, b_c1, b_be1, b_rk1, b_rq1, a_b, r1, m1, scale, SA, BC, GATE, STORE_QK, L2NORM)
    if NB >= 2:
        b_zero = tl.zeros([BC, BC], dtype=tl.float32)
        if QK_OUT:
            for i_z in range(1, NB):
                _store_rows(a_b + i_z * BC, r1, SA, o_c, m1, o_c < BC, b_zero)
        b_D2, b_Dq2, b_A21, b_Aq21, _c, _d, _e, _f, b_h = _row_blocks(
            k_b, q_b, g_b, act, r2, m2, r1, m1, r1, m1, r1, m1, w, SK, SG, K, BK, BC, NK, 1, GATE, DIAG, DOT_PREC, GACT
        )
        b_flag = tl.maximum(b_flag, b_h)
        b_A21 = _finish_off(
            b_A21, b_Aq21, b_c2, b_c1, b_be2, b_rk2, b_rq2, b_rk1, a_b, r2, m2, scale, SA, BC, GATE, STORE_QK, L2NORM
        )
        b_D2 = _finish_diag(b_D2, b_Dq2, b_c2, b_be2, b_rk2, b_rq2, a_2, r2, m2, scale, SA, BC, GATE, STORE_QK, L2NORM)
    if NB >= 4:
        if QK_OUT:
            for i_z in range(2, 4):
                _store_rows(a_b + i_z * BC, r2, SA, o_c, m2, o_c < BC, b_zero)
            _store_rows(a_4, r3, SA, o_c, m3, o_c < BC, b_zero)
        b_D3, b_Dq3, b_A31, b_Aq31, b_A32, b_Aq32, _e, _f, b_h = _row_blocks(
            k_b, q_b, g_b, act, r3, m3, r1, m1, r2, m2, r1, m1, w, SK, SG, K, BK, BC, NK, 2, GATE, DIAG, DOT_PREC, GACT
        )
        b_flag = tl.maximum(b_flag, b_h)
        b_A31 = _finish_off(
            b_A31, b_Aq31, b_c3, b_c1, b_be3, b_rk3, b_rq3, b_rk1, a_b, r3, m3, scale, SA, BC, GATE, STORE_QK, L2NORM
        )
        b_A32 = _finish_off(
            b_A32, b_Aq32, b_c3, b_c2, b_be3, b_rk3, b_rq3, b_rk2, a_2, r3, m3, scale, SA, BC, GATE, STORE_QK, L2NORM,
        )  # fmt: skip
        b_D3 = _finish_diag(b_D3, b_Dq3, b_c3, b_be3, b_rk3, b_rq3, a_3, r3, m3, scale, SA, BC, GATE, STORE_QK, L2NORM)
        b_D4, b_Dq4, b_A41, b_Aq41, b_A42, b_Aq42, b_A43, b_Aq43, b_h = _row_blocks(
            k_b, q_b, g_b, act, r4, m4, r1, m1, r2, m2, r3, m3, w, SK, SG, K, BK, BC, NK, 3, GATE, DIAG, DOT_PREC, GACT
        )
        b_flag = tl.maximum(b_flag, b_h)
        b_A41 = _finish_off(
            b_A41, b_Aq41, b_c4, b_c1, b_be4, b_rk4, b_rq4, b_rk1, a_b, r4, m4, scale, SA, BC, GATE, STORE_QK, L2NORM
        )
        b_A42 = _finish_off(
            b_A42, b_Aq42, b_c4, b_c2, b_be4, b_rk4, b_rq4, b_rk2, a_2, r4, m4, scale, SA, BC, GATE, STORE_QK, L2NORM,
        )  # fmt: skip
        b_A43 = _finish_off(
            b_A43, b_Aq43, b_c4, b_c3, b_be4, b_rk4, b_rq4, b_rk3, a_3, r4, m4, scale, SA, BC, GATE, STORE_QK, L2NORM,
        )  # fmt: skip
        b_D4 = _finish_diag(b_D4, b_Dq4, b_c4, b_be4, b_rk4, b_rq4, a_4, r4, m4, scale, SA, BC, GATE, STORE_QK, L2NORM)

    if DIAG == 1:  # a diagonal block too steep for the middle-row dot: the second pass redoes this chunk exactly
        tl.store(flags + i_c * HV + i_hv, (b_flag > 80.0).to(tl.int32))

    # ---- 2. the inverse: diagonal blocks by forward substitution (interleaved), the rest by block substitution ----
    if SOLVE == 0:  # forward substitution, the blocks' steps interleaved
        b_T1 = -b_D1
        if NB >= 2:
            b_T2 = -b_D2
        if NB >= 4:
            b_T3 = -b_D3
            b_T4 = -b_D4
        for i in range(1, BC):
            sel = (o_c == i)[:, None]
            b_T1 = _sub_row(b_T1, sel)
            if NB >= 2:
                b_T2 = _sub_row(b_T2, sel)
            if NB >= 4:
                b_T3 = _sub_row(b_T3, sel)
                b_T4 = _sub_row(b_T4, sel)
        b_eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
        b_T1 += b_eye
        if NB >= 2:
            b_T2 += b_eye
        if NB >= 4:
            b_T3 += b_eye
            b_T4 += b_eye
    else:  # by repeated squaring (SOLVE = "squaring")
        b_T1 = _inv_squaring(b_D1, BC)
        if NB >= 2:
            b_T2 = _inv_squaring(b_D2, BC)
        if NB >= 4:
            b_T3 = _inv_squaring(b_D3, BC)
            b_T4 = _inv_squaring(b_D4, BC)
    b_I11 = b_T1.to(DT)
    if NB >= 2:
        b_I22 = b_T2.to(DT)
        b_T21 = -tl.dot(tl.dot(b_T2, b_A21, input_precision="ieee"), b_T1, input_precision="ieee")
        b_I21 = b_T21.to(DT)
    if NB >= 4:
        b_T32 = -tl.dot(tl.dot(b_T3, b_A32, input_precision="ieee"), b_T2, input_precision="ieee")
        b_T43 = -tl.dot(tl.dot(b_T4, b_A43, input_precision="ieee"), b_T3, input_precision="ieee")
        b_T31 = tl.dot(b_A31, b_T1, input_precision="ieee") + tl.dot(b_A32, b_T21, input_precision="ieee")
        b_T31 = -tl.dot(b_T3, b_T31, input_precision="ieee")
        b_T42 = tl.dot(b_A42, b_T2, input_precision="ieee") + tl.dot(b_A43, b_T32, input_precision="ieee")
        b_T42 = -tl.dot(b_T4, b_T42, input_precision="ieee")
        b_T41 = (
            tl.dot(b_A41, b_T1, input_precision="ieee")
            + tl.dot(b_A42, b_T21, input_precision="ieee")
            + tl.dot(b_A43, b_T31, input_precision="ieee")
        )
        b_T41 = -tl.dot(b_T4, b_T41, input_precision="ieee")
        b_I33 = b_T3.to(DT)
        b_I44 = b_T4.to(DT)
        b_I32 = b_T32.to(DT)
        b_I43 = b_T43.to(DT)
        b_I31 = b_T31.to(DT)
        b_I42 = b_T42.to(DT)
        b_I41 = b_T41.to(DT)
    if STORE_AI:  # for the backward: the lower blocks of T = (I + A_kk)^-1, rows as A_qk's ([tokens, HV, BT])
        ai_b = ai + (bos * HV + i_hv) * BT
        _store_rows(ai_b, r1, SA, o_c, m1, o_c < BC, b_I11)
        if NB >= 2:
            _store_rows(ai_b, r2, SA, o_c, m2, o_c < BC, b_I21)
            _store_rows(ai_b + BC, r2, SA, o_c, m2, o_c < BC, b_I22)
        if NB >= 4:
            _store_rows(ai_b, r3, SA, o_c, m3, o_c < BC, b_I31)
            _store_rows(ai_b + BC, r3, SA, o_c, m3, o_c < BC, b_I32)
            _store_rows(ai_b + 2 * BC, r3, SA, o_c, m3, o_c < BC, b_I33)
            _store_rows(ai_b, r4, SA, o_c, m4, o_c < BC, b_I41)
            _store_rows(ai_b + BC, r4, SA, o_c, m4, o_c < BC, b_I42)
            _store_rows(ai_b + 2 * BC, r4, SA, o_c, m4, o_c < BC, b_I43)
            _store_rows(ai_b + 3 * BC, r4, SA, o_c, m4, o_c < BC, b_I44)
    if not (WU_OUT and U_OUT):  # the state pass reads T: the blocks of T above its diagonal as zeros (TMA loads them)
        b_zt = tl.zeros([BC, BC], dtype=tl.float32)
        for i_z in range(1, NB):
            _store_rows(ai_b + i_z * BC, r1, SA, o_c, m1, o_c < BC, b_zt)
        if NB >= 4:
            for i_z in range(2, 4):
                _store_rows(ai_b + i_z * BC, r2, SA, o_c, m2, o_c < BC, b_zt)
            _store_rows(ai_b + 3 * BC, r3, SA, o_c, m3, o_c < BC, b_zt)
    if not WU_OUT and GATE != 2:
        return

    # ---- 3. W = Ai (beta K exp(γ)), U = Ai (beta V) (KDA without WU_OUT: P = beta K exp(γ), q~, k~, exp(γ_C)) -------
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_gC = tl.zeros([BK], dtype=tl.float32)  # KDA: γ_C, and γ before each block (vectors)
        b_s1 = b_gC
        b_s2 = b_gC
        b_s3 = b_gC
        if GATE == 2:
            # the gates' sums first, so that each block's γ tile is built, used and dropped on its own below (the
            # γ tiles of four blocks live together made BT = 64 spill at the 255-register cap)
            b_gC += tl.sum(_gate_rows(g_b, act, r1, SG, o_k, m1, m_k, GACT), 0)
            if NB >= 2:
                b_s1 = b_gC
                b_gC += tl.sum(_gate_rows(g_b, act, r2, SG, o_k, m2, m_k, GACT), 0)
            if NB >= 4:
                b_s2 = b_gC
                b_gC += tl.sum(_gate_rows(g_b, act, r3, SG, o_k, m3, m_k, GACT), 0)
                b_s3 = b_gC
                b_gC += tl.sum(_gate_rows(g_b, act, r4, SG, o_k, m4, m_k, GACT), 0)
            tl.store(gout + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.exp(b_gC), mask=m_k)
        b_x1 = _w_operand(
            k_b, q_b, g_b, act, qg_b, kg_b, r1, m1, o_k, m_k, b_be1, b_rk1, b_rq1, b_c1, b_gC - b_gC, b_gC, scale, SK,
            SG, GATE, GACT, L2NORM,
        )  # fmt: skip
        b_x1 = b_x1.to(DT)
        if NB >= 2:
            b_x2 = _w_operand(
                k_b, q_b, g_b, act, qg_b, kg_b, r2, m2, o_k, m_k, b_be2, b_rk2, b_rq2, b_c2, b_s1, b_gC, scale, SK,
                SG, GATE, GACT, L2NORM,
            )  # fmt: skip
            b_x2 = b_x2.to(DT)
        if NB >= 4:
            b_x3 = _w_operand(
                k_b, q_b, g_b, act, qg_b, kg_b, r3, m3, o_k, m_k, b_be3, b_rk3, b_rq3, b_c3, b_s2, b_gC, scale, SK,
                SG, GATE, GACT, L2NORM,
            )  # fmt: skip
            b_x3 = b_x3.to(DT)
            b_x4 = _w_operand(
                k_b, q_b, g_b, act, qg_b, kg_b, r4, m4, o_k, m_k, b_be4, b_rk4, b_rq4, b_c4, b_s3, b_gC, scale, SK,
                SG, GATE, GACT, L2NORM,
            )  # fmt: skip
            b_x4 = b_x4.to(DT)
        if not WU_OUT:  # KDA: the operand itself (the state pass forms V_new = T (β V − P S))
            _store_rows(w_b, r1, SG, o_k, m1, m_k, b_x1)
            if NB >= 2:
                _store_rows(w_b, r2, SG, o_k, m2, m_k, b_x2)
            if NB >= 4:
                _store_rows(w_b, r3, SG, o_k, m3, m_k, b_x3)
                _store_rows(w_b, r4, SG, o_k, m4, m_k, b_x4)
        else:
            _store_rows(w_b, r1, SG, o_k, m1, m_k, tl.dot(b_I11, b_x1, input_precision=DOT_PREC))
            if NB >= 2:
                b_x2 = b_x2.to(DT)
                b_o = tl.dot(b_I21, b_x1, input_precision=DOT_PREC)
                b_o += tl.dot(b_I22, b_x2, input_precision=DOT_PREC)
                _store_rows(w_b, r2, SG, o_k, m2, m_k, b_o)
            if NB >= 4:
                b_o = tl.dot(b_I31, b_x1, input_precision=DOT_PREC)
                b_o += tl.dot(b_I32, b_x2, input_precision=DOT_PREC)
                b_o += tl.dot(b_I33, b_x3, input_precision=DOT_PREC)
                _store_rows(w_b, r3, SG, o_k, m3, m_k, b_o)
                b_o = tl.dot(b_I41, b_x1, input_precision=DOT_PREC)
                b_o += tl.dot(b_I42, b_x2, input_precision=DOT_PREC)
                b_o += tl.dot(b_I43, b_x3, input_precision=DOT_PREC)
                b_o += tl.dot(b_I44, b_x4, input_precision=DOT_PREC)
                _store_rows(w_b, r4, SG, o_k, m4, m_k, b_o)

    for i_v in range(NV if U_OUT and WU_OUT else 0):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_x1 = (_rows(v_b, r1, HV * V, o_v, m1, m_v) * b_be1[:, None]).to(DT)
        _store_rows(u_b, r1, HV * V, o_v, m1, m_v, tl.dot(b_I11, b_x1, input_precision=DOT_PREC))
        if NB >= 2:
            b_x2 = (_rows(v_b, r2, HV * V, o_v, m2, m_v) * b_be2[:, None]).to(DT)
            b_o = tl.dot(b_I21, b_x1, input_precision=DOT_PREC)
            b_o += tl.dot(b_I22, b_x2, input_precision=DOT_PREC)
            _store_rows(u_b, r2, HV * V, o_v, m2, m_v, b_o)
        if NB >= 4:
            b_x3 = (_rows(v_b, r3, HV * V, o_v, m3, m_v) * b_be3[:, None]).to(DT)
            b_x4 = (_rows(v_b, r4, HV * V, o_v, m4, m_v) * b_be4[:, None]).to(DT)
            b_o = tl.dot(b_I31, b_x1, input_precision=DOT_PREC)
            b_o += tl.dot(b_I32, b_x2, input_precision=DOT_PREC)
            b_o += tl.dot(b_I33, b_x3, input_precision=DOT_PREC)
            _store_rows(u_b, r3, HV * V, o_v, m3, m_v, b_o)
            b_o = tl.dot(b_I41, b_x1, input_precision=DOT_PREC)
            b_o += tl.dot(b_I42, b_x2, input_precision=DOT_PREC)
            b_o += tl.dot(b_I43, b_x3, input_precision=DOT_PREC)
            b_o += tl.dot(b_I44, b_x4, input_precision=DOT_PREC)
            _store_rows(u_b, r4, HV * V, o_v, m4, m_v, b_o)

    if SPLIT_QK and QK_OUT:
        # ---- 4. A_qk in a pass of its own (INTRA = "blocks_split"): the first pass then holds only A_kk's
        # accumulators and no q tiles (at BT = 64 the two together spill at the 255-register cap). The diagonal: the
        # exact loop in the guard's second launch (DIAG = 2), else the middle-row dot ------------------------------
        b_D1, b_Dq1, _a, _b, _c, _d, _e, _f, _h = _row_blocks(
            k_b, q_b, g_b, act, r1, m1, r1, m1, r1, m1, r1, m1, w, SK, SG, K, BK, BC, NK, 0, GATE, (DIAG // 2) * 2,
            DOT_PREC, GACT,
        )  # fmt: skip
        _finish_diag(b_D1, b_Dq1, b_c1, b_be1, b_rk1, b_rq1, a_b, r1, m1, scale, SA, BC, GATE, True, L2NORM)
        if NB >= 2:
            b_D2, b_Dq2, b_A21, b_Aq21, _c, _d, _e, _f, _h = _row_blocks(
                k_b, q_b, g_b, act, r2, m2, r1, m1, r1, m1, r1, m1, w, SK, SG, K, BK, BC, NK, 1, GATE,
                (DIAG // 2) * 2, DOT_PREC, GACT,
            )  # fmt: skip
            _finish_off(
                b_A21, b_Aq21, b_c2, b_c1, b_be2, b_rk2, b_rq2, b_rk1, a_b, r2, m2, scale, SA, BC, GATE, True, L2NORM
            )
            _finish_diag(b_D2, b_Dq2, b_c2, b_be2, b_rk2, b_rq2, a_2, r2, m2, scale, SA, BC, GATE, True, L2NORM)
        if NB >= 4:
            b_D3, b_Dq3, b_A31, b_Aq31, b_A32, b_Aq32, _e, _f, _h = _row_blocks(
                k_b, q_b, g_b, act, r3, m3, r1, m1, r2, m2, r1, m1, w, SK, SG, K, BK, BC, NK, 2, GATE,
                (DIAG // 2) * 2, DOT_PREC, GACT,
            )  # fmt: skip
            _finish_off(
                b_A31, b_Aq31, b_c3, b_c1, b_be3, b_rk3, b_rq3, b_rk1, a_b, r3, m3, scale, SA, BC, GATE, True, L2NORM
            )
            _finish_off(
                b_A32, b_Aq32, b_c3, b_c2, b_be3, b_rk3, b_rq3, b_rk2, a_2, r3, m3, scale, SA, BC, GATE, True, L2NORM,
            )  # fmt: skip
            _finish_diag(b_D3, b_Dq3, b_c3, b_be3, b_rk3, b_rq3, a_3, r3, m3, scale, SA, BC, GATE, True, L2NORM)
            b_D4, b_Dq4, b_A41, b_Aq41, b_A42, b_Aq42, b_A43, b_Aq43, _h = _row_blocks(
                k_b, q_b, g_b, act, r4, m4, r1, m1, r2, m2, r3, m3, w, SK, SG, K, BK, BC, NK, 3, GATE,
                (DIAG // 2) * 2, DOT_PREC, GACT,
            )  # fmt: skip
            _finish_off(
                b_A41, b_Aq41, b_c4, b_c1, b_be4, b_rk4, b_rq4, b_rk1, a_b, r4, m4, scale, SA, BC, GATE, True, L2NORM
            )
            _finish_off(
                b_A42, b_Aq42, b_c4, b_c2, b_be4, b_rk4, b_rq4, b_rk2, a_2, r4, m4, scale, SA, BC, GATE, True, L2NORM,
            )  # fmt: skip
            _finish_off(
                b_A43, b_Aq43, b_c4, b_c3, b_be4, b_rk4, b_rq4, b_rk3, a_3, r4, m4, scale, SA, BC, GATE, True, L2NORM,
            )  # fmt: skip
            _finish_diag(b_D4, b_Dq4, b_c4, b_be4, b_rk4, b_rq4, a_4, r4, m4, scale, SA, BC, GATE, True, L2NORM)


def launch_intra_blocks(call: ChunkCall, inter: Intermediates) -> Any:
    """Stage 1, ``INTRA = "blocks"``; with KDA's guarded diagonal, a second launch redoes the flagged chunks. With
    ``WU = "recomputed"`` it stores the chunk's inverse ``T`` (and the scalar gate's ``γ``, and ``A_qk`` unless
    ``AQK = "recomputed"``), no W and U."""
    if call.NC == 0:
        return None
    # with WU = "recomputed" T instead of W and U, with AQK = "recomputed" no A_qk: an output that is not stored is
    # never written through, its pointer is T's buffer (or W's)
    dummy = inter.ai if inter.ai is not None else inter.w
    outs = tuple(t if t is not None else dummy for t in (inter.w, inter.u, inter.aqk))
    args = (
        call.q, call.k, call.v, call.g, call.beta, *outs, inter.qg, inter.kg, inter.gout,
        call.tables.chunk_info, inter.flags, call.scale, call.T,
    )  # fmt: skip
    grid = (call.NC, call.HV)
    kw = (
        intra_launch_options(call)
        | inter.rnorm_args()
        | {
            "SPLIT_QK": call.config["INTRA"] == "blocks_split",
            "SOLVE": int(call.config["SOLVE"] == "squaring"),
            "WU_OUT": not call.recompute,
            "QK_OUT": not call.recompute_qk,
        }
    )
    if inter.ai is not None:
        kw |= {"ai": inter.ai, "STORE_AI": True}
    two_pass = inter.flags is not None
    first = chunk_intra_blocks_kernel[grid](*args, DIAG=1 if two_pass else 0, **kw)
    if two_pass:  # redo, exactly, the chunks the first pass flagged (the others return at once)
        chunk_intra_blocks_kernel[grid](*args, DIAG=2, **kw)
    return first
