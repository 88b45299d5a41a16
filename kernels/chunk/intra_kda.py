"""Stage 1 of the chunk forward for KDA, ``INTRA = "onepass"``: every gate factor of a chunk built once, in one pass
over the key tiles, from two exponentials per element.

Same outputs and contract as :mod:`.intra_blocks` (``A_qk``, W, U, ``q̃``, ``k̃``, ``exp(γ_C)``), for the per-channel
gate only, with ``NB = BT / BC`` in {1, 2} sub-chunks held in registers (``BT = 32`` as 2 × 16, ``BT = 64`` as
2 × 32). ``INTRA = "blocks"`` walks the key tiles twice (``A`` first, then W's operand, ``q̃`` and ``k̃``) and, per
element, loads the gate up to four times, takes its cumulative sum three times and five exponentials. Here, per key
tile and block ``b`` (rows ``i``, its middle row ``m``, ``s`` the cumulative gate just before the block, ``γ_C``
the chunk's last):

* ``γ`` once (one cumulative sum of the gate tile), and two exponentials per element,
  ``eL_i = exp(γ_i − γ_m)`` and ``eR_i = exp(γ_m − γ_i)``: the diagonal block's two factors, as in
  :func:`.common.diag_ref`;
* everything else is ``eL`` or ``eR`` times a per-channel vector (one exponential per channel):
  ``exp(γ_i − s) = eL_i · exp(γ_m − s)`` (rows of the off-diagonal block, and with ``exp(s)``: ``exp(γ_i)`` for
  ``q̃`` and W's operand), ``exp(s' − γ_j) = eR_j · exp(s' − γ_m)`` (columns of the off-diagonal block, ``s'`` the
  end of block 1; times ``exp(γ_C − s')``: ``k̃`` of block 1), ``exp(γ_C − γ_j) = eR_j · exp(γ_C − γ_m)`` (``k̃``
  of the last block).

Numerics. Every factor above is either at most 1 (a product of such factors can only underflow where the exact
value is below ``exp(−87)``), or a product of two factors each within ``exp(±80)`` — which holds when the block's
half span measured from ``s``, ``max_d max(s − γ_m, γ_m − γ_last)``, is at most 80 nats. That is the guard
(``DIAG = 1``): a chunk with a larger half span in any block is flagged, and the second launch (the ``"blocks"``
kernel's exact pass, ``DIAG = 2``) redoes it exactly; with the guard off (``SAFE_DIAG = False``) such a chunk
overflows to inf/NaN (loud, never a silently small error). The half span counts from ``s`` rather than the block's
first row: one more gate step than ``"blocks"``' guard, so slightly more chunks take the exact pass.

Units. The kernel scales the gate by ``log2(e)`` as it loads it and takes every exponential as ``exp2``: one
``ex2.approx.ftz`` instruction each (sm_90a), where ``exp`` is a multiply, a range test and two conditional fix-ups
for results below 2^−126 — the ones flushed to zero here, all below ``exp(−87)`` and beside factors near 1. The guard
compares the half span in the same units (80 nats = 80 · log2(e)); the one reduction of it runs after the key loop.

With ``STORE_AI`` (the forward under autograd, the backward's ``fh_INTRA = "onepass"``) it also stores the lower
blocks of ``T = (I + A_kk)⁻¹`` in ``ai``, as ``"blocks"`` does; the exact pass of flagged chunks stores its own.

W's operand ``β k exp(γ)`` goes through the W buffer: stored in the key loop, read back after the solve (after a
barrier; the same program's rows, in L1/L2) and overwritten with ``W = T (β k exp(γ))``. With ``WU_OUT = False``
(``WU = "recomputed"``) the kernel stops after the solve: the W buffer keeps the operand ``P = β k exp(γ)``, ``T``
is stored (its block above the diagonal as zeros: the state pass loads whole ``[BT, BT]`` tiles), no v is read and
no U written; the state pass forms ``V_new = T (β ⊙ V − P S)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ..options import gate_act
from .buffers import Intermediates
from .call import ChunkCall, intra_launch_options
from .common import chunk_bounds, load_beta, load_channel_gate
from .intra_blocks import (
    _finish_diag,
    _finish_off,
    _inv_squaring,
    _rnorms,
    _rows,
    _store_rows,
    _sub_row,
    chunk_intra_blocks_kernel,
)

LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _row_and_sum(b_x, b_y, row: tl.constexpr, BC: tl.constexpr):
    """Row ``row`` of the ``[BC, BX]`` tile ``b_x`` and the column sums of ``b_y``, as vectors: one reduction over the
    rows for both (one round of cross-thread exchanges)."""
    return tl.reduce((tl.where((tl.arange(0, BC) == row)[:, None], b_x, 0.0), b_y), 0, _add_pairs)


@triton.jit
def _diag_dots(b_D, b_Dq, b_kL, b_kR, b_qL, DT: tl.constexpr, LOWP: tl.constexpr, DOT_PREC: tl.constexpr):
    """The diagonal block's ``A_kk`` and ``A_qk`` products: float32 operands (the call's dot precision), or with
    ``LOWP`` the intermediates' 16-bit dtype, as the off-diagonal blocks (bfloat16 keeps float32's exponent range,
    so the factors up to ``exp(±80)`` stay finite; the launcher sets ``LOWP`` only for bfloat16)."""
    b_kRT = tl.trans(b_kR)
    if LOWP:
        b_kRT = b_kRT.to(DT)
        b_D += tl.dot(b_kL.to(DT), b_kRT, input_precision=DOT_PREC)
        b_Dq += tl.dot(b_qL.to(DT), b_kRT, input_precision=DOT_PREC)
    else:
        b_D += tl.dot(b_kL, b_kRT, input_precision=DOT_PREC)
        b_Dq += tl.dot(b_qL, b_kRT, input_precision=DOT_PREC)
    return b_D, b_Dq


@triton.jit(do_not_specialize=["T"])
def chunk_intra_onepass_kernel(
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
    NB: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DIAG: tl.constexpr,
    DIAG_LOWP: tl.constexpr,
    SOLVE: tl.constexpr,
    ai=None,
    STORE_AI: tl.constexpr = False,
    A_log=None,
    dt_bias=None,
    lower_bound=0.0,
    GACT: tl.constexpr = 0,
    L2NORM: tl.constexpr = False,
    BETA_ACT: tl.constexpr = 0,
    WU_OUT: tl.constexpr = True,
):
    """``g`` is the log gate, or with ``GACT`` (fla's ``use_gate_in_kernel``) the raw gate that its loads activate;
    ``L2NORM``: q's and k's rows l2-normalised as they are loaded; ``BETA_ACT``: beta's activation; ``WU_OUT``: W and
    U (else ``P`` and ``T`` alone, with ``STORE_AI``)."""
    tl.static_assert(NB == 1 or NB == 2, "INTRA='onepass' holds 1 or 2 sub-chunks per chunk")
    tl.static_assert(WU_OUT or STORE_AI, "without W and U the state pass reads T")
    tl.static_assert(DIAG == 0 or DIAG == 1, "the exact pass (DIAG = 2) is the 'blocks' kernel's")
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)  # valid rows of this chunk
    DT = w.dtype.element_ty
    MID: tl.constexpr = BC // 2

    o_c = tl.arange(0, BC)
    k_b = k + (bos * H + i_h) * K
    q_b = q + (bos * H + i_h) * K
    v_b = v + (bos * HV + i_hv) * V
    g_b = g + (bos * HV + i_hv) * K
    act = gate_act(A_log, dt_bias, lower_bound, i_hv, K, 2, GACT)
    w_b = w + (bos * HV + i_hv) * K
    u_b = u + (bos * HV + i_hv) * V
    a_b = aqk + (bos * HV + i_hv) * BT
    qg_b = qg + (bos * HV + i_hv) * K
    kg_b = kg + (bos * HV + i_hv) * K
    be_b = beta + (bos * HV + i_hv)
    SK = H * K  # row stride of q, k
    SG = HV * K  # row stride of the gate and of W, q~, k~
    SA = HV * BT  # row stride of A_qk

    r1 = o_c
    m1 = r1 < L
    b_be1 = load_beta(be_b + r1 * HV, m1, BETA_ACT)
    b_rk1, b_rq1 = _rnorms(k_b, q_b, r1, m1, b_be1, SK, K, BK, NK, L2NORM)
    b_D1 = tl.zeros([BC, BC], dtype=tl.float32)
    b_Dq1 = tl.zeros([BC, BC], dtype=tl.float32)
    if NB == 2:
        r2 = BC + o_c
        m2 = r2 < L
        b_be2 = load_beta(be_b + r2 * HV, m2, BETA_ACT)
        b_rk2, b_rq2 = _rnorms(k_b, q_b, r2, m2, b_be2, SK, K, BK, NK, L2NORM)
        b_D2 = tl.zeros([BC, BC], dtype=tl.float32)
        b_Dq2 = tl.zeros([BC, BC], dtype=tl.float32)
        b_A21 = tl.zeros([BC, BC], dtype=tl.float32)
        b_Aq21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_half = tl.zeros([BK], dtype=tl.float32)  # per key channel; reduced once, after the loop

    # ---- 1. one pass over the key tiles: A's blocks, q~, k~, exp(γ_C) and W's operand (into the W buffer) ---------
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        # block 1: s = 0 (the chunk's start)
        b_g = load_channel_gate(
            g_b + (r1[:, None] * SG + o_k[None, :]), m1[:, None] & m_k[None, :], act, o_k, m_k, GACT
        )
        b_g *= LOG2E
        b_gam = tl.cumsum(b_g, 0)
        b_gm, b_s1 = _row_and_sum(b_gam, b_g, MID, BC)  # and γ at the end of block 1 (masked rows add 0)
        b_half = tl.maximum(b_half, tl.maximum(-b_gm, b_gm - b_s1))
        b_eL = tl.exp2(b_gam - b_gm[None, :])
        b_eR = tl.exp2(b_gm[None, :] - b_gam)
        b_k = _rows(k_b, r1, SK, o_k, m1, m_k)
        b_q = _rows(q_b, r1, SK, o_k, m1, m_k)
        if L2NORM:
            b_k *= b_rk1[:, None]
            b_q *= b_rq1[:, None]
        b_kL1 = b_k * b_eL  # k_i e^(γ_i − γ_m)
        b_kR1 = b_k * b_eR  # k_j e^(γ_m − γ_j)
        b_qL1 = b_q * b_eL
        b_D1, b_Dq1 = _diag_dots(b_D1, b_Dq1, b_kL1, b_kR1, b_qL1, DT, DIAG_LOWP, DOT_PREC)
        b_em = tl.exp2(b_gm)[None, :]  # e^(γ_m − s), s = 0: within e^(±80) when unflagged
        _store_rows(qg_b, r1, SG, o_k, m1, m_k, b_qL1 * (b_em * scale))
        _store_rows(w_b, r1, SG, o_k, m1, m_k, b_kL1 * b_em * b_be1[:, None])
        if NB == 1:
            b_gC = b_s1
            _store_rows(kg_b, r1, SG, o_k, m1, m_k, b_kR1 * tl.exp2(b_gC - b_gm)[None, :])
        else:
            # block 2: s = s1; the columns of the off-diagonal block are block 1's rows, k_j e^(s1 − γ_j) <= 1
            b_col = b_kR1 * tl.exp2(b_s1 - b_gm)[None, :]
            b_g = load_channel_gate(
                g_b + (r2[:, None] * SG + o_k[None, :]), m2[:, None] & m_k[None, :], act, o_k, m_k, GACT
            )
            b_g *= LOG2E
            b_gam = tl.cumsum(b_g, 0)
            b_gm, b_gC = _row_and_sum(b_gam, b_g, MID, BC)
            b_gam += b_s1[None, :]
            b_gm += b_s1
            b_gC += b_s1
            b_half = tl.maximum(b_half, tl.maximum(b_s1 - b_gm, b_gm - b_gC))
            b_eL = tl.exp2(b_gam - b_gm[None, :])
            b_eR = tl.exp2(b_gm[None, :] - b_gam)
            b_k = _rows(k_b, r2, SK, o_k, m2, m_k)
            b_q = _rows(q_b, r2, SK, o_k, m2, m_k)
            if L2NORM:
                b_k *= b_rk2[:, None]
                b_q *= b_rq2[:, None]
            b_kL = b_k * b_eL
            b_kR = b_k * b_eR
            b_qL = b_q * b_eL
            b_D2, b_Dq2 = _diag_dots(b_D2, b_Dq2, b_kL, b_kR, b_qL, DT, DIAG_LOWP, DOT_PREC)
            b_em = tl.exp2(b_gm - b_s1)[None, :]  # e^(γ_m − s1) <= 1
            b_kr = b_kL * b_em  # rows k_i e^(γ_i − s1) <= 1
            b_qr = b_qL * b_em
            b_colT = tl.trans(b_col.to(DT))
            b_A21 += tl.dot(b_kr.to(DT), b_colT, input_precision=DOT_PREC)
            b_Aq21 += tl.dot(b_qr.to(DT), b_colT, input_precision=DOT_PREC)
            # e^(γ_i) = e^(γ_i − s1) e^(s1): factors <= 1 (the vector e^(γ_m) alone could underflow where e^(γ_i)
            # does not)
            b_es = tl.exp2(b_s1)[None, :]
            _store_rows(qg_b, r2, SG, o_k, m2, m_k, b_qr * (b_es * scale))
            _store_rows(w_b, r2, SG, o_k, m2, m_k, b_kr * b_es * b_be2[:, None])
            _store_rows(kg_b, r2, SG, o_k, m2, m_k, b_kR * tl.exp2(b_gC - b_gm)[None, :])
            _store_rows(kg_b, r1, SG, o_k, m1, m_k, b_col * tl.exp2(b_gC - b_s1)[None, :])
        tl.store(gout + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.exp2(b_gC), mask=m_k)

    if DIAG == 1:  # a block too steep for the factors above: the exact pass redoes this chunk
        tl.store(flags + i_c * HV + i_hv, tl.where(tl.max(b_half, 0) > 80.0 * LOG2E, 1, 0))

    # ---- 2. finish the blocks (β, scale, store A_qk), the inverse of I + A_kk ------------------------------------------
    b_c0 = tl.zeros([BC], dtype=tl.float32)  # no scalar gate
    b_D1 = _finish_diag(b_D1, b_Dq1, b_c0, b_be1, b_c0, b_c0, a_b, r1, m1, scale, SA, BC, 2, True, False)
    b_T1 = -b_D1
    if NB == 2:
        _store_rows(a_b + BC, r1, SA, o_c, m1, o_c < BC, tl.zeros([BC, BC], dtype=tl.float32))
        b_A21 = _finish_off(
            b_A21, b_Aq21, b_c0, b_c0, b_be2, b_c0, b_c0, b_c0, a_b, r2, m2, scale, SA, BC, 2, True, False
        )
        b_D2 = _finish_diag(b_D2, b_Dq2, b_c0, b_be2, b_c0, b_c0, a_b + BC, r2, m2, scale, SA, BC, 2, True, False)
        b_T2 = -b_D2
    if SOLVE == 0:  # forward substitution, row by row
        for i in range(1, BC):
            sel = (o_c == i)[:, None]
            b_T1 = _sub_row(b_T1, sel)
            if NB == 2:
                b_T2 = _sub_row(b_T2, sel)
        b_eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
        b_T1 += b_eye
        if NB == 2:
            b_T2 += b_eye
    else:  # by repeated squaring
        b_T1 = _inv_squaring(b_D1, BC)
        if NB == 2:
            b_T2 = _inv_squaring(b_D2, BC)
    b_I11 = b_T1.to(DT)
    if NB == 2:
        b_I22 = b_T2.to(DT)
        b_T21 = -tl.dot(tl.dot(b_T2, b_A21, input_precision="ieee"), b_T1, input_precision="ieee")
        b_I21 = b_T21.to(DT)
    if STORE_AI:  # for the backward (the training forward): T's lower blocks, rows as A_qk's, like "blocks" stores
        ai_b = ai + (bos * HV + i_hv) * BT
        _store_rows(ai_b, r1, SA, o_c, m1, o_c < BC, b_I11)
        if NB == 2:
            _store_rows(ai_b, r2, SA, o_c, m2, o_c < BC, b_I21)
            _store_rows(ai_b + BC, r2, SA, o_c, m2, o_c < BC, b_I22)
            if not WU_OUT:  # the state pass loads T's whole [BT, BT] tile: the block above the diagonal as zeros
                _store_rows(ai_b + BC, r1, SA, o_c, m1, o_c < BC, tl.zeros([BC, BC], dtype=tl.float32))
    if not WU_OUT:  # the W buffer keeps P = β k e^γ (stored in step 1); no v read, no U
        return

    # ---- 3. W = T (β k e^γ) from the operand stored in step 1, U = T (β V) ------------------------------------------
    tl.debug_barrier()  # the operand rows other threads of this program stored are visible
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_x1 = _rows(w_b, r1, SG, o_k, m1, m_k).to(DT)
        b_o1 = tl.dot(b_I11, b_x1, input_precision=DOT_PREC)
        if NB == 2:
            b_x2 = _rows(w_b, r2, SG, o_k, m2, m_k).to(DT)
            b_o2 = tl.dot(b_I21, b_x1, input_precision=DOT_PREC)
            b_o2 += tl.dot(b_I22, b_x2, input_precision=DOT_PREC)
        tl.debug_barrier()  # every thread has read this tile before any overwrites it
        _store_rows(w_b, r1, SG, o_k, m1, m_k, b_o1)
        if NB == 2:
            _store_rows(w_b, r2, SG, o_k, m2, m_k, b_o2)
    for i_v in range(NV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_x1 = (_rows(v_b, r1, HV * V, o_v, m1, m_v) * b_be1[:, None]).to(DT)
        _store_rows(u_b, r1, HV * V, o_v, m1, m_v, tl.dot(b_I11, b_x1, input_precision=DOT_PREC))
        if NB == 2:
            b_x2 = (_rows(v_b, r2, HV * V, o_v, m2, m_v) * b_be2[:, None]).to(DT)
            b_o = tl.dot(b_I21, b_x1, input_precision=DOT_PREC)
            b_o += tl.dot(b_I22, b_x2, input_precision=DOT_PREC)
            _store_rows(u_b, r2, HV * V, o_v, m2, m_v, b_o)


def launch_intra_onepass(call: ChunkCall, inter: Intermediates) -> Any:
    """Stage 1, ``INTRA = "onepass"`` (KDA); with the guarded diagonal, the ``"blocks"`` kernel's exact pass redoes
    the flagged chunks."""
    if call.NC == 0:
        return None
    u = inter.u if inter.u is not None else inter.ai  # (WU = "recomputed": no U, never written through)
    args = (
        call.q, call.k, call.v, call.g, call.beta, inter.w, u, inter.aqk, inter.qg, inter.kg, inter.gout,
        call.tables.chunk_info, inter.flags, call.scale, call.T,
    )  # fmt: skip
    grid = (call.NC, call.HV)
    kw = intra_launch_options(call)
    if call.recompute:  # P and T for the state pass (the exact pass of flagged chunks stores the same)
        kw |= {"ai": inter.ai, "STORE_AI": True, "WU_OUT": False}
    gate = kw.pop("GATE")
    solve = int(call.config["SOLVE"] == "squaring")
    lowp = bool(call.config["DIAG_BF16"]) and call.dt == torch.bfloat16  # float16's range is too small
    two_pass = inter.flags is not None
    first = chunk_intra_onepass_kernel[grid](*args, DIAG=1 if two_pass else 0, DIAG_LOWP=lowp, SOLVE=solve, **kw)
    if two_pass:  # redo, exactly, the chunks the first pass flagged (the others return at once)
        chunk_intra_blocks_kernel[grid](*args, GATE=gate, DIAG=2, SOLVE=solve, **kw)
    return first
