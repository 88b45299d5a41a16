"""The chunk forward's state pass with the output, warp-specialised for Hopper (``STATE_LOOP = "gluon"``): Gluon, not
Triton's language, so that the data movement runs in its own warp beside the chain of products.

Same algebra as :mod:`.state` in its ``"vk"`` layout with ``WU = "recomputed"`` (DeltaNet and Gated DeltaNet,
``FUSE_OUTPUT``): per chunk, with the transposed state ``Sᵀ`` ``[BV, K]`` in float32 registers,

* ``(K S)ᵀ = Sᵀ kᵀ``; ``Xᵀ = (vᵀ − (K S)ᵀ ⊙ e^γ) ⊙ β`` (per token column); ``V_newᵀ = Xᵀ Tᵀ``
  (``T = (I + A_kk)⁻¹``, stage 1's inverse);
* ``Oᵀ = (Sᵀ qᵀ) ⊙ (scale · e^γ) + V_newᵀ A_qkᵀ`` (``A_qk`` as stage 1 stores it, scale and decay in it; or,
  ``AQK = "recomputed"`` (``QK_RE``), formed here from the k and q tiles by mma.sync, ``BT`` rows being fewer than a
  wgmma's 64, and its product with ``V_newᵀ`` by mma.sync in registers);
* ``Sᵀ ← Sᵀ e^{γ_C} + (V_newᵀ ⊙ e^{γ_C − γ}) k``.

Every other product is a wgmma with the left operand in registers (the state, ``Xᵀ``, ``V_newᵀ``) and the right one
in shared memory; ``OVERLAP`` (``h_OVERLAP``) issues them asynchronously, the output's beside the chain's. fla's
in-kernel l2norm of q and k (``L2NORM``: stage 1's row factors ``rq``, ``rk``) and beta's sigmoid (``BETA_ACT``) act on
the products' token columns as in the Triton pass. Two partitions per program: a one-warp loader that brings each chunk's ``k``, ``q``, ``v`` (this
program's ``BV`` columns), ``T`` and ``A_qk`` tiles by TMA into a ring of ``NUM_BUF`` buffers, and the compute
warpgroups (``BV / 16`` warps, one per 16 state rows) that wait for a buffer, run the chunk and hand it back
(mbarriers both ways). The loader runs up to ``NUM_BUF`` chunks ahead, so the chain never waits for memory once
the ring is full.

A chunk's rows past its sequence hold the next sequence's tokens (TMA reads whole tiles): β reads 0 there and the
columns of ``V_newᵀ`` past the sequence are zeroed, so they reach neither the output (not stored) nor the state.

Runs only on sm_90 (wgmma, TMA, mbarriers) with 16-bit inputs; :func:`why_not` says where not, and the caller runs
the Triton pass there (the interpreter included: Gluon has none). Two programs per SM (``h_maxnreg`` 128 at
``h_BV = 64``) was its fastest form on an H100 (reports/h100/NOTES.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    mma_v2,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .buffers import Intermediates, Outputs
from .call import ChunkCall

_LOG2E = gl.constexpr(1.4426950408889634)
# TMA's global-to-shared copy: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` from 3.7 on
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# ... and its shared-to-global one: ``async_copy_shared_to_global`` in 3.6, ``async_store`` from 3.7 on
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _exp(x):
    return gl.exp2(x * _LOG2E)


@gluon.jit
def _loader(
    k_desc,
    q_desc,
    v_desc,
    t_desc,
    a_desc,
    k_s,
    q_s,
    v_s,
    t_s,
    a_s,
    ready,
    empty,
    bos,
    NT,
    c_qk,
    c_v,
    c_a,
    BT: gl.constexpr,
    NUM_BUF: gl.constexpr,
    QK_RE: gl.constexpr,
):
    """One warp: chunk ``i``'s five tiles (four with ``QK_RE``: no A_qk) into buffer ``i % NUM_BUF`` once the compute
    warps have released it."""
    nbytes: gl.constexpr = (
        k_desc.block_type.nbytes
        + q_desc.block_type.nbytes
        + v_desc.block_type.nbytes
        + t_desc.block_type.nbytes
        + (0 if QK_RE else a_desc.block_type.nbytes)
    )
    for i in range(NT):
        s = i % NUM_BUF
        ph = (i // NUM_BUF) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)  # (a fresh barrier's previous phase counts as complete)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        r = (bos + i * BT).to(gl.int32)
        _tma_load(k_desc, [r, c_qk], bar, k_s.index(s))
        _tma_load(v_desc, [r, c_v], bar, v_s.index(s))
        _tma_load(t_desc, [r, c_a], bar, t_s.index(s))
        _tma_load(q_desc, [r, c_qk], bar, q_s.index(s))
        if not QK_RE:
            _tma_load(a_desc, [r, c_a], bar, a_s.index(s))


@gluon.jit
def _aqk_t(
    k_tile,
    q_tile,
    gout,
    rq,
    rk,
    t0,
    L,
    H,
    HV,
    i_h,
    i_hv,
    scale,
    BT: gl.constexpr,
    GATE: gl.constexpr,
    L2NORM: gl.constexpr,
    mma_a: gl.constexpr,
    mma_o: gl.constexpr,
    KS: gl.constexpr = 32,
):
    """``scale · A_qkᵀ`` of the chunk (``[j, i]``: key row j, query row i; zero unless j ≤ i < L) from its k and q tiles
    in shared memory, as the right operand of the output's ``V_newᵀ A_qkᵀ`` (``mma_o``'s operand layout)."""
    K: gl.constexpr = k_tile.shape[1]
    b_a = gl.zeros([BT, BT], gl.float32, layout=mma_a)
    for d in gl.static_range(0, K, KS):  # (by key slices: fewer operand registers alive)
        b_k = k_tile.slice(d, KS, dim=1).load(gl.DotOperandLayout(operand_index=0, parent=mma_a, k_width=2))
        b_q = (
            q_tile.slice(d, KS, dim=1)
            .permute((1, 0))
            .load(gl.DotOperandLayout(operand_index=1, parent=mma_a, k_width=2))
        )
        b_a = mma_v2(b_k, b_q, b_a)
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(1, mma_a))
    o_i = gl.arange(0, BT, layout=gl.SliceLayout(0, mma_a))
    m_a = (o_j[:, None] <= o_i[None, :]) & (o_i < L)[None, :]
    if L2NORM:
        f_i = gl.load(rq + (t0 + o_i) * H + i_h, mask=o_i < L, other=0) * scale
        f_j = gl.load(rk + (t0 + o_j) * H + i_h, mask=o_j < L, other=0)
        b_a = b_a * f_i[None, :] * f_j[:, None]
    else:
        b_a = b_a * scale
    if GATE == 1:
        g_i = gl.load(gout + (t0 + o_i) * HV + i_hv, mask=o_i < L, other=0)
        g_j = gl.load(gout + (t0 + o_j) * HV + i_hv, mask=o_j < L, other=0)
        b_a = b_a * _exp(gl.where(m_a, g_i[None, :] - g_j[:, None], float("-inf")))
    else:
        b_a = gl.where(m_a, b_a, 0.0)
    return gl.convert_layout(b_a.to(k_tile.dtype), gl.DotOperandLayout(operand_index=1, parent=mma_o, k_width=2))


@gluon.jit
def _compute(
    k_s,
    q_s,
    v_s,
    t_s,
    a_s,
    ready,
    empty,
    gout,
    beta,
    h0,
    ht,
    o,
    rq,
    rk,
    bos,
    eos,
    NT,
    i_nh,
    i_h,
    i_hv,
    v0,
    scale,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    GATE: gl.constexpr,
    USE_H0: gl.constexpr,
    STORE_HT: gl.constexpr,
    NUM_BUF: gl.constexpr,
    OVERLAP: gl.constexpr,
    L2NORM: gl.constexpr,
    BETA_ACT: gl.constexpr,
    QK_RE: gl.constexpr,
    STORE_STATES: gl.constexpr,
    hs_desc,
    vn_desc,
    vnew,
    hs_stage,
    vn_stage,
    c0,
    num_warps: gl.constexpr,
):
    """The compute warpgroups: the chain of products per chunk (module docstring), the output, the final state."""
    DT: gl.constexpr = k_s.dtype
    FACTORS: gl.constexpr = GATE == 1 or L2NORM  # per-token factors on (K S)ᵀ and on V_new in the update
    # wgmma accumulators: [BV, BT] (products with a token axis) and [BV, K] (the state), one warp per 16 rows
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BT, 16]
    )
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, K, 16]
    )
    op_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t, k_width=2)
    op_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_k, k_width=2)
    col_t: gl.constexpr = gl.SliceLayout(0, mma_t)  # a vector over the chunk's tokens
    # QK_RE: A_qkᵀ [BT, BT] and the output's intra-chunk part [BV, BT] by mma.sync (A_qkᵀ has BT < 64 rows), in registers
    mma_a: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    # the output's store: value channels fastest (16 bytes a thread, a warp's 8 × 4 threads over 64 × 4 of [BV, BT])
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])

    # the state Sᵀ [BV, K]: element (v, k) of the [K, V] state in memory
    o_sv = gl.arange(0, BV, layout=gl.SliceLayout(1, mma_k))
    o_sk = gl.arange(0, K, layout=gl.SliceLayout(0, mma_k))
    off_s = o_sk[None, :] * V + (v0 + o_sv)[:, None]
    b_s = gl.zeros([BV, K], gl.float32, layout=mma_k)
    if USE_H0:
        b_s += gl.load(h0 + i_nh.to(gl.int64) * K * V + off_s).to(gl.float32)

    o_t = gl.arange(0, BT, layout=col_t)
    o_ov = gl.arange(0, BV, layout=gl.SliceLayout(1, out_l))
    o_ot = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    zero_t = gl.zeros([BV, BT], gl.float32, layout=mma_t)
    for i in range(NT):
        s = i % NUM_BUF
        ph = (i // NUM_BUF) & 1
        t0 = bos + i * BT
        L = gl.minimum(eos - t0, BT).to(gl.int32)
        m_t = o_t < L
        row = t0 * HV + i_hv  # the chunk's first row of [tokens, HV]
        b_beta = gl.load(beta + row + o_t * HV, mask=m_t, other=0).to(gl.float32)
        if BETA_ACT > 0:  # fla's use_beta_sigmoid_in_kernel: sigmoid(β), or 2 sigmoid(β) (allow_neg_eigval)
            b_beta = gl.where(m_t, BETA_ACT / (1.0 + _exp(-b_beta)), 0.0)
        # the per-token factors on the products' columns: of (K S)ᵀ (f_k), of the output (f_q), of V_new in the update
        b_fq = gl.full([BT], scale, gl.float32, layout=col_t)
        if GATE == 1:
            b_gam = gl.load(gout + row + o_t * HV, mask=m_t, other=0)
            b_gC = gl.load(gout + (t0 + L - 1) * HV + i_hv)
            b_fk = _exp(b_gam)
            b_fq = b_fq * b_fk
            b_fu = _exp(b_gC - b_gam)
        if L2NORM:  # q's and k's rows' l2norm factors (stage 1's)
            b_rq = gl.load(rq + (t0 + o_t) * H + i_h, mask=m_t, other=0)
            b_rk = gl.load(rk + (t0 + o_t) * H + i_h, mask=m_t, other=0)
            b_fq = b_fq * b_rq
            if GATE == 1:
                b_fk = b_fk * b_rk
                b_fu = b_fu * b_rk
            else:
                b_fk = b_rk
                b_fu = b_rk
        mbarrier.wait(ready.index(s), ph)
        kb = k_s.index(s)
        b_sc = gl.convert_layout(b_s.to(DT), op_t)
        if STORE_STATES:  # the chunk-start state for the backward, [K, BV] of [chunks·HV·K, V], by one TMA store
            tma.store_wait(0)  # (the last chunk's stores have read their staging buffers)
            hs_stage.permute((1, 0)).store(b_s.to(DT))
            fence_async_shared()
            _tma_store(hs_desc, [((c0 + i) * HV + i_hv) * K, v0], hs_stage)
        k_t, q_t = kb.permute((1, 0)), q_s.index(s).permute((1, 0))
        t_t = t_s.index(s).permute((1, 0))
        if not QK_RE:
            a_t = a_s.index(s).permute((1, 0))
        # (K S)ᵀ = Sᵀ kᵀ (with OVERLAP the output's Sᵀ qᵀ runs on the tensor cores while Xᵀ is formed)
        if OVERLAP:
            tok_ks = warpgroup_mma(b_sc, k_t, zero_t, use_acc=False, is_async=True)
            tok_sq = warpgroup_mma(b_sc, q_t, zero_t, use_acc=False, is_async=True)
            b_ks, b_sc = warpgroup_mma_wait(1, deps=[tok_ks, b_sc])  # (in order: (K S)ᵀ is done)
        else:
            b_ks = warpgroup_mma(b_sc, k_t, zero_t, use_acc=False)
        # Xᵀ = (vᵀ − (K S)ᵀ e^γ) β
        b_x = v_s.index(s).permute((1, 0)).load(mma_t).to(gl.float32)
        if FACTORS:
            b_x = b_x - b_ks * b_fk[None, :]
        else:
            b_x = b_x - b_ks
        b_x = gl.convert_layout((b_x * b_beta[None, :]).to(DT), op_t)
        # V_newᵀ = Xᵀ Tᵀ, its columns past the sequence zeroed
        if OVERLAP:
            tok_vn = warpgroup_mma(b_x, t_t, zero_t, use_acc=False, is_async=True)
            b_o, b_vn, b_sc, b_x = warpgroup_mma_wait(0, deps=[tok_sq, tok_vn, b_sc, b_x])
        else:
            b_vn = warpgroup_mma(b_x, t_t, zero_t, use_acc=False)
            b_o = warpgroup_mma(b_sc, q_t, zero_t, use_acc=False)
        b_vn = gl.where(m_t[None, :], b_vn, 0.0)
        if STORE_STATES:  # V_new for the backward: a whole chunk by one TMA store, a partial one by pointers
            if L == BT:
                vn_stage.permute((1, 0)).store(b_vn.to(DT))
                fence_async_shared()
                _tma_store(vn_desc, [t0.to(gl.int32), i_hv * V + v0], vn_stage)
            else:
                off_n = (row + o_ot * HV)[None, :].to(gl.int64) * V + (v0 + o_ov)[:, None]
                gl.store(vnew + off_n, gl.convert_layout(b_vn.to(DT), out_l), mask=(o_ot < L)[None, :])
        # Oᵀ = (Sᵀ qᵀ) (scale e^γ) + V_newᵀ A_qkᵀ; Sᵀ ← Sᵀ e^{γ_C} + (V_newᵀ e^{γ_C − γ}) k
        b_o = b_o * b_fq[None, :]
        if FACTORS:
            b_vk = b_vn * b_fu[None, :]
        else:
            b_vk = b_vn
        if GATE == 1:
            b_s = b_s * _exp(b_gC)
        b_vk = gl.convert_layout(b_vk.to(DT), op_k)
        if QK_RE:  # Oᵀ += V_newᵀ A_qkᵀ by mma.sync, both operands in registers, beside the state update's wgmma
            tok_s = warpgroup_mma(b_vk, kb, b_s, is_async=True)
            # scale · A_qkᵀ [j, i] = scale · k_j · q_i e^{γ_i − γ_j} (j ≤ i < L), from the tiles in shared memory
            b_at = _aqk_t(
                kb, q_s.index(s), gout, rq, rk, t0, L, H, HV, i_h, i_hv, scale, BT, GATE, L2NORM, mma_a, mma_o
            )
            b_vo = gl.convert_layout(b_vn.to(DT), gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))
            b_o = gl.convert_layout(mma_v2(b_vo, b_at, gl.convert_layout(b_o, mma_o)), mma_t)
            b_s, b_vk = warpgroup_mma_wait(0, deps=[tok_s, b_vk])
        elif OVERLAP:
            b_vo = gl.convert_layout(b_vn.to(DT), op_t)
            tok_o = warpgroup_mma(b_vo, a_t, b_o, is_async=True)
            tok_s = warpgroup_mma(b_vk, kb, b_s, is_async=True)
            b_o, b_s, b_vo, b_vk = warpgroup_mma_wait(0, deps=[tok_o, tok_s, b_vo, b_vk])
        else:
            b_vo = gl.convert_layout(b_vn.to(DT), op_t)
            b_o = warpgroup_mma(b_vo, a_t, b_o)
            b_s = warpgroup_mma(b_vk, kb, b_s)
        fence_async_shared()  # (v's tile was read through the generic proxy; the next TMA load writes it)
        mbarrier.arrive(empty.index(s), count=1)
        # the output's rows of this chunk: [BV, BT] of Oᵀ to o[t0 + t, i_hv, v0 + v]
        b_out = gl.convert_layout(b_o.to(o.dtype.element_ty), out_l)
        off_o = (row + o_ot * HV)[None, :].to(gl.int64) * V + (v0 + o_ov)[:, None]
        gl.store(o + off_o, b_out, mask=(o_ot < L)[None, :])
    if STORE_STATES:
        tma.store_wait(0)
    if STORE_HT:
        # the state's offsets again, from a zero the compiler cannot fold (NT >= 0): otherwise it reuses the tile
        # computed before the loop, 64 registers a thread kept alive through it
        off_s = o_sk[None, :] * V + (v0 + gl.minimum(NT, 0) + o_sv)[:, None]
        gl.store(ht + i_nh.to(gl.int64) * K * V + off_s, b_s)


@gluon.jit(do_not_specialize=["T"])
def chunk_state_ws_kernel(
    k_desc,
    q_desc,
    v_desc,
    t_desc,
    a_desc,
    gout,
    beta,
    h0,
    ht,
    o,
    bounds,
    scale,
    T,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    GATE: gl.constexpr,
    USE_H0: gl.constexpr,
    STORE_HT: gl.constexpr,
    VARLEN: gl.constexpr,
    NUM_BUF: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
    OVERLAP: gl.constexpr = True,
    L2NORM: gl.constexpr = False,
    BETA_ACT: gl.constexpr = 0,
    rq=None,
    rk=None,
    QK_RE: gl.constexpr = False,
    STORE_STATES: gl.constexpr = False,
    hs_desc=None,
    vn_desc=None,
    vnew=None,
    chunk_offsets=None,
):
    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = gl.load(bounds + i_n).to(gl.int64)
        eos = gl.load(bounds + i_n + 1).to(gl.int64)
    else:
        bos = i_n.to(gl.int64) * T
        eos = bos + T
    NT = gl.cdiv(eos - bos, BT).to(gl.int32)

    k_s = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF, BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF, BT, K], q_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF, BT, BV], v_desc.layout)
    t_s = gl.allocate_shared_memory(t_desc.dtype, [NUM_BUF, BT, BT], t_desc.layout)
    if QK_RE:  # (A_qk formed in the pass: no buffer of it; a_desc is t_desc, never loaded)
        a_s = t_s
    else:
        a_s = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BT, BT], a_desc.layout)
    if STORE_STATES:  # the sequence's first chunk in the chunk states' index; the stores' staging buffers
        if VARLEN:
            c0 = gl.load(chunk_offsets + i_n).to(gl.int32)
        else:
            c0 = i_n * gl.cdiv(T, BT)
        hs_stage = gl.allocate_shared_memory(hs_desc.dtype, [K, BV], hs_desc.layout)
        vn_stage = gl.allocate_shared_memory(vn_desc.dtype, [BT, BV], vn_desc.layout)
    else:  # (constant stand-ins, never touched: a partition's arguments cannot be None)
        c0 = 0
        hs_stage = 0
        vn_stage = 0
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
    v0 = i_v * BV
    gl.warp_specialize(
        [
            (
                _compute,
                (k_s, q_s, v_s, t_s, a_s, ready, empty, gout, beta, h0, ht, o, rq, rk, bos, eos, NT, i_nh, i_h, i_hv,
                 v0, scale, H, HV, K, V, BT, BV, GATE, USE_H0, STORE_HT, NUM_BUF, OVERLAP, L2NORM, BETA_ACT,
                 QK_RE, STORE_STATES, hs_desc if STORE_STATES else 0, vn_desc if STORE_STATES else 0,
                 vnew if STORE_STATES else 0, hs_stage, vn_stage, c0, num_warps),
            ),
            (
                _loader,
                (k_desc, q_desc, v_desc, t_desc, a_desc, k_s, q_s, v_s, t_s, a_s, ready, empty, bos, NT,
                 i_h * K, i_hv * V + v0, i_hv * BT, BT, NUM_BUF, QK_RE),
            ),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip
    for b in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(b))
        mbarrier.invalidate(empty.index(b))


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def why_not(call: ChunkCall, capability: tuple[int, int] | None = None) -> str | None:
    """Why the Gluon pass cannot serve this call (then the Triton pass runs its config), or None where it can.
    ``capability``: the GPU's compute capability (default: the call's device's; none on the CPU)."""
    cfg = call.config
    why = gluon_refusal(call.device, capability, call.gate, call.dt, (call.q, call.k, call.v))
    if why is not None:
        return why
    if not call.recompute or not call.fuse:
        return 'needs WU = "recomputed" and FUSE_OUTPUT'
    if call.tables.segments is not None:
        return "sequence-parallel (SEG_CHUNKS)"
    if call.K not in (64, 128) or call.BT not in (32, 64):
        return "K not 64 or 128, or BT not 32 or 64"
    if call.V % call.h_BV or call.h_BV not in (64, 128):
        return "h_BV not 64 or 128, or not dividing V"
    if int(cfg.get("h_num_stages", 2)) < 1:
        return "h_num_stages < 1"
    return None


