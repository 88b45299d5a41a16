"""Stage 3 of the chunk forward (unless the state pass fused it): the output, chunk-parallel.

One program per (chunk, V tile, value head): ``O = q̃ S_c + A_qk V_new`` with ``q̃ = scale·q·exp(γ)``, the
chunk-start state ``S_c`` and ``V_new`` stored by the state pass, the key dimension in tiles of ``BK``.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from .buffers import Intermediates, Outputs
from .call import ChunkCall, tile
from .common import chunk_bounds


@triton.jit(do_not_specialize=["T"])
def chunk_output_kernel(
    q,
    aqk,
    qg,
    gout,
    hbuf,
    vnew,
    o,
    chunk_info,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NK: tl.constexpr,
    GATE: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    L2NORM: tl.constexpr = False,
    rq=None,
):
    """``L2NORM``: q l2-normalised (DeltaNet, Gated DeltaNet; KDA's q~ is stage 1's): its rows' factors (``rq``
    ``[tokens, H]``, stored by stage 1) on ``q S_c``'s rows (A_qk comes normalised from stage 1)."""
    i_c, i_v, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos, eos = chunk_bounds(chunk_info, i_c, T, BT, VARLEN)
    DT = vnew.dtype.element_ty
    L = tl.minimum(eos - bos, BT).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    if GATE == 1:
        b_eg = tl.exp(tl.load(gout + bos * HV + i_hv + o_t * HV, mask=m_t, other=0)) * scale
    if GATE == 2:
        q_b = qg + (bos * HV + i_hv) * K
        q_stride = HV * K
    else:
        q_b = q + (bos * H + i_h) * K
        q_stride = H * K
    h_b = hbuf + (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        if GATE == 2:
            b_q = tl.load(q_b + o_t[:, None] * q_stride + o_k[None, :], mask=m_tk, other=0)
        else:
            b_q = tl.load(q_b + o_t[:, None] * q_stride + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            b_q = (b_q * (b_eg[:, None] if GATE == 1 else scale)).to(DT)
        b_h = tl.load(h_b + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
        b_o += tl.dot(b_q, b_h, input_precision=DOT_PREC)
    if L2NORM and GATE != 2:
        b_o *= tl.load(rq + (bos * H + i_h) + o_t * H, mask=m_t, other=0.0)[:, None]
    b_A = tl.load(aqk + (bos * HV + i_hv) * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0)
    b_vn = tl.load(vnew + (bos * HV + i_hv) * V + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0)
    b_o += tl.dot(b_A, b_vn, input_precision=DOT_PREC)
    tl.store(o + (bos * HV + i_hv) * V + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def launch_output(call: ChunkCall, inter: Intermediates, out: Outputs) -> Any:
    """Stage 3 (unfused only): one program per chunk, V tile and value head."""
    if call.NC == 0:
        return None
    cfg = call.config
    BK, BV = tile(cfg["o_BK"], call.K), tile(cfg["o_BV"], call.V)
    return chunk_output_kernel[(call.NC, triton.cdiv(call.V, BV), call.HV)](
        call.q, inter.aqk, inter.qg, inter.gout, inter.h, inter.v_new, out.o, call.tables.chunk_info, call.scale,
        call.T, H=call.H, HV=call.HV, K=call.K, V=call.V, BT=call.BT, BK=BK, BV=BV, NK=triton.cdiv(call.K, BK),
        GATE=call.gate, VARLEN=call.varlen, DOT_PREC=call.dot_prec, L2NORM=call.in_kernel.l2norm,
        rq=None if inter.rnorm is None else inter.rnorm[0], **call.warps("o"),
    )  # fmt: skip
