"""Stage 2 of the chunk forward: the inter-chunk state pass, sequential over chunks (one program per sequence, value
head and V tile), the state tile (all key channels) in float32 registers.

Per chunk: ``V_new = U − W S`` (S cast to the intermediates' dtype for the tensor-core dot), then either store
``S`` (chunk-start state) and ``V_new`` for the chunk-parallel output stage, or (``FUSE_OUTPUT``) compute the
output right here, ``O = q̃ S + A_qk V_new`` (with ``STORE_STATES``, the backward's forward under autograd, storing
both as well); finally ``S ← diag(exp(γ_C)) S + k̃ᵀ V_new``.

Two layouts of the state tile (``STATE_LAYOUT``, the constexpr ``TRANS``):

* ``"kv"``: ``S`` ``[BK, BV]``, the products as written above.
* ``"vk"``: ``Sᵀ`` ``[BV, BK]``, the transposed products ``V_newᵀ = Uᵀ − Sᵀ Wᵀ``, ``Oᵀ = Sᵀ q̃ᵀ + V_newᵀ A_qkᵀ``,
  ``Sᵀ ← Sᵀ diag(exp(γ_C)) + V_newᵀ k̃``. The state and ``V_newᵀ`` are then the left operand of every dot: on
  Hopper, with ``BV`` = 64 rows per warpgroup, both dots of the sequential chain are wgmma with that operand in
  registers, so the chain from one chunk's state to the next need not pass through shared memory (in ``"kv"``
  the state and ``V_new`` are right operands, a shared-memory round trip each). Same loads, same arithmetic.

Sequence-parallel mode (``SEG_CHUNKS > 0``, constexpr ``SEG``; docs/DESIGN.md §1): per chunk the update is affine,
``S_{c+1} = M_c S_c + N_c`` with ``M_c = diag(exp(γ_C)) − k̃ᵀ W`` (K × K) and ``N_c = k̃ᵀ U``, so a segment of chunks
maps its entering state as ``S_end = M_seg S_start + N_seg``.

* ``SEG = 1`` (phase 1, transitions): programs run over segments (``bounds`` / ``chunk_offsets`` are the segment
  table's) and over ``⌈V/BV⌉ + ⌈K/BV⌉`` column tiles of the extended state ``[K, V + K]``: the first tiles are the
  ordinary pass from zero (giving ``N_seg``), the others start from the identity with ``U = 0`` (only the
  ``− W X`` and decay terms act, giving ``M_seg``). No output; the result goes to ``ext`` (float32
  ``[NS, HV, K, V + K]``). The last segment of each sequence is skipped (its transition is never needed).
* ``SEG = 2`` (phase 3): the ordinary pass per segment from its true entering state (``h0`` is the per-segment
  ``starts`` of phase 2); the final state is stored by the last segment of each sequence (``seg_last``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from ..config import Config
from .buffers import Intermediates, Outputs, SegmentScratch
from .call import ChunkCall, tile


@triton.jit(do_not_specialize=["T"])
def chunk_state_kernel(
    q,
    k,
    w,
    u,
    aqk,
    qg,
    kg,
    gout,
    h0,
    ht,
    hbuf,
    vnew,
    o,
    bounds,
    chunk_offsets,
    seg_last,
    ext,
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
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    VARLEN: tl.constexpr,
    FUSE_OUTPUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TRANS: tl.constexpr = False,
    SEG: tl.constexpr = 0,
    QK_DIRECT: tl.constexpr = False,
    STORE_STATES: tl.constexpr = False,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if SEG == 1:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if tl.load(seg_last + i_n) >= 0:
            return
    if VARLEN:
        bos = tl.load(bounds + i_n).to(tl.int64)
        eos = tl.load(bounds + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    NTn = tl.cdiv(eos - bos, BT).to(tl.int32)
    DT = w.dtype.element_ty

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if SEG == 1:
        # column tile i_v of the extended state [K, V + K]: V tiles of N, then K tiles of M (an identity start)
        NVV = tl.cdiv(V, BV)
        is_m = i_v >= NVV
        o_v = tl.where(is_m, i_v - NVV, i_v) * BV + tl.arange(0, BV)
        m_v = o_v < tl.where(is_m, K, V)
        m_u = o_v < tl.where(is_m, 0, V)  # U = 0 in the M columns
        o_e = o_v + tl.where(is_m, V, 0)  # column of the extended state
    else:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_u = m_v

    # Tile offsets inside one chunk (int32, loop-invariant); the chunk's base pointers are scalars (int64).
    off_wk = o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] rows of [tokens, HV, K]
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]  # [BT, BK] rows of [tokens, H, K]
    if TRANS:
        m_h = m_v[:, None] & m_k[None, :]
        off_h = o_k[None, :] * V + o_v[:, None]  # [BV, BK] of one [K, V] state, transposed
        off_v = o_t[None, :] * (HV * V) + o_v[:, None]  # [BV, BT] rows of [tokens, HV, V], transposed
        b_h = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        m_h = m_k[:, None] & m_v[None, :]
        off_h = o_k[:, None] * V + o_v[None, :]  # [BK, BV] of one [K, V] state
        off_v = o_t[:, None] * (HV * V) + o_v[None, :]  # [BT, BV] rows of [tokens, HV, V]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if SEG == 1:
        if TRANS:
            b_h = tl.where(is_m & (o_v[:, None] == o_k[None, :]), 1.0, b_h)
        else:
            b_h = tl.where(is_m & (o_k[:, None] == o_v[None, :]), 1.0, b_h)
    elif USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)

    for i_t in range(NTn):
        t0 = bos + i_t * BT
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = (m_v[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_v[None, :])
        m_tu = (m_u[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_u[None, :])
        row_hv = t0 * HV + i_hv  # scalar: first row of the chunk in [tokens, HV, ...]
        row_h = t0 * H + i_h
        b_w = tl.load(w + row_hv * K + off_wk, mask=m_tk, other=0)
        b_u = tl.load(u + row_hv * V + off_v, mask=m_tu, other=0).to(tl.float32)
        b_hc = b_h.to(DT)
        if TRANS:
            b_vn = b_u - tl.dot(b_hc, tl.trans(b_w), input_precision=DOT_PREC)
        else:
            b_vn = b_u - tl.dot(b_w, b_hc, input_precision=DOT_PREC)
        b_vnc = b_vn.to(DT)
        if GATE == 1:
            b_gam = tl.load(gout + row_hv + o_t * HV, mask=m_t, other=0)
            b_gC = tl.load(gout + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        if SEG == 1:
            pass  # transitions only: no output, no chunk states
        elif FUSE_OUTPUT:
            b_A = tl.load(aqk + row_hv * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None], other=0)
            if GATE == 2:
                b_q = tl.load(qg + row_hv * K + off_wk, mask=m_tk, other=0)
            elif QK_DIRECT:
                b_q = tl.load(q + row_h * K + off_qk, mask=m_tk, other=0).to(DT)
            else:
                b_q = tl.load(q + row_h * K + off_qk, mask=m_tk, other=0).to(tl.float32) * scale
                if GATE == 1:
                    b_q *= tl.exp(b_gam)[:, None]
                b_q = b_q.to(DT)
            if TRANS:
                b_o = tl.dot(b_hc, tl.trans(b_q), input_precision=DOT_PREC)
            else:
                b_o = tl.dot(b_q, b_hc, input_precision=DOT_PREC)
            if GATE != 2 and QK_DIRECT:  # the rows' factor scale · exp(γ) on the product, not on q
                b_qf = tl.full([BT], scale, dtype=tl.float32)
                if GATE == 1:
                    b_qf *= tl.exp(b_gam)
                b_o *= b_qf[None, :] if TRANS else b_qf[:, None]
            if TRANS:
                b_o += tl.dot(b_vnc, tl.trans(b_A), input_precision=DOT_PREC)
            else:
                b_o += tl.dot(b_A, b_vnc, input_precision=DOT_PREC)
            tl.store(o + row_hv * V + off_v, b_o.to(o.dtype.element_ty), mask=m_tv)
        if SEG != 1 and (not FUSE_OUTPUT or STORE_STATES):  # (STORE_STATES: the backward's, with the output too)
            tl.store(hbuf + ((c0 + i_t) * HV + i_hv) * K * V + off_h, b_hc.to(hbuf.dtype.element_ty), mask=m_h)
            tl.store(vnew + row_hv * V + off_v, b_vnc.to(vnew.dtype.element_ty), mask=m_tv)
        b_vk = b_vnc  # V_new as the state update's operand
        if GATE == 2:
            b_kg = tl.load(kg + row_hv * K + off_wk, mask=m_tk, other=0)
            b_dec = tl.load(gout + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0)
            if TRANS:
                b_h *= b_dec[None, :]
            else:
                b_h *= b_dec[:, None]
        elif GATE == 1:
            if QK_DIRECT:  # k~ᵀ V_new = kᵀ (exp(γ_C − γ) ⊙ V_new): the factor on the token rows of V_new
                b_kg = tl.load(k + row_h * K + off_qk, mask=m_tk, other=0).to(DT)
                b_dk = tl.exp(b_gC - b_gam)
                b_vk = (b_vn * (b_dk[None, :] if TRANS else b_dk[:, None])).to(DT)
            else:
                b_kg = tl.load(k + row_h * K + off_qk, mask=m_tk, other=0).to(tl.float32)
                b_kg = (b_kg * tl.exp(b_gC - b_gam)[:, None]).to(DT)
            b_h *= tl.exp(b_gC)
        else:
            b_kg = tl.load(k + row_h * K + off_qk, mask=m_tk, other=0).to(DT)
        if TRANS:
            b_h += tl.dot(b_vk, b_kg, input_precision=DOT_PREC)
        else:
            b_h += tl.dot(tl.trans(b_kg), b_vk, input_precision=DOT_PREC)

    if SEG == 1:
        # the extended state [K, V + K] of this segment: N_seg in columns :V, M_seg in columns V:
        if TRANS:
            off_e = o_k[None, :] * (V + K) + o_e[:, None]
        else:
            off_e = o_k[:, None] * (V + K) + o_e[None, :]
        tl.store(ext + i_nh.to(tl.int64) * K * (V + K) + off_e, b_h, mask=m_h)
    elif SEG == 2:
        if STORE_HT:
            i_out = tl.load(seg_last + i_n)
            if i_out >= 0:  # the sequence's last segment: its end state is the final state
                tl.store(ht + (i_out.to(tl.int64) * HV + i_hv) * K * V + off_h, b_h, mask=m_h)
    elif STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_h, b_h, mask=m_h)


def _launch(
    call: ChunkCall,
    inter: Intermediates,
    grid: tuple[int, int],
    h0: Any,
    ht: Any,
    o: Any,
    bounds: Any,
    chunk_offsets: Any,
    seg_last: Any,
    ext: Any,
    seg: int,
    fuse: bool,
    store_ht: bool,
    BV: int,
    launch: dict[str, Any],
) -> Any:
    return chunk_state_kernel[grid](
        call.q,
        call.k,
        inter.w,
        inter.u,
        inter.aqk,
        inter.qg,
        inter.kg,
        inter.gout,
        h0,
        ht,
        inter.h,
        inter.v_new,
        o,
        bounds,
        chunk_offsets,
        seg_last,
        ext,
        call.scale,
        call.T,
        H=call.H,
        HV=call.HV,
        K=call.K,
        V=call.V,
        BT=call.BT,
        BK=call.BK,
        BV=BV,
        GATE=call.gate,
        USE_H0=h0 is not None,
        STORE_HT=store_ht,
        VARLEN=bounds is not None,
        FUSE_OUTPUT=fuse,
        DOT_PREC=call.dot_prec,
        TRANS=call.config["STATE_LAYOUT"] == "vk",
        SEG=seg,
        QK_DIRECT=bool(call.config.get("QK_DIRECT", False)),
        STORE_STATES=fuse and inter.h is not None,
        **launch,
    )


def launch_state(call: ChunkCall, inter: Intermediates, out: Outputs, scratch: SegmentScratch | None) -> Any:
    """The state pass (with the output when ``FUSE_OUTPUT``): per sequence, or per segment from ``scratch.starts``."""
    t = call.tables
    BV = call.h_BV
    if scratch is None:
        grid = (triton.cdiv(call.V, BV), call.N * call.HV)
        return _launch(
            call, inter, grid, call.h0, out.final_state, out.o, t.seq_bounds, t.chunk_offsets, None, None, 0,
            call.fuse, call.output_final_state, BV, call.warps("h"),
        )  # fmt: skip
    seg = t.segments
    assert seg is not None
    grid = (triton.cdiv(call.V, BV), seg.NS * call.HV)
    return _launch(
        call, inter, grid, scratch.starts, out.final_state, out.o, seg.bounds, seg.chunk_offsets, seg.last, None, 2,
        call.fuse, call.output_final_state, BV, call.warps("h"),
    )  # fmt: skip


def transitions_tile(config: Config, K: int, V: int) -> tuple[int, dict[str, Any]]:
    """Phase 1's column tile of the extended state ``[K, V + K]`` and its launch options: ``tr_BV`` and
    ``tr_num_warps``, or the state pass's ``h_BV`` and ``h_num_warps`` where they are 0; ``h_num_stages``. Clipped
    like ``h_BV`` (to the padded V): the N columns take ``⌈V / BV⌉`` tiles, the M columns ``⌈K / BV⌉``."""
    BV = tile(int(config["tr_BV"]) or int(config["h_BV"]), V)
    warps = int(config["tr_num_warps"]) or int(config["h_num_warps"])
    return BV, {"num_warps": warps, "num_stages": int(config["h_num_stages"])}


def launch_transitions(call: ChunkCall, inter: Intermediates, scratch: SegmentScratch) -> Any:
    """Phase 1 of the sequence-parallel pass: ``N_seg`` and ``M_seg`` of every segment but the last of a sequence."""
    seg = call.tables.segments
    assert seg is not None
    BV, launch = transitions_tile(call.config, call.K, call.V)
    grid = (triton.cdiv(call.V, BV) + triton.cdiv(call.K, BV), seg.NS * call.HV)
    return _launch(
        call, inter, grid, None, None, None, seg.bounds, seg.chunk_offsets, seg.last, scratch.transitions, 1,
        False, False, BV, launch,
    )  # fmt: skip
