"""The chunk-parallel backward's work done inside the reverse state pass (``REVERSE_DQK``; DeltaNet, Gated DeltaNet):
per chunk, with the adjoint ``X_{c+1}`` still in registers, everything :mod:`.bwd_dqk` and :mod:`.bwd_finish` do for
that chunk, so that neither the adjoints nor ``dVβ`` go through memory and no chunk-parallel stage runs after the pass.

The reverse pass's program holds the whole state (all ``K`` key and ``V`` value channels of one sequence or segment
and value head). Per chunk, from ``dO``, ``dVβ = Tᵀ dV_new`` (computed by the pass, ``REVERSE_DV``), the chunk-start
state ``S_c`` and ``V_new`` (the forward's, kept or re-run) and ``X_{c+1}``:

* the contractions over V: ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``, ``dKβ = −dVβ S_cᵀ``,
  ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``, ``dA_qk = scale · causal(dO V_newᵀ)``, ``dA_kk = strictly_lower(−dVβ V_newᵀ)``;
* the chunk-local terms (:func:`.bwd_local.chunk_local_grads`, the chunk-parallel stage's formulas);
* the per-row results: ``dq``, ``dk`` (per value head), ``dβ`` (its ``v`` part from the pass), Gated DeltaNet's
  ``dg_t = Σ_{i >= t} dγ_i`` inside the chunk (zero where the gate was below the floor).

Operand dtypes as in the stages it replaces: ``S_c``, ``V_new`` and ``dVβ`` in the intermediates' dtype, ``X_{c+1}``
rounded to it (the stage reads the stored adjoint), so the results are those of the staged backward to rounding.
With ``TRANS`` (the pass's ``"vk"`` layout) the pass's tiles are transposed: ``[V, BT]`` token tiles and ``[V, K]``
state tiles; the products are formed from their transposes.

By value tiles (``dh_BV`` < V; :func:`chunk_bwd_reverse_dqk_tiled_kernel`): the same work with the adjoint in a
float32 scratch per program instead of registers, one value tile of it live at a time and the contractions summed
over the tiles.

Registers (sm_90a, Triton 3.6, 8 warps, ``"vk"``): the whole fp32 adjoint, its rounded copy, ``S_c`` and three
``[BT, K]`` accumulators exceed the register file at K = V = 128: 255 registers with 0.9 (DeltaNet) to 3 KB (Gated
DeltaNet) of spills per thread at ``BT = 64``, 0.6-1 KB at 32; at K = V = 64 and ``BT = 64`` 0.35-0.55 KB (the
pass alone: none). 16 warps spill more; block pointers for q, k, dq, dk and the states and ``V_new`` by TMA did not
reduce them. By value tiles (``"kv"``, ``BT = 64``, ``dh_BV = 32``): 612 (DeltaNet) and 932 bytes (Gated DeltaNet);
there the three ``[BT, K]`` float32 accumulators and both dA take 128 registers of the 255.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bwd_local import chunk_local_grads
from .common import scalar_causal_aqk, scalar_chunk_operands


@triton.jit
def store_chunk_grads(
    b_dqt,
    b_dkt,
    b_dkb,
    b_dec,
    b_daq,
    b_dak,
    b_dbv,
    b_beta,
    q,
    k,
    g,
    beta,
    dq,
    dk,
    dg,
    dbeta,
    row_hv,
    row_h,
    o_t,
    m_t,
    L,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """From one chunk's contractions over V (float32: ``dq̃``, ``dk̃``, ``dKβ`` ``[BT, BK]`` for all K channels,
    ``d(e^{γ_C})`` ``[BK]``, both dA ``[BT, BT]`` unmasked, dβ's ``v`` part ``[BT]``): dA masked as the chunk-parallel
    stage keeps them, :func:`.bwd_local.chunk_local_grads`, and the stores of ``dq``, ``dk`` (per value head), ``dβ``
    and Gated DeltaNet's ``dg`` (the reverse cumsum inside the chunk, zero where the gate was below the floor).
    ``row_hv``, ``row_h``: the chunk's first row of ``[tokens, HV, ·]`` and ``[tokens, H, K]``; ``L``: its rows."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_daq = (tl.where(m_t[:, None] & (o_t[None, :] <= o_t[:, None]), b_daq, 0.0) * scale).to(DT)
    b_dak = tl.where(m_t[:, None] & (o_t[None, :] < o_t[:, None]), b_dak, 0.0).to(DT)
    b_dq, b_dk, b_db, b_dg = chunk_local_grads(
        b_dqt, b_dkt, b_dkb, b_dec, b_daq, b_dak, dq, dq, b_beta, q + row_h * K, k + row_h * K, g + row_hv,
        beta + row_hv, 0, o_t, o_k, m_t, m_k, L, scale, 0,
        H, HV, K, BT, BT, HV * BT, GATE, DT, DOT_PREC, FLOOR,
    )  # fmt: skip
    m_tk = m_t[:, None] & m_k[None, :]
    off_hk = row_hv * K + o_t[:, None] * (HV * K) + o_k[None, :]
    tl.store(dq + off_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + off_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + row_hv + o_t * HV, (b_db + b_dbv).to(dbeta.dtype.element_ty), mask=m_t)
    if GATE == 1:
        b_dgt = tl.cumsum(b_dg, 0, reverse=True)
        b_g = tl.load(g + row_hv + o_t * HV, mask=m_t, other=0).to(tl.float32)
        tl.store(dg + row_hv + o_t * HV, tl.where(b_g < FLOOR, 0.0, b_dgt).to(dg.dtype.element_ty), mask=m_t)


