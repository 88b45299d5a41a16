"""The backward's reverse state pass, warp-specialised for Hopper (``dh_LOOP = "gluon"``): Gluon, not Triton's
language, so that the data movement runs in its own warp beside the chain of products, as the forward's
:mod:`.state_ws`.

Same algebra as :mod:`.bwd_state` in its ``"vk"`` layout with ``REVERSE_DV`` (DeltaNet and Gated DeltaNet), walking a
sequence's chunks from the last to the first with the transposed adjoint ``Xᵀ`` ``[BV, K]`` (``X = X_{c+1}``, the
adjoint of the state after the chunk) in float32 registers; per chunk:

* store ``X_{c+1}`` (the chunk-parallel dq/dk stage reads it; by one TMA store, off the chain);
* ``dV_newᵀ = dOᵀ A_qk + (Xᵀ kᵀ) ⊙ e^{γ_C − γ}`` (per token column; the columns past the sequence zeroed);
* ``dVβᵀ = dV_newᵀ T`` (``T = (I + A_kk)⁻¹``, stage 1's, zero above its diagonal: ``fh_U = "recomputed"``), stored
  with ``dv = β ⊙ dVβ`` and dβ's ``v`` part ``Σ_v dVβ ⊙ v`` (this value tile's slot of ``dbeta_part``), off the chain;
* ``Xᵀ ← Xᵀ e^{γ_C} + (dOᵀ ⊙ scale e^γ) q − dV_newᵀ W``, the last product from ``W`` as stage 1 stored it, or
  (``fh_W = "recomputed"``, ``W_FROM_K``) as ``(dVβᵀ ⊙ β e^γ) k``, one more product on the chain and no W read.

At the sequence's start ``X`` is the initial state's gradient (float32). Sequence-parallel (``dh_SEG_CHUNKS``,
constexpr ``SEG``): the third phase of :mod:`.bwd_segments`, one program per segment walking from the end adjoint
that phases 1 and 2 (Triton's) gave it, the sequence's first segment storing the initial state's gradient.

Every product is a wgmma with its left operand in registers (the adjoint, ``dOᵀ``, ``dV_newᵀ``, ``dVβᵀ``) and its
right one in shared memory, issued asynchronously: ``dOᵀ A_qk`` and ``dOᵀ q`` beside the chain's. With ``fh_AQK =
"recomputed"`` (``QK_RE``) ``A_qk`` is formed here from the q and k tiles by mma.sync, and ``dOᵀ A_qk`` by mma.sync
with both operands in registers (a wgmma's right operand would have to go through shared memory).

Two partitions per program (one per value tile of ``BV`` columns, sequence and value head): a one-warp loader that
brings each chunk's ``dO``, ``q``, ``k``, ``T``, ``v`` (``A_qk``, ``W`` where read) by TMA into a ring of ``NUM_BUF``
buffers, last chunk first, and the compute warps (``BV / 16``, one per 16 adjoint rows) that wait for a buffer, run the
chunk and hand it back (mbarriers both ways). A chunk's rows past its sequence hold the next sequence's tokens (TMA
reads whole tiles): ``dO``'s columns there are zeroed before its products, β and the gate's factors read 0 there, and
``dV_new``'s columns past the sequence are zeroed, so they reach no output and not the adjoint.

Runs only on sm_90 with 16-bit inputs; :func:`why_not` says where not, and the caller runs the Triton pass there (the
interpreter included: Gluon has none).
"""

from __future__ import annotations

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

from .state_ws import _exp, _tma_load, _tma_store, gluon_refusal, tma_descriptor

SMEM_LIMIT = 227 * 1024  # shared memory one program may take on sm_90 (bytes)


