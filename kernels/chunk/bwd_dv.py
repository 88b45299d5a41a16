"""Backward stage 2 (chunk-parallel, one program per chunk and value head): everything that contracts over V.

With ``T = (I + A_kk)⁻¹`` stored by the forward's stage 1, ``V_new`` from the forward's state pass and ``dV_new``
from the reverse state pass, over value tiles of ``BV`` channels:

* ``dA_qk = causal(dO V_newᵀ)``, stored times ``scale`` (the gradient of ``Σ_d q_i k_j D_ij``), ``[tokens, HV, BT]``;
* ``dVβ = Tᵀ dV_new`` (the gradient of ``β V``; stored in the intermediates' dtype for stage 3, which forms
  ``dKβ = −dVβ S_cᵀ``), ``dv = β dVβ`` (v's dtype, final) and the ``v`` part of ``dβ``: ``Σ_v dVβ ⊙ v``;
* ``dA_kk = strictly_lower(−dVβ V_newᵀ)`` (``−Tᵀ dT Tᵀ`` with ``dT = dW Kβᵀ + dU Vβᵀ``, which collapses to this
  because ``V_new = T (Vβ − Kβ S_c)``), ``[tokens, HV, BT]``.

Both dA are stored in the intermediates' dtype (the later stages' dots take them in that dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import chunk_bounds


@triton.jit(do_not_specialize=["T"])
def chunk_bwd_dv_kernel(
    v,
    beta,
    ai,
    vnew,
    dvn,
    do,
    dv,
    dvb,
    daq,
    dak,
    dbeta_part,
    chunk_info,
    scale,
    T,
    HV: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    DT = vnew.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    row = bos * HV + i_hv  # first row of the chunk in [tokens, HV, ...]
    m_low = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    off_a = o_t[:, None] * (HV * BT) + o_t[None, :]
    b_T = tl.load(ai + row * BT + off_a, mask=m_low, other=0).to(DT)  # lower triangular, unit diagonal
    b_beta = tl.load(beta + row + o_t * HV, mask=m_t, other=0).to(tl.float32)

    b_daq = tl.zeros([BT, BT], dtype=tl.float32)
    b_dak = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(NV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        off_v = row * V + o_t[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + off_v, mask=m_tv, other=0).to(DT)
        b_vn = tl.load(vnew + off_v, mask=m_tv, other=0)
        b_dvn = tl.load(dvn + off_v, mask=m_tv, other=0)
        b_v = tl.load(v + off_v, mask=m_tv, other=0).to(tl.float32)
        b_daq += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dvb = tl.dot(tl.trans(b_T), b_dvn, input_precision=DOT_PREC)
        tl.store(dvb + off_v, b_dvb.to(dvb.dtype.element_ty), mask=m_tv)
        tl.store(dv + off_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * b_v, 1)
        b_dak -= tl.dot(b_dvb.to(DT), tl.trans(b_vn), input_precision=DOT_PREC)

    b_daq = tl.where(m_low, b_daq, 0.0) * scale
    b_dak = tl.where(m_t[:, None] & (o_t[None, :] < o_t[:, None]), b_dak, 0.0)
    tl.store(daq + row * BT + off_a, b_daq.to(daq.dtype.element_ty), mask=m_t[:, None])
    tl.store(dak + row * BT + off_a, b_dak.to(dak.dtype.element_ty), mask=m_t[:, None])
    tl.store(dbeta_part + row + o_t * HV, b_db, mask=m_t)
