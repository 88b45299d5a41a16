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

Two layouts of the adjoint tile (``dh_LAYOUT``, the constexpr ``TRANS``), as the forward's ``STATE_LAYOUT``:

* ``"kv"``: ``X`` ``[BK, BV]``, the products as written above;
* ``"vk"``: ``Xᵀ`` ``[BV, BK]`` and the transposed products ``dV_newᵀ = dOᵀ A_qk + Xᵀ k̃ᵀ``,
  ``X_cᵀ = X_{c+1}ᵀ diag(e^{γ_C}) + dOᵀ q̃ − dV_newᵀ W``: the adjoint and ``dV_newᵀ`` are the left operand of the
  chain's dots (on Hopper, wgmma takes it from registers: no shared-memory round trip per chunk). Same loads (``dO``
  read transposed), same arithmetic, the same ``[K, V]`` buffers.

Sequence-parallel mode (``dh_SEG_CHUNKS > 0``, constexpr ``SEG``; :mod:`.bwd_segments`). The adjoint's update is
affine too: ``X_c = P_c X_{c+1} + R_c`` with ``P_c = diag(e^{γ_C}) − Wᵀ k̃`` (``K × K``, the transpose of the forward's
chunk transition ``diag(e^{γ_C}) − k̃ᵀ W``) and ``R_c = q̃ᵀ dO − Wᵀ A_qkᵀ dO``. So a segment of chunks maps the
adjoint at its end to the one at its start: ``X_start = P_seg X_end + R_seg``, ``P_seg = P_first ⋯ P_last``.