@gluon.jit
def _loader(
    do_desc,
    q_desc,
    k_desc,
    t_desc,
    v_desc,
    a_desc,
    w_desc,
    do_s,
    q_s,
    k_s,
    t_s,
    v_s,
    a_s,
    w_s,
    ready,
    empty,
    bos,
    NT,
    c_v,
    c_qk,
    c_a,
    c_k,
    BT: gl.constexpr,
    NUM_BUF: gl.constexpr,
    QK_RE: gl.constexpr,
    W_READ: gl.constexpr,
):
    """One warp: the ``i``-th chunk from the sequence's end (its dO, q, k, T, v; A_qk and W where read) into buffer
    ``i % NUM_BUF`` once the compute warps have released it."""
    nbytes: gl.constexpr = (
        do_desc.block_type.nbytes
        + q_desc.block_type.nbytes
        + k_desc.block_type.nbytes
        + t_desc.block_type.nbytes
        + v_desc.block_type.nbytes
        + (0 if QK_RE else a_desc.block_type.nbytes)
        + (w_desc.block_type.nbytes if W_READ else 0)
    )
    for i in range(NT):
        s = i % NUM_BUF
        ph = (i // NUM_BUF) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)  # (a fresh barrier's previous phase counts as complete)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        r = (bos + (NT - 1 - i) * BT).to(gl.int32)
        _tma_load(do_desc, [r, c_v], bar, do_s.index(s))
        _tma_load(k_desc, [r, c_qk], bar, k_s.index(s))
        if not QK_RE:
            _tma_load(a_desc, [r, c_a], bar, a_s.index(s))
        _tma_load(t_desc, [r, c_a], bar, t_s.index(s))
        _tma_load(q_desc, [r, c_qk], bar, q_s.index(s))
        _tma_load(v_desc, [r, c_v], bar, v_s.index(s))
        if W_READ:
            _tma_load(w_desc, [r, c_k], bar, w_s.index(s))


@gluon.jit
def _aqk(
    q_tile,
    k_tile,
    gout,
    t0,
    L,
    HV,
    i_hv,
    scale,
    BT: gl.constexpr,
    GATE: gl.constexpr,
    mma_a: gl.constexpr,
    mma_o: gl.constexpr,
    KS: gl.constexpr = 32,
):
    """``scale · A_qk`` of the chunk (``[i, j]``: query row i, key row j; zero unless j ≤ i < L) from its q and k tiles
    in shared memory, as stage 1 stores it, as the right operand of ``dOᵀ A_qk`` (``mma_o``'s operand layout)."""
    K: gl.constexpr = q_tile.shape[1]
    b_a = gl.zeros([BT, BT], gl.float32, layout=mma_a)
    for d in gl.static_range(0, K, KS):  # (by key slices: fewer operand registers alive)
        b_q = q_tile.slice(d, KS, dim=1).load(gl.DotOperandLayout(operand_index=0, parent=mma_a, k_width=2))
        b_k = (
            k_tile.slice(d, KS, dim=1)
            .permute((1, 0))
            .load(gl.DotOperandLayout(operand_index=1, parent=mma_a, k_width=2))
        )
        b_a = mma_v2(b_q, b_k, b_a)
    o_i = gl.arange(0, BT, layout=gl.SliceLayout(1, mma_a))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, mma_a))
    m_a = (o_j[None, :] <= o_i[:, None]) & (o_i < L)[:, None]
    if GATE == 1:
        g_i = gl.load(gout + (t0 + o_i) * HV + i_hv, mask=o_i < L, other=0)
        g_j = gl.load(gout + (t0 + o_j) * HV + i_hv, mask=o_j < L, other=0)
        b_a = b_a * _exp(gl.where(m_a, g_i[:, None] - g_j[None, :], float("-inf"))) * scale
    else:
        b_a = gl.where(m_a, b_a * scale, 0.0)
    return gl.convert_layout(b_a.to(q_tile.dtype), gl.DotOperandLayout(operand_index=1, parent=mma_o, k_width=2))


