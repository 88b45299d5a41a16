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

``RECOMPUTE`` (``WU = "recomputed"``): ``V_new = T (β ⊙ (V − e^γ ⊙ K S))`` from stage 1's inverse ``T`` and the v,
k tiles (in phase 1's M columns V = 0, as U = 0 there); KDA (per-channel decays): ``V_new = T (β ⊙ V − P S)`` with
``P = β ⊙ K ⊙ e^γ`` from stage 1 (in W's buffer); ``QK_RECOMPUTE`` (``AQK = "recomputed"``): ``scale · A_qk =
scale · q kᵀ ⊙ e^(γ_i − γ_j)`` from the q, k tiles. ``TMA``: the chunk's tiles through TMA descriptors (the
launcher's :func:`descriptors`; not in phase 1), whole chunks of the output stored through one; rows past the
sequence's end are then the next sequence's tokens, zeroed in ``V_new`` so that they reach neither the output nor the
state. ``LOOP_WS``: the chunk loop warp-specialised (``tl.range(num_stages=LOOP_STAGES, warp_specialize=True)``,
:func:`loop_options`).

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
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import Config
from .buffers import Intermediates, Outputs, SegmentScratch
from .call import ChunkCall, register_cap, tile
from .common import burnin_start, load_beta, transition_negligible
from .tables import SegmentTable


@triton.jit
def _tile(base, off, mask, td, row, col, TMA: tl.constexpr, TRANS: tl.constexpr):
    """One chunk's tile of a token-major matrix: ``[BT, BX]`` (``TRANS``: ``[BX, BT]``). Pointers: ``base + off``
    under ``mask`` (0 elsewhere). ``TMA``: the descriptor ``td``'s block at (``row`` = first token, ``col``), rows
    past the tensor read 0 and rows past the sequence the next one's tokens (the caller keeps them out of V_new)."""
    if TMA:
        x = td.load([row, col])
        if TRANS:
            x = tl.trans(x)
    else:
        x = tl.load(base + off, mask=mask, other=0)
    return x


@triton.jit
def _gate(gout, t0, eos, i_hv, o_t, BT: tl.constexpr, HV: tl.constexpr):
    """The scalar gate of the chunk from token ``t0``: γ per row and γ_C (the chunk's last row), 0 past ``eos`` (no
    load there: a chunk past the sequence, or an empty sequence at the start of the batch)."""
    b_gam = tl.load(gout + (t0 * HV + i_hv) + o_t * HV, mask=o_t < (eos - t0).to(tl.int32), other=0)
    b_gC = tl.load(gout + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv, mask=t0 < eos, other=0)
    return b_gam, b_gC


@triton.jit
def _factors(rq, rk, t0, eos, i_h, o_t, H: tl.constexpr):
    """The l2norm factors of q's and k's rows of the chunk from token ``t0`` (``[tokens, H]``, stored by stage 1), 0
    past ``eos`` (no load there)."""
    m = o_t < (eos - t0).to(tl.int32)
    off = t0 * H + i_h + o_t * H
    return tl.load(rq + off, mask=m, other=0.0), tl.load(rk + off, mask=m, other=0.0)


@triton.jit
def _exp(x):
    """e^x as 2^(x log2 e): ex2.approx.ftz on sm_90a; ``tl.exp`` (ex2.approx without ftz) costs three more
    instructions each for the denormal results that float32 products here never need."""
    return tl.math.exp2(x * 1.4426950408889634)


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
    v=None,
    beta=None,
    ai=None,
    q_td=None,
    k_td=None,
    w_td=None,
    u_td=None,
    v_td=None,
    t_td=None,
    a_td=None,
    o_td=None,
    RECOMPUTE: tl.constexpr = False,
    QK_RECOMPUTE: tl.constexpr = False,
    TMA: tl.constexpr = False,
    LOOP_STAGES: tl.constexpr = None,
    LOOP_WS: tl.constexpr = False,
    STORE_STATES: tl.constexpr = False,
    GATE_PREFETCH: tl.constexpr = False,
    L2NORM: tl.constexpr = False,
    BETA_ACT: tl.constexpr = 0,
    rq=None,
    rk=None,
    hs_td=None,
    vn_td=None,
    SEG_DECAY: tl.constexpr = False,
    BURNIN: tl.constexpr = False,
    seg_seq=None,
    seq_first=None,
):
    """``SEG_DECAY`` (phase 1, Gated DeltaNet): an M column tile whose segment's transition is negligible
    (:func:`.common.transition_negligible`) stores zeros and ends without walking the segment. ``BURNIN`` (phase 3
    without phases 1 and 2, Gated DeltaNet; ``SEG_START = "burnin"``): each segment finds, chunk by chunk backwards,
    the nearest start whose transition up to the segment is negligible (:func:`.common.burnin_start`), or its
    sequence's first token (``seq_first[s]``; ``h0`` is then the sequence's initial state, ``seg_seq[s]`` its index),
    walks those chunks from a zero state (or that initial state) with no output or store, then its own.
    ``L2NORM``: q and k l2-normalised, their rows' factors (``rq``, ``rk`` ``[tokens, H]``, stored by stage 1) applied
    to the products' rows (DeltaNet, Gated DeltaNet; KDA's q~, k~ come normalised from stage 1);
    ``BETA_ACT``: beta's activation where beta is loaded (``WU = "recomputed"``); ``hs_td``, ``vn_td``
    (``STATES_TMA``): descriptors of the chunk states' ``[chunks·HV·K, V]`` and V_new's ``[tokens, HV·V]`` views, each
    chunk's state tile and a whole chunk's V_new tile stored through them (a partial chunk's V_new by pointers)."""
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
    if RECOMPUTE:
        DT = ai.dtype.element_ty
    else:
        DT = w.dtype.element_ty
    # q and k as loaded, the scale and the gate's factors on the products and on V_new's rows (always when recomputed)
    DIRECT: tl.constexpr = RECOMPUTE or QK_RECOMPUTE or QK_DIRECT
    # descriptors in the plain and phase-3 passes (phase 1's M columns have no values to load)
    USE_TMA: tl.constexpr = TMA and SEG != 1

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if SEG == 1:
        # column tile i_v of the extended state [K, V + K]: V tiles of N, then K tiles of M (an identity start)
        NVV = tl.cdiv(V, BV)
        is_m = i_v >= NVV
        o_v = tl.where(is_m, i_v - NVV, i_v) * BV + tl.arange(0, BV)
        m_v = o_v < tl.where(is_m, K, V)
        m_u = o_v < tl.where(is_m, 0, V)  # U = 0 (V = 0 when recomputed) in the M columns
        o_e = o_v + tl.where(is_m, V, 0)  # column of the extended state
    else:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_u = m_v
    c_qk = i_h * K  # descriptor columns of this head's q, k; of its W; of its U, V, O tile; of its A_qk, T rows
    c_w = i_hv * K
    c_v = i_hv * V + i_v * BV
    c_a = i_hv * BT

    # Tile offsets inside one chunk (int32, loop-invariant); the chunk's base pointers are scalars (int64).
    off_wk = o_t[:, None] * (HV * K) + o_k[None, :]  # [BT, BK] rows of [tokens, HV, K]
    off_qk = o_t[:, None] * (H * K) + o_k[None, :]  # [BT, BK] rows of [tokens, H, K]
    off_a = o_t[:, None] * (HV * BT) + o_t[None, :]  # [BT, BT] rows of [tokens, HV, BT]
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
    elif BURNIN:
        tl.static_assert(SEG == 2 and GATE == 1, "BURNIN: the segmented pass's phase 3, Gated DeltaNet")
        seq0 = tl.load(seq_first + i_n).to(tl.int64)
        s_bos = bos  # the segment's own first token: outputs and stores from there on
        bos = burnin_start(gout, k, beta, seq0, s_bos, i_hv, i_h, H, HV, K, BT, BK, L2NORM, BETA_ACT)
        c0 -= (s_bos - bos) // BT  # (the chunk states' global index of the walk's first chunk)
        NTn = tl.cdiv(eos - bos, BT).to(tl.int32)
        if USE_H0:  # the sequence's initial state when the walk starts at the sequence's start (exact), else zero
            i_h0 = (tl.load(seg_seq + i_n).to(tl.int64) * HV + i_hv) * K * V
            b_h0 = tl.load(h0 + i_h0 + off_h, mask=m_h, other=0).to(tl.float32)
            b_h += tl.where(bos == seq0, b_h0, 0.0)
    elif USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
    if SEG == 1 and SEG_DECAY:
        tl.static_assert(GATE == 1, "SEG_DECAY: Gated DeltaNet's scalar gate")
        skip = i_v < 0
        if is_m:
            skip = transition_negligible(gout, k, beta, bos, eos, i_hv, i_h, H, HV, K, BT, BK, L2NORM, BETA_ACT)
        if skip:  # M_seg = 0 to float32 rounding: its tile stored as zeros, the segment not walked
            if TRANS:
                off_z = o_k[None, :] * (V + K) + o_e[:, None]
            else:
                off_z = o_k[:, None] * (V + K) + o_e[None, :]
            tl.store(ext + i_nh.to(tl.int64) * K * (V + K) + off_z, tl.zeros_like(b_h), mask=m_h)
            return

    PREFETCH: tl.constexpr = GATE == 1 and GATE_PREFETCH
    if PREFETCH:  # the first chunk's gate; each chunk then loads the next one's, a whole chunk ahead of its use
        b_gam_n, b_gC_n = _gate(gout, bos, eos, i_hv, o_t, BT, HV)
    # the same for the l2norm's row factors (DeltaNet, Gated DeltaNet: KDA's q~, k~ come normalised): loaded in the
    # chunk that uses them, the loop's pipelining left them on the chain
    FACTORS: tl.constexpr = L2NORM and GATE != 2
    if FACTORS:
        b_rq_n, b_rk_n = _factors(rq, rk, bos, eos, i_h, o_t, H)
    for i_t in tl.range(0, NTn, num_stages=LOOP_STAGES, warp_specialize=LOOP_WS):
        t0 = bos + i_t * BT
        if BURNIN:  # a burn-in chunk (before the segment's own): the state only, no output, nothing stored
            live = t0 >= s_bos
        else:
            live = True
        r0 = t0.to(tl.int32)  # descriptor row
        m_t = o_t < (eos - t0).to(tl.int32)  # (an int32 compare per row: the chunk's rows left, not token indices)
        if PREFETCH:
            b_gam, b_gC = b_gam_n, b_gC_n
            b_gam_n, b_gC_n = _gate(gout, t0 + BT, eos, i_hv, o_t, BT, HV)
        if FACTORS:
            b_rq, b_rk = b_rq_n, b_rk_n
            b_rq_n, b_rk_n = _factors(rq, rk, t0 + BT, eos, i_h, o_t, H)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = (m_v[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_v[None, :])
        m_tu = (m_u[:, None] & m_t[None, :]) if TRANS else (m_t[:, None] & m_u[None, :])
        row_hv = t0 * HV + i_hv  # scalar: first row of the chunk in [tokens, HV, ...]
        row_h = t0 * H + i_h
        EARLY: tl.constexpr = RECOMPUTE or QK_RECOMPUTE  # a recomputed product needs k and γ before the output
        if GATE == 1 and EARLY and not PREFETCH:
            b_gam, b_gC = _gate(gout, t0, eos, i_hv, o_t, BT, HV)
        if GATE == 2 and RECOMPUTE:  # P = β ⊙ K ⊙ e^γ (KDA: stage 1's, in W's buffer)
            b_k = _tile(w + row_hv * K, off_wk, m_tk, w_td, r0, c_w, USE_TMA, False)
        elif EARLY:
            b_k = _tile(k + row_h * K, off_qk, m_tk, k_td, r0, c_qk, USE_TMA, False).to(DT)
        if RECOMPUTE:
            b_hc = b_h.to(DT)
            # V_new = T (β ⊙ (V − e^γ ⊙ K S)): the chunk's inverse T (causal; stage 1 stores its upper blocks as 0)
            b_x = _tile(v + row_hv * V, off_v, m_tu, v_td, r0, c_v, USE_TMA, TRANS).to(tl.float32)
            if TRANS:
                b_ks = tl.dot(b_hc, tl.trans(b_k), input_precision=DOT_PREC)  # (K S)ᵀ [BV, BT]
            else:
                b_ks = tl.dot(b_k, b_hc, input_precision=DOT_PREC)  # K S [BT, BV]
            b_rf = load_beta(beta + row_hv + o_t * HV, m_t, BETA_ACT)  # β per token row
            if GATE == 2:  # β ⊙ V − P S (β already in P)
                b_x *= b_rf[None, :] if TRANS else b_rf[:, None]
                b_x -= b_ks
            elif GATE == 1:
                b_eg = _exp(b_gam)
                if L2NORM:  # (K S)'s rows times k's factors
                    b_eg *= b_rk
                b_x -= b_ks * (b_eg[None, :] if TRANS else b_eg[:, None])
            elif L2NORM:
                b_x -= b_ks * (b_rk[None, :] if TRANS else b_rk[:, None])
            else:
                b_x -= b_ks
            if GATE == 2:
                b_x = b_x.to(DT)
            else:
                b_x = (b_x * (b_rf[None, :] if TRANS else b_rf[:, None])).to(DT)
            b_T = _tile(ai + row_hv * BT, off_a, m_t[:, None] & (o_t[None, :] <= o_t[:, None]), t_td, r0, c_a,
                        USE_TMA, False).to(DT)  # fmt: skip
            if TRANS:
                b_vn = tl.dot(b_x, tl.trans(b_T), input_precision=DOT_PREC)
            else:
                b_vn = tl.dot(b_T, b_x, input_precision=DOT_PREC)
        else:
            b_w = _tile(w + row_hv * K, off_wk, m_tk, w_td, r0, c_w, USE_TMA, False)
            b_u = _tile(u + row_hv * V, off_v, m_tu, u_td, r0, c_v, USE_TMA, TRANS).to(tl.float32)
            b_hc = b_h.to(DT)
            if TRANS:
                b_vn = b_u - tl.dot(b_hc, tl.trans(b_w), input_precision=DOT_PREC)
            else:
                b_vn = b_u - tl.dot(b_w, b_hc, input_precision=DOT_PREC)
        if USE_TMA:  # rows past the sequence hold the next one's tokens: no part of V_new, the output or the state
            b_vn = tl.where(m_tv, b_vn, 0.0)
        b_vnc = b_vn.to(DT)
        if GATE == 1 and not EARLY and not PREFETCH:
            b_gam, b_gC = _gate(gout, t0, eos, i_hv, o_t, BT, HV)
        if SEG == 1:
            pass  # transitions only: no output, no chunk states
        elif FUSE_OUTPUT:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if live:  # (a burn-in chunk has no output)
                if GATE == 2:
                    b_q = _tile(qg + row_hv * K, off_wk, m_tk, q_td, r0, c_w, USE_TMA, False)
                elif DIRECT:
                    b_q = _tile(q + row_h * K, off_qk, m_tk, q_td, r0, c_qk, USE_TMA, False).to(DT)
                else:
                    b_q = _tile(q + row_h * K, off_qk, m_tk, q_td, r0, c_qk, USE_TMA, False).to(tl.float32)
                    if L2NORM:
                        b_q *= b_rq[:, None]
                    b_q *= scale
                    if GATE == 1:
                        b_q *= _exp(b_gam)[:, None]
                    b_q = b_q.to(DT)
                if QK_RECOMPUTE:  # scale · A_qk = scale · (q kᵀ ⊙ e^(γ_i − γ_j)), causal (j <= i), rows of this chunk
                    m_qk = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
                    if L2NORM:
                        b_A *= b_rq[:, None] * b_rk[None, :]
                    if GATE == 1:
                        b_A *= _exp(tl.where(m_qk, b_gam[:, None] - b_gam[None, :], float("-inf")))
                        b_A = (b_A * scale).to(DT)
                    else:
                        b_A = tl.where(m_qk, b_A * scale, 0.0).to(DT)
                else:
                    b_A = _tile(aqk + row_hv * BT, off_a, m_t[:, None], a_td, r0, c_a, USE_TMA, False)
                if TRANS:
                    b_o = tl.dot(b_hc, tl.trans(b_q), input_precision=DOT_PREC)
                else:
                    b_o = tl.dot(b_q, b_hc, input_precision=DOT_PREC)
                if GATE != 2 and DIRECT:  # the rows' factor scale · exp(γ) on the product, not on q
                    b_qf = tl.full([BT], scale, dtype=tl.float32)
                    if L2NORM:
                        b_qf *= b_rq
                    if GATE == 1:
                        b_qf *= _exp(b_gam)
                    b_o *= b_qf[None, :] if TRANS else b_qf[:, None]
                if TRANS:
                    b_o += tl.dot(b_vnc, tl.trans(b_A), input_precision=DOT_PREC)
                else:
                    b_o += tl.dot(b_A, b_vnc, input_precision=DOT_PREC)
                b_o = b_o.to(o.dtype.element_ty)
                if USE_TMA and not LOOP_WS:  # (a branch in the loop keeps Triton from specialising warps)
                    if t0 + BT <= eos:  # a whole chunk: one TMA store; the sequence's last, partial one by pointers
                        o_td.store([r0, c_v], tl.trans(b_o) if TRANS else b_o)
                    else:
                        tl.store(o + row_hv * V + off_v, b_o, mask=m_tv)
                else:
                    tl.store(o + row_hv * V + off_v, b_o, mask=m_tv)
        # (STORE_STATES: the backward's, with the output too)
        if SEG != 1 and (not FUSE_OUTPUT or STORE_STATES):  # noqa: SIM102 (a constexpr test, then a runtime one)
            if live:  # (a burn-in chunk's state and V_new are the previous segment's to store)
                if hs_td is not None:  # STATES_TMA: one TMA store per tile, no layout round trip through shared memory
                    hs_row = (((c0 + i_t) * HV + i_hv) * K).to(tl.int32)
                    b_hs = b_hc.to(hbuf.dtype.element_ty)
                    hs_td.store([hs_row, i_v * BV], tl.trans(b_hs) if TRANS else b_hs)
                    b_vs = b_vnc.to(vnew.dtype.element_ty)
                    if t0 + BT <= eos:  # a whole chunk: one store; the sequence's last, partial one by pointers
                        vn_td.store([r0, c_v], tl.trans(b_vs) if TRANS else b_vs)
                    else:
                        tl.store(vnew + row_hv * V + off_v, b_vs, mask=m_tv)
                else:
                    tl.store(hbuf + ((c0 + i_t) * HV + i_hv) * K * V + off_h, b_hc.to(hbuf.dtype.element_ty), mask=m_h)
                    tl.store(vnew + row_hv * V + off_v, b_vnc.to(vnew.dtype.element_ty), mask=m_tv)
        b_vk = b_vnc  # V_new as the state update's operand
        if GATE != 2 and not EARLY:
            b_k = _tile(k + row_h * K, off_qk, m_tk, k_td, r0, c_qk, USE_TMA, False).to(DT)
        if GATE == 2:
            b_kg = _tile(kg + row_hv * K, off_wk, m_tk, k_td, r0, c_w, USE_TMA, False)
            b_dec = tl.load(gout + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0)
            if TRANS:
                b_h *= b_dec[None, :]
            else:
                b_h *= b_dec[:, None]
        elif GATE == 1:
            b_dk = _exp(b_gC - b_gam)
            if L2NORM:
                b_dk *= b_rk
            if DIRECT:  # k~ᵀ V_new = kᵀ (exp(γ_C − γ) ⊙ V_new): the factor on the token rows of V_new
                b_kg = b_k
                b_vk = (b_vn * (b_dk[None, :] if TRANS else b_dk[:, None])).to(DT)
            else:
                b_kg = (b_k.to(tl.float32) * b_dk[:, None]).to(DT)
            b_h *= _exp(b_gC)
        else:
            b_kg = b_k
            if L2NORM:  # kᵀ diag(r_k) V_new: the factors on V_new's token rows
                b_vk = (b_vn * (b_rk[None, :] if TRANS else b_rk[:, None])).to(DT)
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


def loop_options(config: Config, tma: bool, gate: int) -> dict[str, Any]:
    """The chunk loop's constexprs for ``STATE_LOOP``: ``tl.range``'s ``num_stages`` and ``warp_specialize`` (None and
    False for ``"range"``: the kernel's own ``num_stages`` pipelines the loop). Triton 3.6 splits the loop into
    producer and consumer warps (sm_90a) only when every tile arrives by TMA (``tma``: ``STATE_TMA`` on a shape that
    allows it) in the ``"vk"`` layout at 4 warps with A_qk stored; its pass fails on the other loops (an MLIR error,
    not a slow kernel), so ``"specialized"`` runs as ``"range"`` there; so does KDA's loop with ``WU = "recomputed"``
    (its bfloat16 outputs came out inf on an H100, float32 right: a miscompile, not a slow kernel), and every loop
    asked for a pipeline other than 2 deep (``h_num_stages``): at 3 the outputs came out NaN or inf in all 20 gated
    trials of the H100 searches of 2026-12-07 (Gated DeltaNet and KDA, segmented or not), at 2 right in all 30;
    1 was never tried."""
    ws = config.get("STATE_LOOP", "range") == "specialized" and tma and specializable(config, gate)
    return {"LOOP_STAGES": int(config["h_num_stages"]) if ws else None, "LOOP_WS": ws}


def specializable(config: Config, gate: int) -> bool:
    """The state pass's loop shapes Triton 3.6 warp-specialises on sm_90a (see :func:`loop_options`), TMA aside;
    ``gate``: the call's gate code (2: KDA)."""
    vk = config["STATE_LAYOUT"] == "vk"
    kda_recomputed = gate == 2 and config.get("WU", "stored") == "recomputed"
    shape = vk and config["h_num_warps"] == 4 and int(config["h_num_stages"]) == 2
    return shape and config.get("AQK", "stored") == "stored" and not kda_recomputed


def descriptors(call: ChunkCall, inter: Intermediates, o: Any, BV: int) -> dict[str, Any]:
    """TMA descriptors of the state pass's tiles (2-D token-major views, one chunk of rows by one head's columns or
    ``BV`` of them): q, k (KDA: q~, k~), W and U (stored) or V and T (recomputed), A_qk (stored), and the output
    (where ``o`` is given: a pass without the output, ``FUSE_OUTPUT`` off or the backward's re-run, loads q and A_qk
    never). Empty unless ``call.tma``."""
    if not call.tma:
        return {}
    rows, H, HV, K, V, BT = call.tokens, call.H, call.HV, call.K, call.V, call.BT

    def desc(t: Any, width: int, block: int) -> TensorDescriptor:
        return TensorDescriptor(t.view(rows, width), [rows, width], [width, 1], [BT, block])

    if call.gate == 2:  # KDA: q~ and k~ per value head, from stage 1
        tds = {"q_td": desc(inter.qg, HV * K, K), "k_td": desc(inter.kg, HV * K, K)}
    else:
        tds = {"q_td": desc(call.q, H * K, K), "k_td": desc(call.k, H * K, K)}
    if o is not None:  # the output stage's pass (FUSE_OUTPUT) also reads q and A_qk and stores the output
        tds["o_td"] = desc(o, HV * V, BV)
    if call.recompute:
        tds |= {"v_td": desc(call.v, HV * V, BV), "t_td": desc(inter.ai, HV * BT, BT)}
        if call.gate == 2:  # KDA: P = β ⊙ K ⊙ e^γ in W's buffer
            tds["w_td"] = desc(inter.w, HV * K, K)
    else:
        tds |= {"w_td": desc(inter.w, HV * K, K), "u_td": desc(inter.u, HV * V, BV)}
    if o is not None and not call.recompute_qk:  # (A_qk only serves the output)
        tds["a_td"] = desc(inter.aqk, HV * BT, BT)
    return tds


def state_store_descriptors(call: ChunkCall, inter: Intermediates, BV: int) -> dict[str, Any]:
    """``STATES_TMA``: the descriptors the state pass stores each chunk's state and V_new through (``hs_td``:
    ``[K, BV]`` blocks of the ``[chunks·HV·K, V]`` view, one state's whole key range; ``vn_td``: ``[BT, BV]`` blocks of
    the ``[tokens, HV·V]`` view). Empty (pointer stores) without it, for a pass that stores no states, or where a tile
    would not be one state's key range and ``BV`` whole columns (``BK != K``, ``BV`` not dividing ``V``) or a buffer
    does not start 16-byte aligned."""
    h, vn = inter.h, inter.v_new
    if not call.config.get("STATES_TMA", False) or h is None or vn is None or not h.numel() or not vn.numel():
        return {}
    if call.BK != call.K or call.V % BV or h.data_ptr() % 16 or vn.data_ptr() % 16:
        return {}
    K, V = call.K, call.V
    width = call.HV * V
    return {
        "hs_td": TensorDescriptor(h.view(-1, V), [h.numel() // V, V], [V, 1], [K, BV]),
        "vn_td": TensorDescriptor(vn.view(-1, width), [vn.numel() // width, width], [width, 1], [call.BT, BV]),
    }


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
    burnin: SegmentTable | None = None,
) -> Any:
    tds = descriptors(call, inter, o, BV) if seg != 1 else {}
    stores = state_store_descriptors(call, inter, BV) if seg != 1 else {}
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
        v=call.v,
        beta=call.beta,
        ai=inter.ai,
        RECOMPUTE=call.recompute,
        QK_RECOMPUTE=call.recompute_qk,
        TMA=bool(tds),
        **tds,
        # (burn-in: its chunks' branch around the output keeps the loop from warp specialisation)
        **(
            loop_options(call.config, bool(tds), call.gate)
            if burnin is None
            else {"LOOP_STAGES": None, "LOOP_WS": False}
        ),
        STORE_STATES=fuse and inter.h is not None,
        GATE_PREFETCH=call.config.get("GATE_LOADS", "pipelined") == "prefetched",
        **call.in_kernel.chunk_args(),
        **inter.rnorm_args(),
        **stores,
        SEG_DECAY=seg == 1 and bool(call.config.get("SEG_DECAY", False)),
        BURNIN=burnin is not None,
        seg_seq=None if burnin is None else burnin.seq_index,
        seq_first=None if burnin is None else burnin.seq_first,
        **launch,
    )


def burns_in(config: Config) -> bool:
    """Whether the sequence-parallel pass starts its segments by burn-in (``SEG_START = "burnin"``: phase 3 alone, no
    transitions, no segment starts, no scratch) rather than from phases 1 and 2."""
    return config.get("SEG_START", "transitions") == "burnin"


def launch_state(call: ChunkCall, inter: Intermediates, out: Outputs, scratch: SegmentScratch | None) -> Any:
    """The state pass (with the output when ``FUSE_OUTPUT``): per sequence, or per segment from ``scratch.starts``, or
    per segment by burn-in (:func:`burns_in`: no scratch). ``STATE_LOOP = "gluon"``: the pass in Gluon
    (:mod:`.state_ws`) where it serves the call (the fused output, with or without the chunk states stored), else
    this one."""
    t = call.tables
    BV = call.h_BV
    if call.config.get("STATE_LOOP") == "gluon" and scratch is None and (inter.h is None) == (inter.v_new is None):
        from .state_ws import launch_state_ws, why_not  # (Gluon imported only where a config asks for it)

        if why_not(call) is None:
            return launch_state_ws(call, inter, out)
    if scratch is None and (t.segments is None or not burns_in(call.config)):
        grid = (triton.cdiv(call.V, BV), call.N * call.HV)
        return _launch(
            call, inter, grid, call.h0, out.final_state, out.o, t.seq_bounds, t.chunk_offsets, None, None, 0,
            call.fuse, call.output_final_state, BV, call.warps("h"),
        )  # fmt: skip
    seg = t.segments
    assert seg is not None
    grid = (triton.cdiv(call.V, BV), seg.NS * call.HV)
    if burns_in(call.config):  # each segment's start by burn-in, from the sequences' own initial states
        ht = out.final_state
        if ht is not None and seg.empty is not None:  # (phase 2 stores these otherwise): their initial state, or 0
            if call.h0 is not None:
                ht.index_copy_(0, seg.empty, call.h0.index_select(0, seg.empty).to(ht.dtype))
            else:
                ht.index_fill_(0, seg.empty, 0.0)
        return _launch(
            call, inter, grid, call.h0, ht, out.o, seg.bounds, seg.chunk_offsets, seg.last, None, 2,
            call.fuse, call.output_final_state, BV, call.warps("h"), seg,
        )  # fmt: skip
    assert scratch is not None
    return _launch(
        call, inter, grid, scratch.starts, out.final_state, out.o, seg.bounds, seg.chunk_offsets, seg.last, None, 2,
        call.fuse, call.output_final_state, BV, call.warps("h"),
    )  # fmt: skip


def transitions_tile(config: Config, K: int, V: int) -> tuple[int, dict[str, Any]]:
    """Phase 1's column tile of the extended state ``[K, V + K]`` and its launch options: ``tr_BV`` and
    ``tr_num_warps``, or the state pass's ``h_BV`` and ``h_num_warps`` where they are 0; ``h_num_stages``,
    ``h_maxnreg``. Clipped like ``h_BV`` (to the padded V): the N columns take ``⌈V / BV⌉`` tiles, the M columns
    ``⌈K / BV⌉``."""
    BV = tile(int(config["tr_BV"]) or int(config["h_BV"]), V)
    warps = int(config["tr_num_warps"]) or int(config["h_num_warps"])
    launch = {"num_warps": warps, "num_stages": int(config["h_num_stages"])}
    return BV, launch | register_cap(config, "h")


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