def gluon_refusal(
    device: torch.device,
    capability: tuple[int, int] | None,
    gate: int,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, ...],
) -> str | None:
    """What every Gluon kernel of the chunk pipeline refuses (the backward's ``why_not`` start here): no sm_90 GPU
    (``capability``: the device's where not given; none on the CPU), KDA's per-channel decays, inputs not all bf16 or
    all fp16, no tokens, or an input not 16-byte aligned for TMA; None where none applies."""
    if capability is None and device.type == "cuda":
        capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if capability is None or capability[0] != 9:
        return "not an sm_90 GPU (wgmma, TMA; Gluon has no interpreter)"
    if gate == 2:
        return "KDA (per-channel decays)"
    if dtype not in GL_DTYPES or any(t.dtype != dtype for t in inputs):
        return "inputs not all bf16 or all fp16"
    if any(not t.numel() for t in inputs) or any(t.data_ptr() % 16 for t in inputs):
        return "no tokens, or an input not 16-byte aligned (TMA)"
    return None


@functools.cache
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_descriptor(t: torch.Tensor, rows: int, width: int, block: list[int]) -> TensorDescriptor:
    """A Gluon TMA descriptor of ``t`` as a ``[rows, width]`` matrix, ``block`` tiles in the NVMMA shared layout (the
    layout object cached: building it is most of a descriptor's host time)."""
    return TensorDescriptor(t.view(rows, width), [rows, width], [width, 1], block, _smem_layout(tuple(block), t.dtype))