@gluon.jit
def _compute(
    do_s,
    q_s,
    k_s,
    t_s,
    v_s,
    a_s,
    w_s,
    ready,
    empty,
    xs_desc,
    xs_stage,
    gout,
    beta,
    dht,
    dh0,
    dv,
    dvn,
    dbeta_part,
    bos,
    eos,
    NT,
    c0,
    i_nh,
    i_hv,
    i_v,
    v0,
    scale,
    SS,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    GATE: gl.constexpr,
    USE_DHT: gl.constexpr,
    STORE_DH0: gl.constexpr,
    NUM_BUF: gl.constexpr,
    QK_RE: gl.constexpr,
    W_READ: gl.constexpr,
    SEG: gl.constexpr,
    xend,
    first,
    num_warps: gl.constexpr,
):
    """The compute warps: per chunk, last first, the adjoint's store, dV_new, dVβ with dv and dβ's v part, and the
    adjoint's update (module docstring); the initial state's gradient at the end."""
    DT: gl.constexpr = k_s.dtype
    # wgmma accumulators: [BV, BT] (products with a token axis) and [BV, K] (the adjoint), one warp per 16 rows
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BT, 16]
    )
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, K, 16]
    )
    op_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t, k_width=2)
    op_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_k, k_width=2)
    col_t: gl.constexpr = gl.SliceLayout(0, mma_t)  # a vector over the chunk's tokens
    # QK_RE: A_qk [BT, BT] and dOᵀ A_qk [BV, BT] by mma.sync, in registers
    mma_a: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    # dv's and dVβ's stores: value channels fastest (16 bytes a thread)
    out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])

    # the adjoint Xᵀ [BV, K]: element (v, k) of the [K, V] adjoint in memory
    o_sv = gl.arange(0, BV, layout=gl.SliceLayout(1, mma_k))
    o_sk = gl.arange(0, K, layout=gl.SliceLayout(0, mma_k))
    off_s = o_sk[None, :] * V + (v0 + o_sv)[:, None]
    b_x = gl.zeros([BV, K], gl.float32, layout=mma_k)
    if SEG:  # phase 3 of the sequence-parallel pass: the segment's end adjoint from phase 2 (float32)
        b_x += gl.load(xend + i_nh.to(gl.int64) * K * V + off_s)
    elif USE_DHT:
        b_x += gl.load(dht + i_nh.to(gl.int64) * K * V + off_s).to(gl.float32)

    o_t = gl.arange(0, BT, layout=col_t)
    o_ov = gl.arange(0, BV, layout=gl.SliceLayout(1, out_l))
    o_ot = gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    for i in range(NT):
        s = i % NUM_BUF
        ph = (i // NUM_BUF) & 1
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        L = gl.minimum(eos - t0, BT).to(gl.int32)
        m_t = o_t < L
        row = t0 * HV + i_hv  # the chunk's first row of [tokens, HV]
        b_beta = gl.load(beta + row + o_t * HV, mask=m_t, other=0).to(gl.float32)
        # per-token factors: on dOᵀ in dOᵀ q (f_q), on Xᵀ kᵀ (f_k), on dVβᵀ in the last product (f_w, W_FROM_K)
        b_fq = gl.full([BT], scale, gl.float32, layout=col_t)
        b_fw = b_beta
        if GATE == 1:
            b_gam = gl.load(gout + row + o_t * HV, mask=m_t, other=0)
            b_gC = gl.load(gout + (t0 + L - 1) * HV + i_hv)
            b_eg = _exp(b_gam)
            b_fq = b_fq * b_eg
            b_fk = _exp(b_gC - b_gam)
            b_fw = b_fw * b_eg
        # X_{c+1}, the chunk's adjoint for the dq/dk stage: [K, BV] of [chunks·HV·K, V] by one TMA store
        tma.store_wait(0)  # (the last chunk's store has read its staging buffer)
        xs_stage.permute((1, 0)).store(b_x.to(DT))
        fence_async_shared()
        _tma_store(xs_desc, [((c0 + i_t) * HV + i_hv) * K, v0], xs_stage)
        b_xc = gl.convert_layout(b_x.to(DT), op_t)
        mbarrier.wait(ready.index(s), ph)
        kb, qb = k_s.index(s), q_s.index(s)
        # dOᵀ [BV, BT], its columns past the sequence zeroed, as the operands of dOᵀ A_qk and of (dOᵀ ⊙ scale e^γ) q
        b_do = gl.where(m_t[None, :], do_s.index(s).permute((1, 0)).load(mma_t).to(gl.float32), 0.0)
        b_doq = gl.convert_layout((b_do * b_fq[None, :]).to(DT), op_k)
        if QK_RE:
            b_doa = gl.convert_layout(b_do.to(DT), gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))
        else:
            b_doa = gl.convert_layout(b_do.to(DT), op_t)
        # dV_newᵀ = (Xᵀ kᵀ) e^{γ_C − γ} + dOᵀ A_qk, in one accumulator: the chain's product first, scaled, then
        # dOᵀ A_qk added into it (DeltaNet with A_qk read: both at once)
        if GATE == 1 or QK_RE:
            tok_p = warpgroup_mma(
                b_xc, kb.permute((1, 0)), gl.zeros([BV, BT], gl.float32, layout=mma_t), use_acc=False, is_async=True
            )
            if QK_RE:  # (A_qk formed from the tiles while the product runs)
                b_a = _aqk(qb, kb, gout, t0, L, HV, i_hv, scale, BT, GATE, mma_a, mma_o)
            b_dv, b_xc = warpgroup_mma_wait(0, deps=[tok_p, b_xc])
            if GATE == 1:
                b_dv = b_dv * b_fk[None, :]
            if QK_RE:
                b_dv = gl.convert_layout(mma_v2(b_doa, b_a, gl.convert_layout(b_dv, mma_o)), mma_t)
            else:
                tok_d = warpgroup_mma(b_doa, a_s.index(s), b_dv, is_async=True)
        else:
            tok_d = warpgroup_mma(
                b_doa, a_s.index(s), gl.zeros([BV, BT], gl.float32, layout=mma_t), use_acc=False, is_async=True
            )
            tok_d = warpgroup_mma(b_xc, kb.permute((1, 0)), tok_d, is_async=True)
        # the adjoint's update begins beside it: Xᵀ e^{γ_C} + (dOᵀ ⊙ scale e^γ) q
        if GATE == 1:
            b_x = b_x * _exp(b_gC)
        tok_x = warpgroup_mma(b_doq, qb, b_x, is_async=True)
        if not QK_RE:
            b_dv, b_doa, b_xc = warpgroup_mma_wait(1, deps=[tok_d, b_doa, b_xc])
        b_dvn = gl.where(m_t[None, :], b_dv, 0.0)
        # dVβᵀ = dV_newᵀ T; with W read, − dV_newᵀ W into the adjoint beside it
        b_dvnc = gl.convert_layout(b_dvn.to(DT), op_t)
        tok_b = warpgroup_mma(
            b_dvnc, t_s.index(s), gl.zeros([BV, BT], gl.float32, layout=mma_t), use_acc=False, is_async=True
        )
        if W_READ:
            b_dvw = gl.convert_layout((-b_dvn).to(DT), op_k)
            tok_x = warpgroup_mma(b_dvw, w_s.index(s), tok_x, is_async=True)
            b_dvb, b_dvnc = warpgroup_mma_wait(1, deps=[tok_b, b_dvnc])
        else:  # W_FROM_K: − (dVβᵀ ⊙ β e^γ) k, on the chain after dVβ (issued last: all of the chunk's done before)
            tok_x, b_dvb, b_doq, b_dvnc = warpgroup_mma_wait(0, deps=[tok_x, tok_b, b_doq, b_dvnc])
            b_dvw = gl.convert_layout((b_dvb * (-b_fw)[None, :]).to(DT), op_k)
            tok_x = warpgroup_mma(b_dvw, kb, tok_x, is_async=True)
        # off the chain, while the adjoint's products run: dv = β dVβ, dVβ itself, dβ's v part
        b_v = v_s.index(s).permute((1, 0)).load(mma_t).to(gl.float32)
        b_dbv = gl.sum(b_dvb * b_v, 0)
        gl.store(dbeta_part + i_v.to(gl.int64) * SS + row + o_t * HV, b_dbv, mask=m_t)
        # (the chunk's base by a 64-bit scalar, int32 offsets inside it: no [BT, BV] tile of 64-bit offsets alive)
        off_o = (o_ot * (HV * V))[None, :] + (v0 + o_ov)[:, None]
        m_o = (o_ot < L)[None, :]
        base = row.to(gl.int64) * V
        b_dvo = gl.convert_layout((b_dvb * b_beta[None, :]).to(dv.dtype.element_ty), out_l)
        gl.store(dv + base + off_o, b_dvo, mask=m_o)
        gl.store(dvn + base + off_o, gl.convert_layout(b_dvb.to(dvn.dtype.element_ty), out_l), mask=m_o)
        b_x, b_doq, b_dvw = warpgroup_mma_wait(0, deps=[tok_x, b_doq, b_dvw])
        fence_async_shared()  # (tiles were read through the generic proxy; the next TMA load writes them)
        mbarrier.arrive(empty.index(s), count=1)
    tma.store_wait(0)
    # the state's offsets again, from a zero the compiler cannot fold (NT >= 0): otherwise it reuses the tile computed
    # before the loop, 64 registers a thread kept alive through it (sm_90a, Triton 3.6, dh_BV 128: 520 -> 0 bytes of
    # spills)
    off_s = o_sk[None, :] * V + (v0 + gl.minimum(NT, 0) + o_sv)[:, None]
    if SEG:  # the sequence's first segment: its start adjoint is the initial state's gradient
        if STORE_DH0:
            i_out = gl.load(first + i_nh // HV)
            if i_out >= 0:
                gl.store(dh0 + (i_out.to(gl.int64) * HV + i_hv) * K * V + off_s, b_x)
    elif STORE_DH0:
        gl.store(dh0 + i_nh.to(gl.int64) * K * V + off_s, b_x)


@gluon.jit(do_not_specialize=["T", "SS"])
def chunk_bwd_state_ws_kernel(
    do_desc,
    q_desc,
    k_desc,
    t_desc,
    v_desc,
    a_desc,
    w_desc,
    xs_desc,
    gout,
    beta,
    dht,
    dh0,
    dv,
    dvn,
    dbeta_part,
    bounds,
    chunk_offsets,
    scale,
    T,
    SS,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    GATE: gl.constexpr,
    USE_DHT: gl.constexpr,
    STORE_DH0: gl.constexpr,
    VARLEN: gl.constexpr,
    NUM_BUF: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
    QK_RE: gl.constexpr = False,
    W_READ: gl.constexpr = False,
    SEG: gl.constexpr = False,
    xend=None,
    first=None,
):
    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = gl.load(bounds + i_n).to(gl.int64)
        eos = gl.load(bounds + i_n + 1).to(gl.int64)
        c0 = gl.load(chunk_offsets + i_n).to(gl.int32)
    else:
        bos = i_n.to(gl.int64) * T
        eos = bos + T
        c0 = i_n * gl.cdiv(T, BT)
    NT = gl.cdiv(eos - bos, BT).to(gl.int32)

    do_s = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF, BT, BV], do_desc.layout)
    q_s = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF, BT, K], k_desc.layout)
    t_s = gl.allocate_shared_memory(t_desc.dtype, [NUM_BUF, BT, BT], t_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF, BT, BV], v_desc.layout)
    if QK_RE:  # (A_qk formed in the pass: no buffer of it; a_desc is t_desc, never loaded)
        a_s = t_s
    else:
        a_s = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BT, BT], a_desc.layout)
    if W_READ:
        w_s = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BT, K], w_desc.layout)
    else:  # (W's product formed from k: no buffer of it; w_desc is k_desc, never loaded)
        w_s = k_s
    xs_stage = gl.allocate_shared_memory(xs_desc.dtype, [K, BV], xs_desc.layout)
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
                (do_s, q_s, k_s, t_s, v_s, a_s, w_s, ready, empty, xs_desc, xs_stage, gout, beta, dht, dh0, dv, dvn,
                 dbeta_part, bos, eos, NT, c0, i_nh, i_hv, i_v, v0, scale, SS, HV, K, V, BT, BV, GATE, USE_DHT,
                 STORE_DH0, NUM_BUF, QK_RE, W_READ, SEG, xend if SEG else 0, first if SEG else 0, num_warps),
            ),
            (
                _loader,
                (do_desc, q_desc, k_desc, t_desc, v_desc, a_desc, w_desc, do_s, q_s, k_s, t_s, v_s, a_s, w_s, ready,
                 empty, bos, NT, i_hv * V + v0, i_h * K, i_hv * BT, i_hv * K, BT, NUM_BUF, QK_RE, W_READ),
            ),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip
    for b in gl.static_range(NUM_BUF):
        mbarrier.invalidate(ready.index(b))
        mbarrier.invalidate(empty.index(b))


