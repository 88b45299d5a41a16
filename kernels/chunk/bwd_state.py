"""Backward stage 1: the reverse state pass, sequential over a sequence's chunks from the last to the first.

One program per (sequence, value head, ``BV`` value channels), the state adjoint ``X`` (all key channels) in float32
registers; ``X`` starts as the final state's gradient (or 0). Per chunk ``c``, going backwards (``X = X_{c+1}``, the
adjoint of the state after the chunk):

* store ``X_{c+1}`` (the chunk-parallel stages read it, inputs' dtype, ``[chunks, HV, K, V]``);
* ``dV_new = A_qkᵀ dO + k̃ X_{c+1}`` (store, inputs' dtype);
* ``X_c = diag(e^{γ_C}) X_{c+1} + q̃ᵀ dO − Wᵀ dV_new``.

At the start of the sequence ``X_0`` is the initial state's gradient (float32). ``q̃ = scale·q·e^γ`` and
``k̃ = k·e^{γ_C − γ}`` come from the forward's intermediates for KDA, are formed from ``q``, ``k`` and the stored
cumulative gate for Gated DeltaNet, and are ``scale·q`` and ``k`` for DeltaNet (as in the forward's state pass).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def chunk_bwd_state_kernel(
    q,
    k,
    w,
    aqk,
    qg,
    kg,
    gout,
    do,
    dht,
    dh0,
    dh,
    dvn,
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
    GATE: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
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
    DT = w.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]  # [BK, BV] of one [K, V] state
    off_wk = o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] rows of [tokens, HV, K]
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]  # [BT, BK] rows of [tokens, H, K]
    off_v = o_t[:, None] * (HV * V) + o_v[None, :]  # [BT, BV] rows of [tokens, HV, V]

    b_x = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_x += tl.load(dht + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)

    for i_r in range(NTn):
        i_t = NTn - 1 - i_r
        t0 = bos + i_t * BT
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        row_hv = t0 * HV + i_hv
        row_h = t0 * H + i_h
        b_xc = b_x.to(DT)
        tl.store(dh + ((c0 + i_t) * HV + i_hv) * K * V + off_h, b_xc.to(dh.dtype.element_ty), mask=m_h)

        b_do = tl.load(do + row_hv * V + off_v, mask=m_tv, other=0).to(DT)
        b_A = tl.load(aqk + row_hv * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0)
        b_w = tl.load(w + row_hv * K + off_wk, mask=m_tk, other=0)
        if GATE == 2:
            b_kg = tl.load(kg + row_hv * K + off_wk, mask=m_tk, other=0)
            b_qg = tl.load(qg + row_hv * K + off_wk, mask=m_tk, other=0)
            b_dec = tl.load(gout + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0)
        elif GATE == 1:
            b_gam = tl.load(gout + row_hv + o_t * HV, mask=m_t, other=0)
            b_gC = tl.load(gout + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
            b_k = tl.load(k + row_h * K + off_qk, mask=m_tk, other=0).to(tl.float32)
            b_kg = (b_k * tl.exp(b_gC - b_gam)[:, None]).to(DT)
            b_q = tl.load(q + row_h * K + off_qk, mask=m_tk, other=0).to(tl.float32)
            b_qg = (b_q * (scale * tl.exp(b_gam))[:, None]).to(DT)
        else:
            b_kg = tl.load(k + row_h * K + off_qk, mask=m_tk, other=0).to(DT)
            b_qg = (tl.load(q + row_h * K + off_qk, mask=m_tk, other=0).to(tl.float32) * scale).to(DT)

        b_dv = tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
        b_dv += tl.dot(b_kg, b_xc, input_precision=DOT_PREC)
        b_dvc = b_dv.to(DT)
        tl.store(dvn + row_hv * V + off_v, b_dvc.to(dvn.dtype.element_ty), mask=m_tv)

        if GATE == 2:
            b_x *= b_dec[:, None]
        elif GATE == 1:
            b_x *= tl.exp(b_gC)
        b_x += tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
        b_x -= tl.dot(tl.trans(b_w), b_dvc, input_precision=DOT_PREC)

    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_h, b_x, mask=m_h)