def launch_state_ws(call: ChunkCall, inter: Intermediates, out: Outputs) -> Any:
    """The warp-specialised state pass with the output (``why_not(call)`` must be None): one program per value tile
    of ``h_BV`` columns, sequence and value head; ``h_num_stages`` buffers in the loader's ring. Where ``inter`` holds
    chunk-state and V_new buffers (the training forward's) it fills them too (``STORE_STATES``: by TMA stores, a
    sequence's partial last chunk of V_new by pointers)."""
    rows, H, HV, K, V, BT, BV = call.tokens, call.H, call.HV, call.K, call.V, call.BT, call.h_BV
    assert inter.ai is not None and out.o is not None
    states = inter.h is not None and inter.v_new is not None  # (the training forward's: stored for the backward)
    extra: dict[str, Any] = {}
    if states:
        assert inter.h is not None and inter.v_new is not None
        extra = {
            "STORE_STATES": True,
            "hs_desc": tma_descriptor(inter.h, inter.h.numel() // V, V, [K, BV]),
            "vn_desc": tma_descriptor(inter.v_new, rows, HV * V, [BT, BV]),
            "vnew": inter.v_new,
            "chunk_offsets": call.tables.chunk_offsets,
        }
    aqk = inter.aqk if inter.aqk is not None else inter.ai  # (AQK = "recomputed": a stand-in, never loaded)
    grid = (V // BV, call.N * HV)
    return chunk_state_ws_kernel[grid](
        tma_descriptor(call.k, rows, H * K, [BT, K]),
        tma_descriptor(call.q, rows, H * K, [BT, K]),
        tma_descriptor(call.v, rows, HV * V, [BT, BV]),
        tma_descriptor(inter.ai, rows, HV * BT, [BT, BT]),
        tma_descriptor(aqk, rows, HV * BT, [BT, BT]),
        inter.gout if inter.gout is not None else call.beta,
        call.beta,
        call.h0,
        out.final_state,
        out.o,
        call.tables.seq_bounds,
        call.scale,
        call.T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=BT,
        BV=BV,
        GATE=call.gate,
        USE_H0=call.h0 is not None,
        STORE_HT=call.output_final_state,
        VARLEN=call.tables.seq_bounds is not None,
        NUM_BUF=max(1, int(call.config.get("h_num_stages", 2))),
        LOADER_REGS=int(call.config.get("ws_loader_regs", 40)),
        num_warps=BV // 16,
        OVERLAP=bool(call.config.get("h_OVERLAP", True)),
        QK_RE=call.recompute_qk,
        **call.in_kernel.chunk_args(),
        **inter.rnorm_args(),
        **extra,
        **({"maxnreg": int(call.config["h_maxnreg"])} if int(call.config.get("h_maxnreg", 0)) else {}),
    )