* ``SEG = 1`` (phase 1): programs run over segments (``bounds``/``chunk_offsets`` the segment table's) and over the
  ``⌈V/BV⌉ + ⌈K/BV⌉`` column tiles of the extended adjoint ``[K, V + K]``: the first are the ordinary pass from zero
  (giving ``R_seg``), the others start from the identity with ``dO = 0`` (only the decay and ``− Wᵀ k̃ X`` act,
  giving ``P_seg``). Nothing else is stored; the result goes to ``ext`` (float32 ``[NS, HV, K, V + K]``). The first
  segment of each sequence is skipped (its start adjoint is the initial state's gradient, never an input).
* ``SEG = 2`` (phase 3): the ordinary pass per segment from its true end adjoint ``xend[s]`` (phase 2); the first
  segment of each sequence (``first[s] >= 0``) stores the initial state's gradient.

``TMA`` (``dh_TMA``; :func:`descriptors`): the chunk's tiles (dO, q and k or KDA's q̃ and k̃, W and A_qk where read,
T and v with ``DV``) through TMA descriptors, in the plain pass and phase 3 (phase 1 loads by pointers); rows past
the sequence's end are the next sequence's tokens, zeroed after the load. ``W_FROM_K`` (``fh_W``, needs ``DV``):
``Wᵀ dV_new = (β e^γ ⊙ K)ᵀ dVβ`` from the ``dVβ`` formed on the chain, W never read (phase 1 forms ``dVβ`` too);
``W_REBUILD`` (``fh_W = "rebuilt"``, needs ``DV``): ``W = T (β e^γ ⊙ K)`` formed per chunk, off the chain;
``QK_RE`` (``fh_AQK``): ``scale · A_qk`` formed from q and k per chunk, off the chain. ``X_ACC`` (``dh_ACC``): the
chain's last product ``− Wᵀ dV_new`` (or ``− (β e^γ ⊙ K)ᵀ dVβ``) accumulated into ``X`` by the dot itself, an operand
negated (exact), instead of a product tile subtracted afterwards: one ``[BK, BV]`` float32 tile fewer alive, and the
register allocation differs (sm_90a, Triton 3.6, K = V = 128, the shipped B = 8 configs: spills 156 -> 140 bytes for
Gated DeltaNet, 136 -> 204 for DeltaNet; at B = 1 92 -> 4 for Gated DeltaNet).

With ``DV`` (``REVERSE_DV``) the pass also does the V-separable part of the chunk-local work, off the chain:
``dVβ = Tᵀ dV_new`` (stored instead of ``dV_new``: it is all the dq/dk stage needs of it), ``dv = β dVβ`` and dβ's
``v`` part ``Σ_v dVβ ⊙ v`` (one slot of ``dbeta_part`` per value tile), so the chunk-parallel stage reads neither
``T`` nor ``v`` and writes no ``dv``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import GATE_FLOOR, Config, next_power_of_2
from .bwd_reverse_dqk import chunk_bwd_reverse_dqk_tiled_kernel, reverse_chunk_grads
from .bwd_segments import chunk_bwd_segment_ends_kernel, reverse_segments
from .call import tile
from .common import burnin_end, scalar_causal_aqk, scalar_chunk_operands, transition_negligible
from .state import _tile

Tensor = torch.Tensor
ENDS_MAX_BV = 32  # phase 2's value tile: [K, K] of P_s and [K, BV] of X per step
# ... at 8 warps, two stages (sm_90a, Triton 3.6, K = 128: 128 registers, 96 KB of shared memory; 4 warps spill)
ENDS_LAUNCH = {"num_warps": 8, "num_stages": 2}


@triton.jit
def _load(base, off, mask, td, row, col, rows, TMA: tl.constexpr, TRANS: tl.constexpr):
    """The forward's :func:`.state._tile` (pointers under ``mask``, or the descriptor ``td``'s block at ``row``,
    ``col``) with, by TMA, the rows past the sequence (the next sequence's tokens) zeroed by ``rows`` (``[BT]``)."""
    x = _tile(base, off, mask, td, row, col, TMA, TRANS)
    if TMA:
        x = tl.where(rows[None, :] if TRANS else rows[:, None], x, 0)
    return x


@triton.jit(do_not_specialize=["T", "SS"])
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
    TRANS: tl.constexpr = False,
    SEG: tl.constexpr = 0,
    first=None,
    xend=None,
    ext=None,
    DV: tl.constexpr = False,
    ai=None,
    v=None,
    beta=None,
    dv=None,
    dbeta_part=None,
    SS=0,
    W_FROM_K: tl.constexpr = False,
    QK_RE: tl.constexpr = False,
    TMA: tl.constexpr = False,
    W_REBUILD: tl.constexpr = False,
    do_td=None,
    q_td=None,
    k_td=None,
    w_td=None,
    a_td=None,
    t_td=None,
    v_td=None,
    X_ACC: tl.constexpr = False,
    DQK: tl.constexpr = False,
    hbuf=None,
    vnew=None,
    graw=None,
    dq=None,
    dk=None,
    dg=None,
    dbeta=None,
    FLOOR: tl.constexpr = 0.0,
    h_td=None,
    vn_td=None,
    xs_td=None,
    SEG_DECAY: tl.constexpr = False,
    BURNIN: tl.constexpr = False,
    seg_seq=None,
    seq_end=None,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if SEG == 1:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if tl.load(first + i_n) >= 0:
            return
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    NTn = tl.cdiv(eos - bos, BT).to(tl.int32)
    DT = w.dtype.element_ty  # (without W stored the launcher passes T's buffer: the intermediates' dtype)
    tl.static_assert(not (W_FROM_K or W_REBUILD or QK_RE) or GATE != 2, "W, A_qk from k, q: DeltaNet, Gated DeltaNet")
    tl.static_assert(not DQK or (DV and GATE != 2 and BV >= V and BK >= K), "REVERSE_DQK: REVERSE_DV, whole state")
    W_READ: tl.constexpr = not (W_FROM_K or W_REBUILD)
    USE_TMA: tl.constexpr = TMA and SEG != 1  # (phase 1's P columns have no dO to load)
    c_v = (i_hv * V + i_v * BV).to(tl.int32)  # descriptor columns: this value tile, ...
    c_k = (i_hv * K).to(tl.int32)  # ... the value head's K columns (W, KDA's q~ and k~), ...
    c_qk = (i_h * K).to(tl.int32)  # ... the key head's (q, k) and the value head's BT (A_qk, T)
    c_a = (i_hv * BT).to(tl.int32)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if SEG == 1:
        # column tile i_v of the extended adjoint [K, V + K]: V tiles of R, then K tiles of P (an identity start)
        NVV = tl.cdiv(V, BV)
        is_p = i_v >= NVV
        o_v = tl.where(is_p, i_v - NVV, i_v) * BV + tl.arange(0, BV)
        m_v = o_v < tl.where(is_p, K, V)
        m_o = o_v < tl.where(is_p, 0, V)  # dO = 0 in the P columns
        o_e = o_v + tl.where(is_p, V, 0)  # column of the extended adjoint
    else:
        o_v = tl.arange(0, BV) + i_v * BV
        m_v = o_v < V
        m_o = m_v
    off_wk = o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] rows of [tokens, HV, K]
    off_a = o_t[:, None] * (HV * BT) + o_t[None, :]  # [BT, BT] rows of [tokens, HV, BT] (A_qk, T)
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]  # [BT, BK] rows of [tokens, H, K]
    if TRANS:
        m_h = m_v[:, None] & m_k[None, :]
        off_h = o_k[None, :] * V + o_v[:, None]  # [BV, BK] of one [K, V] state, transposed
        off_v = o_t[None, :] * (HV * V) + o_v[:, None]  # [BV, BT] rows of [tokens, HV, V], transposed
        b_x = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        m_h = m_k[:, None] & m_v[None, :]
        off_h = o_k[:, None] * V + o_v[None, :]  # [BK, BV] of one [K, V] state
        off_v = o_t[:, None] * (HV * V) + o_v[None, :]  # [BT, BV] rows of [tokens, HV, V]
        b_x = tl.zeros([BK, BV], dtype=tl.float32)
    if SEG == 1:
        if TRANS:
            b_x = tl.where(is_p & (o_v[:, None] == o_k[None, :]), 1.0, b_x)
        else:
            b_x = tl.where(is_p & (o_k[:, None] == o_v[None, :]), 1.0, b_x)
    elif BURNIN:  # (dh_SEG_START = "burnin") phase 3 alone: the walk starts where the adjoint's burn-in says
        tl.static_assert(SEG == 2 and GATE == 1 and not DQK, "BURNIN: phase 3, Gated DeltaNet, without REVERSE_DQK")
        s_eos = eos  # the segment's own end: nothing past it is stored
        seq1 = tl.load(seq_end + i_n).to(tl.int64)
        eos = burnin_end(gout, k, beta, seq1, s_eos, i_hv, i_h, H, HV, K, BT, BK)
        NTn = tl.cdiv(eos - bos, BT).to(tl.int32)
        if USE_DHT:  # the final state's gradient where the walk starts at the sequence's end (exact), else zero
            i_x = (tl.load(seg_seq + i_n).to(tl.int64) * HV + i_hv) * K * V
            b_dht = tl.load(dht + i_x + off_h, mask=m_h, other=0).to(tl.float32)
            b_x += tl.where(eos == seq1, b_dht, 0.0)
    elif SEG == 2:
        b_x += tl.load(xend + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0)
    elif USE_DHT:
        b_x += tl.load(dht + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
    if SEG == 1 and SEG_DECAY:  # (dh_SEG_DECAY) P_seg is the transpose of the forward's M_seg: the same bound
        tl.static_assert(GATE == 1, "dh_SEG_DECAY: Gated DeltaNet's scalar gate")
        skip = i_v < 0
        if is_p:
            skip = transition_negligible(gout, k, beta, bos, eos, i_hv, i_h, H, HV, K, BT, BK, False, 0)
        if skip:  # P_seg = 0 to float32 rounding: its tile stored as zeros, the segment not walked
            if TRANS:
                off_z = o_k[None, :] * (V + K) + o_e[:, None]
            else:
                off_z = o_k[:, None] * (V + K) + o_e[None, :]
            tl.store(ext + i_nh.to(tl.int64) * K * (V + K) + off_z, tl.zeros_like(b_x), mask=m_h)
            return

    for i_r in range(NTn):
        i_t = NTn - 1 - i_r
        t0 = bos + i_t * BT
        m_t = o_t < eos - t0
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = (m_v[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_v[None, :])
        m_to = (m_o[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_o[None, :])
        row_hv = t0 * HV + i_hv
        row_h = t0 * H + i_h
        r0 = t0.to(tl.int32)  # descriptor row
        b_xc = b_x.to(DT)
        if BURNIN:  # a burn-in chunk (past the segment's end): the adjoint only, nothing stored
            live = t0 < s_eos
        else:
            live = True
        if SEG != 1 and not DQK:  # noqa: SIM102 (DQK: the chunk's gradients are formed here, X_{c+1} never stored)
            if live:  # (a constexpr test, then a runtime one)
                if xs_td is not None:  # dh_STORE_TMA: the [K, BV] tile by one TMA store (no layout round trip first)
                    xs_row = (((c0 + i_t) * HV + i_hv) * K).to(tl.int32)
                    xs_td.store([xs_row, i_v * BV], tl.trans(b_xc) if TRANS else b_xc)
                else:
                    tl.store(dh + ((c0 + i_t) * HV + i_hv) * K * V + off_h, b_xc.to(dh.dtype.element_ty), mask=m_h)

        b_do = _load(do + row_hv * V, off_v, m_to, do_td, r0, c_v, m_t, USE_TMA, TRANS).to(DT)
        if W_READ:
            b_w = _load(w + row_hv * K, off_wk, m_tk, w_td, r0, c_k, m_t, USE_TMA, False)
        if GATE == 2:
            b_A = _load(aqk + row_hv * BT, off_a, m_t[:, None], a_td, r0, c_a, m_t, USE_TMA, False)
            b_kg = _load(kg + row_hv * K, off_wk, m_tk, k_td, r0, c_k, m_t, USE_TMA, False)
            b_qg = _load(qg + row_hv * K, off_wk, m_tk, q_td, r0, c_k, m_t, USE_TMA, False)
            b_dec = tl.load(gout + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0)
        else:
            b_k = _load(k + row_h * K, off_qk, m_tk, k_td, r0, c_qk, m_t, USE_TMA, False).to(tl.float32)
            b_q = _load(q + row_h * K, off_qk, m_tk, q_td, r0, c_qk, m_t, USE_TMA, False).to(tl.float32)
            b_qg, b_kg, b_gam, b_gC = scalar_chunk_operands(
                b_q, b_k, gout, row_hv, t0, eos, i_hv, o_t, m_t, scale, HV, BT, GATE, DT
            )  # fmt: skip
            if QK_RE:  # scale · A_qk formed here
                b_A = scalar_causal_aqk(b_q, b_k, b_gam, o_t, m_t, scale, GATE, DT, DOT_PREC)
            else:
                b_A = _load(aqk + row_hv * BT, off_a, m_t[:, None], a_td, r0, c_a, m_t, USE_TMA, False)

        if TRANS:
            b_dv = tl.dot(b_do, b_A, input_precision=DOT_PREC)
            b_dv += tl.dot(b_xc, tl.trans(b_kg), input_precision=DOT_PREC)
        else:
            b_dv = tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
            b_dv += tl.dot(b_kg, b_xc, input_precision=DOT_PREC)
        b_dvc = b_dv.to(DT)
        DVB: tl.constexpr = (DV and SEG != 1) or W_FROM_K  # dVβ = Tᵀ dV_new: off the chain, or on it (W_FROM_K)
        if DVB or W_REBUILD:
            m_low = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
            b_T = _load(ai + row_hv * BT, off_a, m_low, t_td, r0, c_a, m_t, USE_TMA, False)
            if USE_TMA:  # (the blocks above the diagonal, as stored)
                b_T = tl.where(m_low, b_T, 0)
            b_T = b_T.to(DT)  # lower triangular, unit diagonal
            b_beta = tl.load(beta + row_hv + o_t * HV, mask=m_t, other=0).to(tl.float32)
        if W_REBUILD:  # W = T (β e^γ ⊙ K) formed here, off the chain, instead of read
            b_rw = b_beta * tl.exp(b_gam) if GATE == 1 else b_beta
            b_w = tl.dot(b_T, (b_k * b_rw[:, None]).to(DT), input_precision=DOT_PREC).to(DT)
        if DVB:
            if TRANS:
                b_dvb = tl.dot(b_dvc, b_T, input_precision=DOT_PREC)  # dVβᵀ = dV_newᵀ T
            else:
                b_dvb = tl.dot(tl.trans(b_T), b_dvc, input_precision=DOT_PREC)
        if DV and SEG != 1:  # dv = β dVβ, dβ's v part; dVβ stored in dV_new's place
            if live:  # (a constexpr test, then a runtime one)
                b_v = _load(v + row_hv * V, off_v, m_tv, v_td, r0, c_v, m_t, USE_TMA, TRANS).to(tl.float32)
                if TRANS:
                    tl.store(dv + row_hv * V + off_v, (b_dvb * b_beta[None, :]).to(dv.dtype.element_ty), mask=m_tv)
                    b_dbv = tl.sum(b_dvb * b_v, 0)
                else:
                    tl.store(dv + row_hv * V + off_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
                    b_dbv = tl.sum(b_dvb * b_v, 1)
                if not DQK:  # (DQK: dVβ and the v part used here)
                    tl.store(dvn + row_hv * V + off_v, b_dvb.to(dvn.dtype.element_ty), mask=m_tv)
                    tl.store(
                        dbeta_part + i_v.to(tl.int64) * SS + row_hv + o_t * HV, b_dbv, mask=m_t
                    )  # this tile's slot
        elif SEG != 1:  # noqa: SIM102
            if live:  # (a constexpr test, then a runtime one)
                tl.store(dvn + row_hv * V + off_v, b_dvc.to(dvn.dtype.element_ty), mask=m_tv)
        # the chain's last product Wᵀ dV_new, from its operands: the dV side (b_l) and the K side (b_r); with X_ACC one
        # of them negated, X the dot's accumulator
        if W_FROM_K:  # Wᵀ dV_new = (β e^γ ⊙ K)ᵀ Tᵀ dV_new = (β e^γ ⊙ K)ᵀ dVβ: no W read
            b_rk = b_beta * tl.exp(b_gam) if GATE == 1 else b_beta
            b_r = (b_k * (-b_rk if X_ACC else b_rk)[:, None]).to(DT)
            b_l = b_dvb.to(DT)
        else:
            b_r = b_w
            b_l = -b_dvc if X_ACC else b_dvc

        if GATE == 2:
            b_x *= b_dec[None, :] if TRANS else b_dec[:, None]
        elif GATE == 1:
            b_x *= tl.exp(b_gC)
        if TRANS:
            b_x += tl.dot(b_do, b_qg, input_precision=DOT_PREC)
            if X_ACC:
                b_x = tl.dot(b_l, b_r, b_x, input_precision=DOT_PREC)
            else:
                b_x -= tl.dot(b_l, b_r, input_precision=DOT_PREC)
        else:
            b_x += tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
            if X_ACC:
                b_x = tl.dot(tl.trans(b_r), b_l, b_x, input_precision=DOT_PREC)
            else:
                b_x -= tl.dot(tl.trans(b_r), b_l, input_precision=DOT_PREC)
        if DQK and SEG != 1:  # the chunk's dq, dk, dβ, dg from X_{c+1} (b_xc), off the chain
            h_row = ((c0 + i_t) * HV + i_hv) * K  # the chunk's state: rows of the [chunks·HV·K, V] view
            if USE_TMA:
                b_h = h_td.load([h_row.to(tl.int32), 0])
                if TRANS:
                    b_h = tl.trans(b_h)
            else:
                b_h = tl.load(hbuf + h_row * V + off_h, mask=m_h, other=0)
            b_vn = _load(vnew + row_hv * V, off_v, m_tv, vn_td, r0, c_v, m_t, USE_TMA, TRANS)
            reverse_chunk_grads(
                b_do, b_dvb.to(DT), b_dbv, b_xc, b_h, b_vn, b_beta, q, k, graw, beta, dq, dk, dg, dbeta, row_hv,
                row_h, o_t, m_t, tl.minimum(eos - t0, BT).to(tl.int32), scale,
                H, HV, K, BT, BK, GATE, TRANS, DT, DOT_PREC, FLOOR,
            )  # fmt: skip

    if SEG == 1:
        # the extended adjoint [K, V + K] of this segment: R_seg in columns :V, P_seg in columns V:
        if TRANS:
            off_e = o_k[None, :] * (V + K) + o_e[:, None]
        else:
            off_e = o_k[:, None] * (V + K) + o_e[None, :]
        tl.store(ext + i_nh.to(tl.int64) * K * (V + K) + off_e, b_x, mask=m_h)
    elif SEG == 2:
        if STORE_DH0:
            i_out = tl.load(first + i_n)
            if i_out >= 0:  # the sequence's first segment: its start adjoint is the initial state's gradient
                tl.store(dh0 + (i_out.to(tl.int64) * HV + i_hv) * K * V + off_h, b_x, mask=m_h)
    elif STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_h, b_x, mask=m_h)


def launch_reverse(
    q: Tensor,
    k: Tensor,
    w: Tensor | None,
    aqk: Tensor | None,
    qg: Tensor | None,
    kg: Tensor | None,
    gout: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    dh0: Tensor | None,
    dh: Tensor,
    dvn: Tensor,
    cu_seqlens: Tensor | None,
    chunk_offsets: Tensor | None,
    offsets: Sequence[int] | None,
    scale: float,
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    N: int,
    BT: int,
    GATE: int,
    dot_prec: str,
    config: Config,
    dv_work: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None,
    w_from_k: bool = False,
    qk_re: bool = False,
    w_rebuild: bool = False,
    dqk_work: tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None, Tensor] | None = None,
    beta: Tensor | None = None,
) -> None:
    """The reverse state pass of one call: fills ``dh`` (``X_{c+1}`` per chunk), ``dvn`` (``dV_new``) and ``dh0``
    (the initial state's gradient, when given), per sequence or, with ``dh_SEG_CHUNKS`` and a sequence of more than
    one segment, in the three phases of :mod:`.bwd_segments`. ``offsets``: ``cu_seqlens`` on the host (varlen).
    ``dv_work`` (``REVERSE_DV``): ``(T, v, beta, dv, dbeta_part)``: ``dvn`` then receives ``dVβ = Tᵀ dV_new``, ``dv``
    is written and slot ``i`` of ``dbeta_part`` gets dβ's ``v`` part of value tile ``i``. ``w_from_k`` (needs
    ``dv_work``; ``w`` may then be any tensor of the intermediates' dtype): ``Wᵀ dV_new`` as ``(β e^γ ⊙ K)ᵀ dVβ``, W
    never read; ``w_rebuild`` (needs ``dv_work`` too): W formed per chunk as ``T (β e^γ ⊙ K)``, off the chain;
    ``qk_re``: ``A_qk`` formed from q and k per chunk (``aqk`` unread, any such tensor). ``dqk_work``
    (``REVERSE_DQK``, needs ``dv_work``; DeltaNet, Gated DeltaNet): ``(S_c, V_new, g, dq, dk, dg, dβ)``: the pass also
    forms every chunk's ``dq``, ``dk``, ``dβ`` and ``dg`` (:mod:`.bwd_reverse_dqk`) on the whole value width (one value
    tile, ``dh_BV`` unused), and stores neither ``dh`` nor ``dvn`` nor ``dv_work``'s ``dbeta_part``. ``beta``: the
    inputs' β, for ``dh_SEG_DECAY`` (phase 1's test of each segment's transition). ``dh_LOOP = "gluon"``: the plain
    pass, or the sequence-parallel pass's phase 3, in Gluon (:mod:`.bwd_state_ws`) where its ``why_not`` allows."""
    BV = tile(config["dh_BV"], V)
    # (REVERSE_DQK: on the whole value width in registers, or by value tiles with the adjoint in a scratch)
    whole = tile(next_power_of_2(V), V)
    tiled = dqk_work is not None and whole > BV
    if dqk_work is not None:
        BV = BV if tiled else whole
    BK = tile(next_power_of_2(K), K)
    common = dict(
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, GATE=GATE, DOT_PREC=dot_prec, TRANS=config["dh_LAYOUT"] == "vk",
        num_warps=config["dh_num_warps"], num_stages=config["dh_num_stages"], W_FROM_K=w_from_k, QK_RE=qk_re,
        W_REBUILD=w_rebuild, X_ACC=config["dh_ACC"],
    )  # fmt: skip
    if (w_from_k or w_rebuild) and dv_work is None:
        raise ValueError("the reverse pass forms Wᵀ dV_new from K only with dv_work (REVERSE_DV): it needs T and beta")
    args = (q, k, w, aqk, qg, kg, gout, do)
    extra: dict[str, Any] = {}
    if dv_work is not None:
        ai, v, beta, dv, dbeta_part = dv_work
        extra = dict(DV=True, ai=ai, v=v, beta=beta, dv=dv, dbeta_part=dbeta_part, SS=dbeta_part.shape[1] * HV)
    if dqk_work is not None:
        if dv_work is None or GATE == 2:
            raise ValueError(
                "REVERSE_DQK needs dv_work (REVERSE_DV) and a scalar gate or none (DeltaNet, Gated DeltaNet)"
            )
        hbuf, vnew, graw, dq, dk, dg, dbeta = dqk_work
        extra |= dict(
            DQK=True, hbuf=hbuf, vnew=vnew, graw=dbeta if graw is None else graw, dq=dq, dk=dk,
            dg=dbeta if dg is None else dg, dbeta=dbeta, FLOOR=GATE_FLOOR,
        )  # fmt: skip
    seg = reverse_segments(offsets, B, T, BT, int(config["dh_SEG_CHUNKS"]), q.device)
    gluon: Callable[..., Any] | None = None  # the Gluon pass, where it serves this call (the plain one or phase 3)
    if config.get("dh_LOOP", "range") == "gluon" and dv_work is not None:
        from .bwd_state_ws import launch_reverse_ws, why_not  # (Gluon imported only where a config asks for it)

        w_read = not (w_from_k or w_rebuild)
        reads = [t for t in (do, q, k, dv_work[0], dv_work[1], dh, w if w_read else None) if t is not None]
        if not qk_re and aqk is not None:
            reads.append(aqk)
        why = why_not(
            device=q.device, gate=GATE, dtype=dh.dtype, inputs=tuple(reads), K=K, V=V, BT=BT, BV=BV, config=config,
            segmented=seg is not None, dv_work=True, dqk_work=dqk_work is not None, w_rebuild=w_rebuild,
            qk_re=qk_re, w_read=w_read,
        )  # fmt: skip
        if why is None:
            gluon = partial(
                launch_reverse_ws, q=q, k=k, w=w, aqk=aqk, gout=gout, do=do, dh0=dh0, dh=dh, dvn=dvn,
                dv_work=dv_work, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, GATE=GATE, config=config,
                qk_re=qk_re, w_read=w_read,
            )  # fmt: skip
            if seg is None:
                gluon(dht=dht, cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, N=N)
                return
    tds = descriptors(
        q, k, w, aqk, qg, kg, do, dv_work, w_from_k or w_rebuild, qk_re, H, HV, K, V, BT, BK, BV, config, dqk_work
    )  # fmt: skip
    extra |= tds  # (the plain pass and phase 3; phase 1 loads by pointers)
    if dqk_work is None:  # (REVERSE_DQK stores no adjoint)
        extra |= store_descriptor(dh, K, V, BK, BV, config)
    if seg is not None and config.get("dh_SEG_START", "transitions") == "burnin":
        if dqk_work is not None or beta is None or GATE != 1:
            raise ValueError("dh_SEG_START='burnin' needs beta, Gated DeltaNet's gate and no REVERSE_DQK")
        # phase 3 alone: each segment's end adjoint by burn-in (no phases 1 and 2, no scratch); an empty sequence's
        # initial state's gradient is its final state's (phase 2 stores it otherwise)
        if dh0 is not None and seg.empty is not None:
            if dht is not None:
                dh0.index_copy_(0, seg.empty, dht.index_select(0, seg.empty).to(dh0.dtype))
            else:
                dh0.index_fill_(0, seg.empty, 0.0)
        chunk_bwd_state_kernel[(triton.cdiv(V, BV), seg.NS * HV)](
            *args, dht, dh0, dh, dvn, seg.bounds, seg.chunk_offsets, scale, T, BV=BV, USE_DHT=dht is not None,
            STORE_DH0=dh0 is not None, VARLEN=True, SEG=2, first=seg.first, **common, **(extra | {"beta": beta}),
            BURNIN=True, seg_seq=seg.seq_index, seq_end=seg.seq_end,
        )  # fmt: skip
        return
    tiled_pass = None
    if tiled:
        assert dv_work is not None and dqk_work is not None
        tiled_pass = partial(
            _launch_tiled, q, k, w, aqk, gout, do, dv_work, dqk_work, scale, T, H, HV, K, V, BT, BK, BV, GATE,
            dot_prec, config, w_from_k or w_rebuild, qk_re,
        )  # fmt: skip
    if seg is None:
        if tiled_pass is not None:
            tiled_pass(N, dht, dh0, cu_seqlens, chunk_offsets)
            return
        chunk_bwd_state_kernel[(triton.cdiv(V, BV), N * HV)](
            *args, dht, dh0, dh, dvn, cu_seqlens, chunk_offsets, scale, T, BV=BV, USE_DHT=dht is not None,
            STORE_DH0=dh0 is not None, VARLEN=cu_seqlens is not None, **common, **extra,
        )  # fmt: skip
        return
    ext = torch.empty(seg.NS, HV, K, V + K, dtype=torch.float32, device=q.device)  # phase 1: [R_s | P_s]
    # (phase 1 forms dVβ on the chain too when W is not read: T and beta)
    p1: dict[str, Any] = {}
    if (w_from_k or w_rebuild) and dv_work is not None:
        p1 = dict(ai=dv_work[0], beta=dv_work[2])
    if config.get("dh_SEG_DECAY", False):
        if beta is None or GATE != 1:
            raise ValueError("dh_SEG_DECAY needs beta and Gated DeltaNet's scalar gate")
        p1 |= dict(SEG_DECAY=True, beta=beta)
    xend = torch.empty(seg.NS, HV, K, V, dtype=torch.float32, device=q.device)  # phase 2: X at each segment's end
    chunk_bwd_state_kernel[(triton.cdiv(V, BV) + triton.cdiv(K, BV), seg.NS * HV)](
        *args, None, None, None, None, seg.bounds, seg.chunk_offsets, scale, T, BV=BV, USE_DHT=False,
        STORE_DH0=False, VARLEN=True, SEG=1, first=seg.first, ext=ext, **common, **p1,
    )  # fmt: skip
    e_BV = min(BV, ENDS_MAX_BV)
    chunk_bwd_segment_ends_kernel[(triton.cdiv(V, e_BV), N * HV)](
        ext, dht, xend, dh0, seg.seq_segments, HV=HV, K=K, V=V, BK=BK, BV=e_BV, USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None, DOT_PREC=dot_prec, **ENDS_LAUNCH,
    )  # fmt: skip
    if tiled_pass is not None:
        tiled_pass(seg.NS, None, dh0, seg.bounds, seg.chunk_offsets, SEG=2, first=seg.first, xend=xend)
        return
    if gluon is not None:  # phase 3 in Gluon: each segment's walk from its end adjoint
        gluon(
            dht=None, cu_seqlens=seg.bounds, chunk_offsets=seg.chunk_offsets, N=seg.NS,
            seg={"SEG": True, "xend": xend, "first": seg.first},
        )  # fmt: skip
        return
    chunk_bwd_state_kernel[(triton.cdiv(V, BV), seg.NS * HV)](
        *args, None, dh0, dh, dvn, seg.bounds, seg.chunk_offsets, scale, T, BV=BV, USE_DHT=False,
        STORE_DH0=dh0 is not None, VARLEN=True, SEG=2, first=seg.first, xend=xend, **common, **extra,
    )  # fmt: skip


def _launch_tiled(
    q: Tensor,
    k: Tensor,
    w: Tensor | None,
    aqk: Tensor | None,
    gout: Tensor | None,
    do: Tensor,
    dv_work: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    dqk_work: tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None, Tensor],
    scale: float,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    BT: int,
    BK: int,
    BV: int,
    GATE: int,
    dot_prec: str,
    config: Config,
    no_w: bool,
    qk_re: bool,
    programs: int,
    dht: Tensor | None,
    dh0: Tensor | None,
    bounds: Tensor | None,
    chunk_offsets: Tensor | None,
    **seg: Any,
) -> None:
    """``REVERSE_DQK`` by value tiles (:func:`.bwd_reverse_dqk.chunk_bwd_reverse_dqk_tiled_kernel`): ``programs``
    sequences (or segments, with ``seg``: ``SEG = 2``, ``first``, ``xend``) times HV, the adjoint in a float32
    scratch of one ``[K, V]`` slot each."""
    ai, v, beta, dv, _ = dv_work
    hbuf, vnew, graw, dq, dk, dg, dbeta = dqk_work
    xs = torch.empty(programs * HV, K, V, dtype=torch.float32, device=q.device)
    chunk_bwd_reverse_dqk_tiled_kernel[(programs * HV,)](
        q, k, ai if no_w or w is None else w, ai if qk_re or aqk is None else aqk, gout if gout is not None else xs,
        do, dht, dh0, ai, v, beta, dv, hbuf, vnew, dbeta if graw is None else graw, dq, dk,
        dbeta if dg is None else dg, dbeta, xs, bounds, chunk_offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, NV=triton.cdiv(V, BV), GATE=GATE, USE_DHT=dht is not None,
        STORE_DH0=dh0 is not None, VARLEN=bounds is not None, DOT_PREC=dot_prec, FLOOR=GATE_FLOOR,
        W_FROM_K=no_w, QK_RE=qk_re, num_warps=config["dh_num_warps"], num_stages=config["dh_num_stages"], **seg,
    )  # fmt: skip


def store_descriptor(dh: Tensor, K: int, V: int, BK: int, BV: int, config: Config) -> dict[str, Any]:
    """``dh_STORE_TMA``: the TMA descriptor the reverse pass stores each chunk's adjoint through (``[BK, BV]`` blocks
    of the ``[chunks·HV·K, V]`` view: a whole value tile of one state), as ``xs_td``. Empty (pointer stores) without
    it, where a tile would not be one state's whole key range and ``BV`` columns (``BK != K``, ``BV`` not dividing
    V), or where ``dh`` does not start 16-byte aligned."""
    if not config.get("dh_STORE_TMA", False) or BK != K or V % BV or not dh.numel() or dh.data_ptr() % 16:
        return {}
    rows = dh.numel() // V
    return {"xs_td": TensorDescriptor(dh.view(rows, V), [rows, V], [V, 1], [BK, BV])}


def descriptors(
    q: Tensor,
    k: Tensor,
    w: Tensor | None,
    aqk: Tensor | None,
    qg: Tensor | None,
    kg: Tensor | None,
    do: Tensor,
    dv_work: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None,
    w_from_k: bool,
    qk_re: bool,
    H: int,
    HV: int,
    K: int,
    V: int,
    BT: int,
    BK: int,
    BV: int,
    config: Config,
    dqk_work: tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None, Tensor] | None = None,
) -> dict[str, Any]:
    """``dh_TMA``: TMA descriptors of the reverse pass's tiles (2-D token-major views, one chunk of rows by one head's
    columns or ``BV`` of them): dO, q and k (KDA: q̃, k̃), W and A_qk where read, T and v with ``dv_work``, the chunk
    states (``[BK, BV]`` blocks of their ``[chunks·HV·K, V]`` view) and V_new with ``dqk_work``; with the constexpr
    ``TMA``. Empty (pointer loads) without ``dh_TMA`` or where a tile would cross a head (K not a power of
    two, ``BV`` not dividing V) or an input does not start 16-byte aligned."""
    tokens = do.shape[0] * do.shape[1]
    if not config.get("dh_TMA", False) or K != BK or V % BV or not tokens:
        return {}
    loads = [q, k, do] + ([dv_work[1]] if dv_work is not None else []) + (list(dqk_work[:2]) if dqk_work else [])
    if any(t.data_ptr() % 16 for t in loads):
        return {}

    def desc(t: Tensor, width: int, block: int) -> TensorDescriptor:
        return TensorDescriptor(t.view(tokens, width), [tokens, width], [width, 1], [BT, block])

    tds: dict[str, Any] = {"TMA": True, "do_td": desc(do, HV * V, BV)}
    if qg is not None and kg is not None:  # KDA: q~ and k~ per value head, from stage 1
        tds |= {"q_td": desc(qg, HV * K, K), "k_td": desc(kg, HV * K, K)}
    else:
        tds |= {"q_td": desc(q, H * K, K), "k_td": desc(k, H * K, K)}
    if not w_from_k and w is not None:
        tds["w_td"] = desc(w, HV * K, K)
    if not qk_re and aqk is not None:
        tds["a_td"] = desc(aqk, HV * BT, BT)
    if dv_work is not None:
        tds |= {"t_td": desc(dv_work[0], HV * BT, BT), "v_td": desc(dv_work[1], HV * V, BV)}
    if dqk_work is not None:
        hbuf, vnew = dqk_work[0], dqk_work[1]
        rows = hbuf.numel() // V
        tds |= {"h_td": TensorDescriptor(hbuf.view(rows, V), [rows, V], [V, 1], [BK, BV])}
        tds |= {"vn_td": desc(vnew, HV * V, BV)}
    return tds