@triton.jit
def reverse_chunk_grads(
    b_do,
    b_dvb,
    b_dbv,
    b_xc,
    b_h,
    b_vn,
    b_beta,
    q,
    k,
    g,
    beta,
    dq,
    dk,
    dg,
    dbeta,
    row_hv,
    row_h,
    o_t,
    m_t,
    L,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    TRANS: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """One chunk's gradients on the whole state (see the module). ``b_do``, ``b_dvb`` (``DT``): the chunk's ``dO`` and
    ``dVβ`` (``[BT, V]``, or ``[V, BT]`` with ``TRANS``); ``b_dbv``: dβ's ``v`` part ``[BT]``; ``b_xc``, ``b_h``:
    ``X_{c+1}`` in ``DT`` and the chunk's state ``S_c`` (``[K, V]`` or ``[V, K]``); ``b_vn``: its ``V_new`` (as
    ``b_do``, zero past the chunk's rows); the rest as :func:`store_chunk_grads`."""
    b_h = b_h.to(DT)
    b_vn = b_vn.to(DT)
    if TRANS:  # [V, BT] token tiles, [V, K] state tiles
        b_dqt = tl.dot(tl.trans(b_do), b_h, input_precision=DOT_PREC)
        b_dkt = tl.dot(tl.trans(b_vn), b_xc, input_precision=DOT_PREC)
        b_dkb = -tl.dot(tl.trans(b_dvb), b_h, input_precision=DOT_PREC)
        b_daq = tl.dot(tl.trans(b_do), b_vn, input_precision=DOT_PREC)
        b_dak = -tl.dot(tl.trans(b_dvb), b_vn, input_precision=DOT_PREC)
        b_dec = tl.sum(b_h.to(tl.float32) * b_xc.to(tl.float32), 0)
    else:
        b_dqt = tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dkt = tl.dot(b_vn, tl.trans(b_xc), input_precision=DOT_PREC)
        b_dkb = -tl.dot(b_dvb, tl.trans(b_h), input_precision=DOT_PREC)
        b_daq = tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dak = -tl.dot(b_dvb, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dec = tl.sum(b_h.to(tl.float32) * b_xc.to(tl.float32), 1)
    store_chunk_grads(
        b_dqt, b_dkt, b_dkb, b_dec, b_daq, b_dak, b_dbv, b_beta, q, k, g, beta, dq, dk, dg, dbeta, row_hv, row_h,
        o_t, m_t, L, scale, H, HV, K, BT, BK, GATE, DT, DOT_PREC, FLOOR,
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def chunk_bwd_reverse_dqk_tiled_kernel(
    q,
    k,
    w,
    aqk,
    gout,
    do,
    dht,
    dh0,
    ai,
    v,
    beta,
    dv,
    hbuf,
    vnew,
    graw,
    dq,
    dk,
    dg,
    dbeta,
    xs,
    cu_seqlens,
    chunk_offsets,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    GATE: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
    SEG: tl.constexpr = 0,
    first=None,
    xend=None,
    W_FROM_K: tl.constexpr = False,
    QK_RE: tl.constexpr = False,
):
    """The reverse pass with the chunk-parallel work (``REVERSE_DQK``) by value tiles (``dh_BV`` < V): one program per
    sequence (``SEG = 2``: segment) and value head, the adjoint ``X`` ``[K, V]`` in a float32 scratch ``xs`` (one
    ``[K, V]`` slot per program, L2-resident: 64 KB at K = V = 128) instead of registers. Per chunk, over the ``NV``
    value tiles: load the adjoint's tile, the chain (``dV_new``, ``dVβ``, ``dv`` and dβ's ``v`` part, the update, stored
    back), and the contractions over V accumulated (``dq̃``, ``dk̃``, ``dKβ``, both dA, ``d(e^{γ_C})``); then the
    chunk-local terms and stores (:func:`store_chunk_grads`). Only the value tile's adjoint and the ``[BT, K]`` accumulators are live, not the whole state. The
    ``"kv"`` layout (``dh_LAYOUT`` unused), pointer loads (``dh_TMA`` unused)."""
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    NTn = tl.cdiv(eos - bos, BT).to(tl.int32)
    DT = ai.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_b = tl.arange(0, BV)
    xs_b = xs + i_nh.to(tl.int64) * K * V
    # the adjoint at the end: the final state's gradient (a segment's: its true end adjoint), or zero
    for i_v in range(NV):
        o_v = i_v * BV + o_b
        m_h = m_k[:, None] & (o_v < V)[None, :]
        off_h = o_k[:, None] * V + o_v[None, :]
        b_x = tl.zeros([BK, BV], dtype=tl.float32)
        if SEG == 2:
            b_x += tl.load(xend + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0)
        elif USE_DHT:
            b_x += tl.load(dht + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
        tl.store(xs_b + off_h, b_x, mask=m_h)
    tl.debug_barrier()

    for i_r in range(NTn):
        i_t = NTn - 1 - i_r
        t0 = bos + i_t * BT
        L = tl.minimum(eos - t0, BT).to(tl.int32)
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        row_hv = t0 * HV + i_hv
        row_h = t0 * H + i_h
        # ---- the chunk's value-independent operands ---------------------------------------------------------------
        off_qk = row_h * K + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + off_qk, mask=m_tk, other=0).to(tl.float32)
        b_q = tl.load(q + off_qk, mask=m_tk, other=0).to(tl.float32)
        b_beta = tl.load(beta + row_hv + o_t * HV, mask=m_t, other=0).to(tl.float32)
        off_a = row_hv * BT + o_t[:, None] * (HV * BT) + o_t[None, :]
        m_low = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
        b_T = tl.load(ai + off_a, mask=m_low, other=0).to(DT)  # lower triangular, unit diagonal
        b_qg, b_kg, b_gam, b_gC = scalar_chunk_operands(
            b_q, b_k, gout, row_hv, t0, eos, i_hv, o_t, m_t, scale, HV, BT, GATE, DT
        )  # fmt: skip
        b_rk = b_beta * tl.exp(b_gam) if GATE == 1 else b_beta
        if QK_RE:
            b_A = scalar_causal_aqk(b_q, b_k, b_gam, o_t, m_t, scale, GATE, DT, DOT_PREC)
        else:
            b_A = tl.load(aqk + off_a, mask=m_t[:, None], other=0).to(DT)
        if W_FROM_K:
            b_wk = (b_k * b_rk[:, None]).to(DT)  # Wᵀ dV_new = (β e^γ ⊙ K)ᵀ dVβ
        else:
            b_wk = tl.load(w + row_hv * K + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0).to(DT)
        h_b = hbuf + ((c0 + i_t) * HV + i_hv) * K * V
        # ---- over the value tiles: the chain on this tile of the adjoint, and the contractions over V --------------
        b_dqt = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkb = tl.zeros([BT, BK], dtype=tl.float32)
        b_daq = tl.zeros([BT, BT], dtype=tl.float32)
        b_dak = tl.zeros([BT, BT], dtype=tl.float32)
        b_dec = tl.zeros([BK], dtype=tl.float32)
        b_dbv = tl.zeros([BT], dtype=tl.float32)
        for i_v in range(NV):
            o_v = i_v * BV + o_b
            m_v = o_v < V
            m_h = m_k[:, None] & m_v[None, :]
            off_h = o_k[:, None] * V + o_v[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            off_v = row_hv * V + o_t[:, None] * (HV * V) + o_v[None, :]
            b_x = tl.load(xs_b + off_h, mask=m_h, other=0)
            b_xc = b_x.to(DT)
            b_do = tl.load(do + off_v, mask=m_tv, other=0).to(DT)
            b_dvn = tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
            b_dvn += tl.dot(b_kg, b_xc, input_precision=DOT_PREC)
            b_dvb = tl.dot(tl.trans(b_T), b_dvn.to(DT), input_precision=DOT_PREC)
            b_v = tl.load(v + off_v, mask=m_tv, other=0).to(tl.float32)
            tl.store(dv + off_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
            b_dbv += tl.sum(b_dvb * b_v, 1)
            b_dvbc = b_dvb.to(DT)
            if GATE == 1:
                b_x *= tl.exp(b_gC)
            b_x += tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
            if W_FROM_K:
                b_x -= tl.dot(tl.trans(b_wk), b_dvbc, input_precision=DOT_PREC)
            else:
                b_x -= tl.dot(tl.trans(b_wk), b_dvn.to(DT), input_precision=DOT_PREC)
            tl.store(xs_b + off_h, b_x, mask=m_h)
            b_h = tl.load(h_b + off_h, mask=m_h, other=0).to(DT)
            b_vn = tl.load(vnew + off_v, mask=m_tv, other=0).to(DT)
            b_dqt += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
            b_dkt += tl.dot(b_vn, tl.trans(b_xc), input_precision=DOT_PREC)
            b_dkb -= tl.dot(b_dvbc, tl.trans(b_h), input_precision=DOT_PREC)
            b_daq += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
            b_dak -= tl.dot(b_dvbc, tl.trans(b_vn), input_precision=DOT_PREC)
            if GATE != 0:
                b_dec += tl.sum(b_h.to(tl.float32) * b_xc.to(tl.float32), 1)
        tl.debug_barrier()  # (the adjoint's tiles are read back by other threads at the next chunk)
        store_chunk_grads(
            b_dqt, b_dkt, b_dkb, b_dec, b_daq, b_dak, b_dbv, b_beta, q, k, graw, beta, dq, dk, dg, dbeta, row_hv,
            row_h, o_t, m_t, L, scale, H, HV, K, BT, BK, GATE, DT, DOT_PREC, FLOOR,
        )  # fmt: skip

    if STORE_DH0:  # the adjoint at the start: the initial state's gradient (SEG 2: the sequence's first segment only)
        i_out = i_n
        if SEG == 2:
            i_out = tl.load(first + i_n)
        if i_out >= 0:
            for i_v in range(NV):
                o_v = i_v * BV + o_b
                m_h = m_k[:, None] & (o_v < V)[None, :]
                off_h = o_k[:, None] * V + o_v[None, :]
                b_x = tl.load(xs_b + off_h, mask=m_h, other=0)
                tl.store(dh0 + (i_out.to(tl.int64) * HV + i_hv) * K * V + off_h, b_x, mask=m_h)