def smem_bytes(K: int, BT: int, BV: int, num_buf: int, qk_re: bool, w_read: bool, itemsize: int = 2) -> int:
    """Shared memory of one program: the ring's tiles, the adjoint's staging buffer, the barriers."""
    per_chunk = BT * BV * 2 + BT * K * 2 + BT * BT + (0 if qk_re else BT * BT) + (BT * K if w_read else 0)
    return (num_buf * per_chunk + K * BV) * itemsize + 16 * num_buf + 1024


def why_not(
    *,
    device: torch.device,
    gate: int,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, ...],
    K: int,
    V: int,
    BT: int,
    BV: int,
    config: dict[str, Any],
    segmented: bool,
    dv_work: bool,
    dqk_work: bool,
    w_rebuild: bool,
    qk_re: bool,
    w_read: bool,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why the Gluon reverse pass cannot serve this call (then the Triton pass runs its config), or None where it can.
    ``inputs``: the tensors it reads by TMA (16-byte aligned, the intermediates' dtype); ``capability``: the GPU's
    compute capability (default: the device's; none on the CPU)."""
    why = gluon_refusal(device, capability, gate, dtype, inputs)
    if why is not None:
        return why
    if not dv_work or dqk_work or w_rebuild:
        return 'needs REVERSE_DV, without REVERSE_DQK or fh_W = "rebuilt"'
    if config.get("fh_U", "stored") != "recomputed":
        return 'needs fh_U = "recomputed" (stage 1 then stores T with zeros above its diagonal)'
    if segmented and config.get("dh_SEG_START", "transitions") == "burnin":
        return 'segments started by burn-in (dh_SEG_START = "burnin")'
    if K not in (64, 128) or BT not in (32, 64):
        return "K not 64 or 128, or BT not 32 or 64"
    if V % BV or BV not in (64, 128):
        return "dh_BV not 64 or 128, or not dividing V"
    num_buf = int(config.get("dh_num_stages", 2))
    if num_buf < 1:
        return "dh_num_stages < 1"
    if smem_bytes(K, BT, BV, num_buf, qk_re, w_read) > SMEM_LIMIT:
        return f"{num_buf} buffers of these tiles exceed a program's shared memory"
    return None


def launch_reverse_ws(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor | None,
    aqk: torch.Tensor | None,
    gout: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    dh0: torch.Tensor | None,
    dh: torch.Tensor,
    dvn: torch.Tensor,
    dv_work: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cu_seqlens: torch.Tensor | None,
    chunk_offsets: torch.Tensor | None,
    scale: float,
    N: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    BT: int,
    BV: int,
    GATE: int,
    config: dict[str, Any],
    qk_re: bool,
    w_read: bool,
    seg: dict[str, Any] | None = None,
) -> Any:
    """The warp-specialised reverse pass (``why_not(...)`` must be None): one program per value tile of ``BV``
    columns, sequence and value head; ``dh_num_stages`` buffers in the loader's ring, the compute warps under the cap
    ``dh_maxnreg``. Fills ``dh`` (``X_{c+1}`` per chunk), ``dvn`` (dVβ), ``dv``, the value tiles' slots of
    ``dbeta_part`` and ``dh0`` as :func:`.bwd_state.launch_reverse` does with ``REVERSE_DV``."""
    ai, v, beta, dv, dbeta_part = dv_work
    rows = do.shape[0] * do.shape[1]
    t_desc = tma_descriptor(ai, rows, HV * BT, [BT, BT])
    k_desc = tma_descriptor(k, rows, H * K, [BT, K])
    grid = (V // BV, N * HV)
    return chunk_bwd_state_ws_kernel[grid](
        tma_descriptor(do, rows, HV * V, [BT, BV]),
        tma_descriptor(q, rows, H * K, [BT, K]),
        k_desc,
        t_desc,
        tma_descriptor(v, rows, HV * V, [BT, BV]),
        t_desc if qk_re or aqk is None else tma_descriptor(aqk, rows, HV * BT, [BT, BT]),
        tma_descriptor(w, rows, HV * K, [BT, K]) if w_read and w is not None else k_desc,
        tma_descriptor(dh, dh.numel() // V, V, [K, BV]),
        gout if gout is not None else beta,
        beta,
        dht,
        dh0,
        dv,
        dvn,
        dbeta_part,
        cu_seqlens,
        chunk_offsets,
        scale,
        T,
        dbeta_part.shape[1] * HV,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=BT,
        BV=BV,
        GATE=GATE,
        USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None,
        VARLEN=cu_seqlens is not None,
        NUM_BUF=max(1, int(config.get("dh_num_stages", 2))),
        LOADER_REGS=int(config.get("ws_loader_regs", 40)),
        num_warps=BV // 16,
        QK_RE=qk_re,
        W_READ=w_read,
        **(seg or {}),
        **({"maxnreg": int(config["dh_maxnreg"])} if int(config.get("dh_maxnreg", 0)) else {}),
    )
