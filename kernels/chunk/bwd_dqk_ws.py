"""The backward's chunk-parallel dq/dk stage, persistent and warp-specialised for Hopper (``dqk_LOOP = "gluon"``):
Gluon, not Triton's language, so that the next chunk's tiles load while this one's chunk-local formulas run.

Same algebra as :mod:`.bwd_dqk` fused with ``REVERSE_DV`` (``dVβ`` from the reverse pass; DeltaNet and Gated DeltaNet,
one key tile of all ``K`` channels, chunks of 64), with the decay applied to both dA in float32 before their rounding
(``dqk_DECAY = "value"``'s form). Per chunk and value head, over value tiles of ``BV`` channels (every product a wgmma
with both operands in shared memory):

* ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``, ``dKβ = −dVβ S_cᵀ`` (``[BT, K]``), ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``;
* ``dA_qk = dO V_newᵀ``, ``dA_kk = −dVβ V_newᵀ`` (``[BT, BT]``);

then the chunk-local formulas of :mod:`.bwd_local` (local terms, the pairwise ones as wgmmas of the masked, decayed dA
in shared memory with the q and k tiles, the gate's terms) and the stores: ``dq``, ``dk`` (per value head), dβ's k
part (its slot of ``dbeta_part``), Gated DeltaNet's ``dγ`` (for :mod:`.bwd_finish`, which sums dβ's slots and takes
the gate's reverse cumulative sum, as after the Triton stage).

Persistent: one program per SM walks the (chunk, value head) items; a one-warp loader brings each item's q and k tiles
(two buffers) and its value tiles (``dO``, ``V_new``, ``dVβ`` ``[BT, BV]``, ``S_c`` and ``X_{c+1}`` ``[K, BV]``: a ring
of ``NUM_BUF``) by TMA, running ahead into the next item while the compute warps (8: two warpgroups splitting the key
channels) finish this one. A chunk's rows past its sequence hold the next sequence's tokens (TMA reads whole tiles):
they are masked out of every dA, row sum and store.

Runs only on sm_90 with 16-bit inputs; :func:`why_not` says where not, and the caller runs the Triton stage there (the
interpreter included: Gluon has none).
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
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .state_ws import _exp, _tma_load, gluon_refusal, tma_descriptor

# a barrier of the partition's warps: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7 on
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
SMEM_LIMIT = 227 * 1024  # shared memory one program may take on sm_90 (bytes)
BT_GLUON = 64  # a wgmma's 64 rows per warpgroup: the chunk
COMPUTE_WARPS = 8  # two warpgroups, each with half the key channels of the [BT, K] accumulators


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _bounds(chunk_info, i_c, T, BT: gl.constexpr, VARLEN: gl.constexpr):
    """(first token, sequence end) of chunk ``i_c`` (int64), as :func:`.common.chunk_bounds`."""
    if VARLEN:
        bos = gl.load(chunk_info + 2 * i_c).to(gl.int64)
        eos = gl.load(chunk_info + 2 * i_c + 1).to(gl.int64)
    else:
        NTC = gl.cdiv(T, BT)
        i_b = i_c // NTC
        bos = i_b.to(gl.int64) * T + (i_c % NTC) * BT
        eos = i_b.to(gl.int64) * T + T
    return bos, eos


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    do_desc,
    vn_desc,
    dvb_desc,
    h_desc,
    x_desc,
    q_s,
    k_s,
    do_s,
    vn_s,
    dvb_s,
    h_s,
    x_s,
    qk_ready,
    qk_empty,
    v_ready,
    v_empty,
    chunk_info,
    T,
    n_items,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    NUM_BUF: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """One warp: each item's q and k tiles into buffer ``j % 2`` and its value tiles into the ring, as the compute warps
    release them."""
    NV: gl.constexpr = V // BV
    qk_bytes: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes
    v_bytes: gl.constexpr = (
        do_desc.block_type.nbytes
        + vn_desc.block_type.nbytes
        + dvb_desc.block_type.nbytes
        + h_desc.block_type.nbytes
        + x_desc.block_type.nbytes
    )
    it = 0
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    for j in range(gl.cdiv(n_items - pid, nprog)):  # this program's items: pid, pid + nprog, ...
        item = pid + j * nprog
        i_c, i_hv = item // HV, item % HV
        i_h = i_hv // (HV // H)
        bos, eos = _bounds(chunk_info, i_c, T, BT, VARLEN)
        r = bos.to(gl.int32)
        sq = j % 2
        mbarrier.wait(qk_empty.index(sq), ((j // 2) & 1) ^ 1)
        mbarrier.expect(qk_ready.index(sq), qk_bytes)
        _tma_load(q_desc, [r, i_h * K], qk_ready.index(sq), q_s.index(sq))
        _tma_load(k_desc, [r, i_h * K], qk_ready.index(sq), k_s.index(sq))
        rh = ((i_c * HV + i_hv) * K).to(gl.int32)  # the chunk's state rows in [chunks·HV·K, V]
        for i_v in gl.static_range(NV):
            s = it % NUM_BUF
            mbarrier.wait(v_empty.index(s), ((it // NUM_BUF) & 1) ^ 1)
            bar = v_ready.index(s)
            mbarrier.expect(bar, v_bytes)
            c = i_hv * V + i_v * BV
            _tma_load(do_desc, [r, c], bar, do_s.index(s))
            _tma_load(vn_desc, [r, c], bar, vn_s.index(s))
            _tma_load(dvb_desc, [r, c], bar, dvb_s.index(s))
            _tma_load(h_desc, [rh, i_v * BV], bar, h_s.index(s))
            _tma_load(x_desc, [rh, i_v * BV], bar, x_s.index(s))
            it += 1


@gluon.jit
def _compute(
    q_s,
    k_s,
    do_s,
    vn_s,
    dvb_s,
    h_s,
    x_s,
    aq_s,
    ak_s,
    akb_s,
    qk_ready,
    qk_empty,
    v_ready,
    v_empty,
    g,
    beta,
    dq,
    dk,
    dg,
    dbeta_part,
    chunk_info,
    scale,
    T,
    SLOT,
    SS,
    n_items,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    NUM_BUF: gl.constexpr,
    GATE: gl.constexpr,
    VARLEN: gl.constexpr,
    FLOOR: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The compute warps: per item, the contractions over V, then the chunk-local formulas and the stores."""
    NV: gl.constexpr = V // BV
    DT: gl.constexpr = k_s.dtype
    # [BT, K] accumulators and [BT, BT] ones: two warpgroups, each with half the columns
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, K // (num_warps // 4), 16]
    )
    mma_a: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, BT // (num_warps // 4), 16]
    )
    row_k: gl.constexpr = gl.SliceLayout(1, mma_k)  # a vector over the chunk's rows, beside [BT, K] tiles
    row_a: gl.constexpr = gl.SliceLayout(1, mma_a)  # ... beside [BT, BT] tiles (their row index i)
    col_a: gl.constexpr = gl.SliceLayout(0, mma_a)  # ... their column index j
    # S_c ⊙ X_{c+1} summed over the value tile: [K, BV] tiles, value channels fastest
    hx_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    # dq's and dk's stores: key channels fastest (16 bytes a thread)
    st_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    scan_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])  # (a scan wants a blocked layout)

    o_t = gl.arange(0, BT, layout=row_k)
    o_i = gl.arange(0, BT, layout=row_a)
    o_j = gl.arange(0, BT, layout=col_a)
    o_st = gl.arange(0, BT, layout=gl.SliceLayout(1, st_l))
    o_sk = gl.arange(0, K, layout=gl.SliceLayout(0, st_l))
    it = 0
    pid, nprog = gl.program_id(0), gl.num_programs(0)
    for j in range(gl.cdiv(n_items - pid, nprog)):  # this program's items: pid, pid + nprog, ...
        item = pid + j * nprog
        i_c, i_hv = item // HV, item % HV
        bos, eos = _bounds(chunk_info, i_c, T, BT, VARLEN)
        L = gl.minimum(eos - bos, BT).to(gl.int32)
        row = bos * HV + i_hv  # the chunk's first row of [tokens, HV]
        m_t = o_t < L
        # the gate's row and β: loaded before the contractions (off the epilogue's path)
        b_beta = gl.load(beta + row + o_t * HV, mask=m_t, other=0).to(gl.float32)
        if GATE == 1:
            b_graw = gl.load(g + row + o_t * HV, mask=m_t, other=0).to(gl.float32)
        # ---- the contractions over V ------------------------------------------------------------------------------
        acc_dq = gl.zeros([BT, K], gl.float32, layout=mma_k)
        acc_dk = gl.zeros([BT, K], gl.float32, layout=mma_k)
        acc_kb = gl.zeros([BT, K], gl.float32, layout=mma_k)
        acc_aq = gl.zeros([BT, BT], gl.float32, layout=mma_a)
        acc_ak = gl.zeros([BT, BT], gl.float32, layout=mma_a)
        b_dec = gl.zeros([K], gl.float32, layout=gl.SliceLayout(1, hx_l))
        for _i_v in gl.static_range(NV):
            s = it % NUM_BUF
            mbarrier.wait(v_ready.index(s), (it // NUM_BUF) & 1)
            hb, xb = h_s.index(s), x_s.index(s)
            dob, vnb, dvbb = do_s.index(s), vn_s.index(s), dvb_s.index(s)
            acc_dq = warpgroup_mma(dob, hb.permute((1, 0)), acc_dq, is_async=True)
            acc_dk = warpgroup_mma(vnb, xb.permute((1, 0)), acc_dk, is_async=True)
            acc_kb = warpgroup_mma(dvbb, hb.permute((1, 0)), acc_kb, is_async=True)
            acc_aq = warpgroup_mma(dob, vnb.permute((1, 0)), acc_aq, is_async=True)
            acc_ak = warpgroup_mma(dvbb, vnb.permute((1, 0)), acc_ak, is_async=True)
            if GATE == 1:
                b_dec += gl.sum(hb.load(hx_l).to(gl.float32) * xb.load(hx_l).to(gl.float32), 1)
            acc_dq, acc_dk, acc_kb, acc_aq, acc_ak = warpgroup_mma_wait(
                0, deps=[acc_dq, acc_dk, acc_kb, acc_aq, acc_ak]
            )
            if GATE == 1:
                fence_async_shared()  # (S_c and X were read through the generic proxy; the next TMA load writes them)
            mbarrier.arrive(v_empty.index(s), count=1)
            it += 1
        sq = j % 2
        mbarrier.wait(qk_ready.index(sq), (j // 2) & 1)
        qb, kb = q_s.index(sq), k_s.index(sq)
        # k kᵀ: dβ's pairwise term Σ_d k_i ⊙ (dA_kk k)_i = Σ_j (dA_kk ⊙ k kᵀ)_ij without a [BT, K] product alive
        tok_g = warpgroup_mma(kb, kb.permute((1, 0)), gl.zeros([BT, BT], gl.float32, layout=mma_a), use_acc=False,
                              is_async=True)  # fmt: skip
        # ---- the gate's factors (both ≤ 1) ------------------------------------------------------------------------
        if GATE == 1:
            b_gl = gl.where(b_graw < FLOOR, FLOOR, b_graw)  # the clamp of -inf (NaN stays NaN)
            b_gam = gl.convert_layout(gl.associative_scan(gl.convert_layout(b_gl, scan_l), 0, _add), row_k)
            b_gC = gl.sum(gl.where(m_t, b_gl, 0.0), 0)
            b_e = _exp(b_gam)
            b_ekc = _exp(b_gC - b_gam)
        # ---- both dA, masked and decayed in float32, into shared memory as the pairwise products' operands ----------
        m_low = (o_j[None, :] <= o_i[:, None]) & (o_i < L)[:, None]
        m_str = (o_j[None, :] < o_i[:, None]) & (o_i < L)[:, None]
        b_ba = gl.convert_layout(b_beta, row_a)
        if GATE == 1:
            g_i = gl.convert_layout(b_gam, row_a)
            g_j = gl.convert_layout(b_gam, col_a)
            b_D = _exp(gl.where(m_low, g_i[:, None] - g_j[None, :], float("-inf")))
            b_aq = gl.where(m_low, acc_aq * b_D * scale, 0.0).to(DT)
            b_ak = gl.where(m_str, -acc_ak * b_D, 0.0).to(DT)
        else:
            b_aq = gl.where(m_low, acc_aq * scale, 0.0).to(DT)
            b_ak = gl.where(m_str, -acc_ak, 0.0).to(DT)
        _barrier()  # (the last item's pairwise products have read these tiles in every warpgroup)
        aq_s.store(b_aq)
        ak_s.store(b_ak)
        akb_s.store((b_ak.to(gl.float32) * b_ba[:, None]).to(DT))
        fence_async_shared()
        # dβ's pairwise term Σ_j (dA_kk ⊙ D ⊙ k kᵀ)_ij now: k kᵀ and dA_kk die before the local terms' products
        b_kk = warpgroup_mma_wait(0, deps=[tok_g])
        b_dbp = gl.convert_layout(gl.sum(b_ak.to(gl.float32) * b_kk, 1), row_k)
        # ---- the local terms, each the accumulator of its pairwise products ------------------------------------------
        b_k = gl.where(m_t[:, None], kb.load(mma_k).to(gl.float32), 0.0)
        if GATE == 1:  # dq = scale e^γ dq̃ + (dA_qk ⊙ D) k
            b_dq = acc_dq * (scale * b_e)[:, None]
        else:
            b_dq = acc_dq * scale
        b_dq = warpgroup_mma(aq_s, kb, b_dq, is_async=True)
        if GATE == 1:  # dk_col = e^{γ_C − γ} dk̃ + (dA_qk ⊙ D)ᵀ q + (β dA_kk ⊙ D)ᵀ k; the gate's last-row term first
            b_dkcol = acc_dk * b_ekc[:, None]
            b_dgc = gl.sum(gl.sum(b_k * b_dkcol, 1), 0) + _exp(b_gC) * gl.sum(b_dec, 0)
        else:
            b_dkcol = acc_dk
        b_dkcol = warpgroup_mma(aq_s.permute((1, 0)), qb, b_dkcol, is_async=True)
        b_dkcol = warpgroup_mma(akb_s.permute((1, 0)), kb, b_dkcol, is_async=True)
        # dk_row = β e^γ dKβ + β (dA_kk ⊙ D) k; dβ = Σ_d dKβ k e^γ + Σ_j (dA_kk ⊙ D ⊙ k kᵀ)_ij
        if GATE == 1:
            b_db = -gl.sum(acc_kb * b_k, 1) * b_e
            b_dkrow = acc_kb * (-(b_beta * b_e))[:, None]
        else:
            b_db = -gl.sum(acc_kb * b_k, 1)
            b_dkrow = acc_kb * (-b_beta)[:, None]
        b_dkrow = warpgroup_mma(akb_s, kb, b_dkrow, is_async=True)
        b_db += b_dbp
        b_dq, b_dkcol, b_dkrow = warpgroup_mma_wait(0, deps=[b_dq, b_dkcol, b_dkrow])
        b_dk = b_dkrow + b_dkcol
        if GATE == 1:  # dγ of the chunk's rows (the finish stage takes the reverse cumulative sum)
            b_q = qb.load(mma_k).to(gl.float32)
            b_dgam = gl.sum(b_q * b_dq + b_k * (b_dkrow - b_dkcol), 1) + gl.where(o_t == L - 1, b_dgc, 0.0)
            gl.store(dg + row + o_t * HV, b_dgam, mask=m_t)
        fence_async_shared()  # (the q and k tiles were read through the generic proxy; the next TMA load writes them)
        mbarrier.arrive(qk_empty.index(sq), count=1)
        gl.store(dbeta_part + SLOT.to(gl.int64) * SS + row + o_t * HV, b_db, mask=m_t)
        # (the chunk's base by a 64-bit scalar, int32 offsets inside it)
        off = (o_st * (HV * K))[:, None] + o_sk[None, :]
        m_st = (o_st < L)[:, None]
        base = row.to(gl.int64) * K
        gl.store(dq + base + off, gl.convert_layout(b_dq.to(dq.dtype.element_ty), st_l), mask=m_st)
        gl.store(dk + base + off, gl.convert_layout(b_dk.to(dk.dtype.element_ty), st_l), mask=m_st)


@gluon.jit(do_not_specialize=["T", "SLOT", "SS", "n_items"])
def chunk_bwd_dqk_ws_kernel(
    q_desc,
    k_desc,
    do_desc,
    vn_desc,
    dvb_desc,
    h_desc,
    x_desc,
    g,
    beta,
    dq,
    dk,
    dg,
    dbeta_part,
    chunk_info,
    scale,
    T,
    SLOT,
    SS,
    n_items,
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    BT: gl.constexpr,
    BV: gl.constexpr,
    NUM_BUF: gl.constexpr,
    GATE: gl.constexpr,
    VARLEN: gl.constexpr,
    FLOOR: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    q_s = gl.allocate_shared_memory(q_desc.dtype, [2, BT, K], q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [2, BT, K], k_desc.layout)
    do_s = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF, BT, BV], do_desc.layout)
    vn_s = gl.allocate_shared_memory(vn_desc.dtype, [NUM_BUF, BT, BV], vn_desc.layout)
    dvb_s = gl.allocate_shared_memory(dvb_desc.dtype, [NUM_BUF, BT, BV], dvb_desc.layout)
    h_s = gl.allocate_shared_memory(h_desc.dtype, [NUM_BUF, K, BV], h_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUF, K, BV], x_desc.layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], q_desc.dtype)
    aq_s = gl.allocate_shared_memory(q_desc.dtype, [BT, BT], a_layout)
    ak_s = gl.allocate_shared_memory(q_desc.dtype, [BT, BT], a_layout)
    akb_s = gl.allocate_shared_memory(q_desc.dtype, [BT, BT], a_layout)
    qk_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qk_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(qk_ready.index(b), count=1)
        mbarrier.init(qk_empty.index(b), count=1)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(v_ready.index(b), count=1)
        mbarrier.init(v_empty.index(b), count=1)
    gl.warp_specialize(
        [
            (
                _compute,
                (q_s, k_s, do_s, vn_s, dvb_s, h_s, x_s, aq_s, ak_s, akb_s, qk_ready, qk_empty, v_ready, v_empty, g,
                 beta, dq, dk, dg, dbeta_part, chunk_info, scale, T, SLOT, SS, n_items, H, HV, K, V, BT, BV, NUM_BUF,
                 GATE, VARLEN, FLOOR, num_warps),
            ),
            (
                _loader,
                (q_desc, k_desc, do_desc, vn_desc, dvb_desc, h_desc, x_desc, q_s, k_s, do_s, vn_s, dvb_s, h_s, x_s,
                 qk_ready, qk_empty, v_ready, v_empty, chunk_info, T, n_items, H, HV, K, V, BT, BV, NUM_BUF, VARLEN),
            ),
        ],
        [1],
        [LOADER_REGS],
    )  # fmt: skip
    for b in gl.static_range(2):
        mbarrier.invalidate(qk_ready.index(b))
        mbarrier.invalidate(qk_empty.index(b))
    for b in gl.static_range(NUM_BUF):
        mbarrier.invalidate(v_ready.index(b))
        mbarrier.invalidate(v_empty.index(b))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def smem_bytes(K: int, BV: int, num_buf: int, BT: int = BT_GLUON, itemsize: int = 2) -> int:
    """Shared memory of one program: q and k (two buffers), the value tiles' ring, the three dA tiles, the barriers."""
    ring = num_buf * (3 * BT * BV + 2 * K * BV)
    return (4 * BT * K + ring + 3 * BT * BT) * itemsize + 16 * (4 + 2 * num_buf) + 1024


def why_not(
    *,
    device: torch.device,
    gate: int,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, ...],
    K: int,
    V: int,
    BT: int,
    BK: int,
    BV: int,
    config: dict[str, Any],
    fused: bool,
    dvb_given: bool,
    kloop: bool,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why the Gluon dq/dk stage cannot serve this call (then the Triton stage runs its config), or None where it can.
    ``inputs``: the tensors it reads by TMA (16-byte aligned, the intermediates' dtype); ``capability``: the GPU's
    compute capability (default: the device's; none on the CPU)."""
    why = gluon_refusal(device, capability, gate, dtype, inputs)
    if why is not None:
        return why
    if not (fused and dvb_given) or kloop:
        return "needs FUSE_DV and REVERSE_DV, without dqk_KLOOP"
    if BT != BT_GLUON:
        return f"BT not {BT_GLUON}"
    if K not in (64, 128) or BK != K:
        return "K not 64 or 128, or dqk_BK not K"
    if V % BV or BV not in (64, 128):
        return "dqk_BV not 64 or 128, or not dividing V"
    num_buf = int(config.get("dqk_num_stages", 2))
    if num_buf < 1:
        return "dqk_num_stages < 1"
    if smem_bytes(K, BV, num_buf) > SMEM_LIMIT:
        return f"{num_buf} buffers of these tiles exceed a program's shared memory"
    return None


def launch_dqk_ws(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    hbuf: torch.Tensor,
    dh: torch.Tensor,
    do: torch.Tensor,
    vnew: torch.Tensor,
    dvb: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dg: torch.Tensor | None,
    dbeta_part: torch.Tensor,
    chunk_info: torch.Tensor | None,
    scale: float,
    T: int,
    NC: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    BV: int,
    GATE: int,
    slot: int,
    ss: int,
    varlen: bool,
    floor: float,
    config: dict[str, Any],
) -> Any:
    """The persistent dq/dk stage (``why_not(...)`` must be None): one program per SM (at most one per item) over the
    ``NC · HV`` (chunk, value head) items; ``dqk_num_stages`` value-tile buffers in the loader's ring."""
    BT = BT_GLUON
    rows = do.shape[0] * do.shape[1]
    n_items = NC * HV
    grid = (max(1, min(n_items, _sm_count(q.device.index if q.device.index is not None else 0))),)
    return chunk_bwd_dqk_ws_kernel[grid](
        tma_descriptor(q, rows, H * K, [BT, K]),
        tma_descriptor(k, rows, H * K, [BT, K]),
        tma_descriptor(do, rows, HV * V, [BT, BV]),
        tma_descriptor(vnew, rows, HV * V, [BT, BV]),
        tma_descriptor(dvb, rows, HV * V, [BT, BV]),
        tma_descriptor(hbuf, hbuf.numel() // V, V, [K, BV]),
        tma_descriptor(dh, dh.numel() // V, V, [K, BV]),
        g if g is not None else beta,
        beta,
        dq,
        dk,
        dg if dg is not None else dbeta_part,
        dbeta_part,
        chunk_info,
        scale,
        T,
        slot,
        ss,
        n_items,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=BT,
        BV=BV,
        NUM_BUF=max(1, int(config.get("dqk_num_stages", 2))),
        GATE=GATE,
        VARLEN=varlen,
        FLOOR=floor,
        LOADER_REGS=int(config.get("ws_loader_regs", 40)),
        num_warps=COMPUTE_WARPS,
    )
