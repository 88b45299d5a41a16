"""Triton helpers shared by the chunk stage kernels: chunk bounds, the gate's load, the KDA diagonal blocks."""

from __future__ import annotations

import triton
import triton.language as tl

from ..config import GATE_FLOOR as _GATE_FLOOR
from ..config import SEG_SKIP_LOG as _SEG_SKIP_LOG
from ..options import L2NORM_EPS, activated_beta, activated_gate

# Log gates are clamped at load to ``kernels.config.GATE_FLOOR`` (−inf is a full forget; the reasons are there).
GATE_FLOOR: tl.constexpr = tl.constexpr(_GATE_FLOOR)
SEG_SKIP_LOG: tl.constexpr = tl.constexpr(_SEG_SKIP_LOG)


@triton.jit
def chunk_bounds(chunk_info, i_c, T, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token, sequence end) of chunk ``i_c`` as int64: from the varlen chunk table, or of a [B, T] batch."""
    if VARLEN:
        bos = tl.load(chunk_info + 2 * i_c).to(tl.int64)
        eos = tl.load(chunk_info + 2 * i_c + 1).to(tl.int64)
    else:
        NT = tl.cdiv(T, BT)
        i_b = i_c // NT
        bos = i_b.to(tl.int64) * T + (i_c % NT) * BT
        eos = i_b.to(tl.int64) * T + T
    return bos, eos


@triton.jit
def load_gate(ptr, mask):
    """Log gates as float32, clamped below at ``GATE_FLOOR`` (−inf → −20; masked elements read 0; NaN stays NaN)."""
    return floor_gate(tl.load(ptr, mask=mask, other=0).to(tl.float32), GATE_FLOOR)


@triton.jit
def load_scalar_gate(ptr, mask, act, GACT: tl.constexpr):
    """:func:`load_gate` of Gated DeltaNet's per-head gate, activated from the raw one when ``GACT`` says so
    (``act``: :func:`..options.gate_act`); masked elements read 0 either way."""
    b_g = tl.load(ptr, mask=mask, other=0).to(tl.float32)
    if GACT % 4 != 0:
        b_g = tl.where(mask, activated_gate(b_g, act[0], act[1], act[2], GACT % 4), 0.0)
    return floor_gate(b_g, GATE_FLOOR)


@triton.jit
def load_channel_gate(ptr, mask, act, o_k, m_k, GACT: tl.constexpr):
    """:func:`load_gate` of a ``[rows, BK]`` tile of KDA's per-channel gate (key channels ``o_k``, valid ``m_k``),
    activated from the raw one when ``GACT`` says so (``act``: :func:`..options.gate_act`); masked elements read 0."""
    b_g = tl.load(ptr, mask=mask, other=0).to(tl.float32)
    if GACT % 4 != 0:
        b_bias = 0.0
        if (GACT // 4) % 2 == 1:
            b_bias = tl.load(act[1] + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
        b_g = tl.where(mask, activated_gate(b_g, act[0], b_bias, act[2], GACT % 4), 0.0)
    return floor_gate(b_g, GATE_FLOOR)


@triton.jit
def load_beta(ptr, mask, BETA_ACT: tl.constexpr):
    """beta as float32, activated (fla's use_beta_sigmoid_in_kernel) when ``BETA_ACT`` says so; masked rows read 0."""
    b_beta = tl.load(ptr, mask=mask, other=0).to(tl.float32)
    if BETA_ACT > 0:
        b_beta = tl.where(mask, activated_beta(b_beta, BETA_ACT), 0.0)
    return b_beta


@triton.jit
def row_rnorm(base, rows, stride, m_r, K: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr):
    """fla's l2norm factor ``1 / sqrt(Σ x² + eps)`` of rows ``rows`` of q or k (``base``: the chunk's first row,
    ``stride``: the row stride), over all ``K`` channels in ``NK`` tiles of ``BK`` (masked rows: a finite factor,
    applied to zeros)."""
    b_ss = tl.zeros(rows.shape, dtype=tl.float32)
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_x = tl.load(base + (rows[:, None] * stride + o_k[None, :]), mask=m_r[:, None] & (o_k < K)[None, :], other=0)
        b_x = b_x.to(tl.float32)
        b_ss += tl.sum(b_x * b_x, 1)
    return 1.0 / tl.sqrt(b_ss + L2NORM_EPS)


@triton.jit
def store_row_factors(rq, rk, row0, rows, m_r, b_rq, b_rk, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr):
    """Store the l2norm factors of q's and k's rows ``rows`` (from the chunk's first token ``row0``) into
    ``[tokens, H]`` buffers, once per key head (from the first value head of its group)."""
    if i_hv % (HV // H) == 0:
        off = (row0 + rows) * H + i_h
        tl.store(rq + off, b_rq, mask=m_r)
        tl.store(rk + off, b_rk, mask=m_r)


@triton.jit
def floor_gate(b_g, FLOOR: tl.constexpr):
    """``max(b_g, FLOOR)`` that keeps NaN: Triton's default ``maximum`` returns the other operand for a NaN one (maxnum),
    which would read a NaN gate as a full forget and return a finite wrong answer; NaN must reach the outputs."""
    return tl.maximum(b_g, FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def diag_exact(b_k, b_q, b_gam, BC: tl.constexpr):
    """KDA diagonal block, element-wise: column c is Σ_d k_i[d] k_c[d] exp(γ_i[d] − γ_c[d]) for A_kk and the same
    with q_i for A_qk, rows i >= c (rows i < c are masked by the caller: their exponent is set to 0, never
    overflowing). Exact for any gate, positive ones included; BC exp's per key channel per row."""
    o_c = tl.arange(0, BC)
    b_D = tl.zeros([BC, BC], dtype=tl.float32)
    b_Dq = tl.zeros([BC, BC], dtype=tl.float32)
    for c in range(BC):
        sel = (o_c == c)[:, None]
        b_kj = tl.sum(tl.where(sel, b_k, 0.0), 0)
        b_gj = tl.sum(tl.where(sel, b_gam, 0.0), 0)
        b_e = tl.exp(tl.where((o_c >= c)[:, None], b_gam - b_gj[None, :], 0.0)) * b_kj[None, :]
        b_D += tl.where((o_c == c)[None, :], tl.sum(b_k * b_e, 1)[:, None], 0.0)
        b_Dq += tl.where((o_c == c)[None, :], tl.sum(b_q * b_e, 1)[:, None], 0.0)
    return b_D, b_Dq


@triton.jit
def diag_ref(b_k, b_q, b_gam, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """KDA diagonal block as one dot around the middle row m: (k_i e^{γ_i − γ_m}) · (k_j e^{γ_m − γ_j}), float32
    operands. Finite (and exact to rounding) while |γ_i − γ_m| < ~88 for every row; overflows to inf/NaN beyond."""
    o_c = tl.arange(0, BC)
    b_gm = tl.sum(tl.where((o_c == BC // 2)[:, None], b_gam, 0.0), 0)
    b_kR = b_k * tl.exp(b_gm[None, :] - b_gam)
    b_eL = tl.exp(b_gam - b_gm[None, :])
    b_D = tl.dot(b_k * b_eL, tl.trans(b_kR), input_precision=DOT_PREC)
    b_Dq = tl.dot(b_q * b_eL, tl.trans(b_kR), input_precision=DOT_PREC)
    return b_D, b_Dq


@triton.jit
def scalar_chunk_operands(
    b_q, b_k, gout, row_hv, t0, eos, i_hv, o_t, m_t, scale, HV: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr, DT
):
    """DeltaNet / Gated DeltaNet, the chunk from token ``t0`` (its first row ``row_hv`` of ``[tokens, HV]``, the
    sequence ending at ``eos``): ``(q̃, k̃, γ, γ_C)`` with ``q̃ = scale · q · e^γ`` and ``k̃ = k · e^{γ_C − γ}`` in
    ``DT`` (``b_q``, ``b_k`` float32 ``[BT, K]``; ``gout``: the cumulative gate γ stage 1 stored, float32
    ``[tokens, HV]``); DeltaNet (``GATE = 0``): ``scale · q``, ``k``, γ = 0."""
    if GATE == 1:
        b_gam = tl.load(gout + row_hv + o_t * HV, mask=m_t, other=0)
        b_gC = tl.load(gout + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_kg = (b_k * tl.exp(b_gC - b_gam)[:, None]).to(DT)
        b_qg = (b_q * (scale * tl.exp(b_gam))[:, None]).to(DT)
    else:
        b_gam = tl.zeros([BT], dtype=tl.float32)
        b_gC = 0.0
        b_kg = b_k.to(DT)
        b_qg = (b_q * scale).to(DT)
    return b_qg, b_kg, b_gam, b_gC


@triton.jit
def scalar_causal_aqk(b_q, b_k, b_gam, o_t, m_t, scale, GATE: tl.constexpr, DT, DOT_PREC: tl.constexpr):
    """``scale · A_qk = scale · (q kᵀ ⊙ e^(γ_i − γ_j))``, causal (``j <= i``), in ``DT``, as stage 1 stores it (rows
    past the chunk's end, ``m_t``, zero; DeltaNet without the decay)."""
    m_qk = (o_t[None, :] <= o_t[:, None]) & m_t[:, None]
    b_A = tl.dot(b_q.to(DT), tl.trans(b_k.to(DT)), input_precision=DOT_PREC)
    if GATE == 1:
        b_A *= tl.exp(tl.where(m_qk, b_gam[:, None] - b_gam[None, :], float("-inf")))
        b_A = (b_A * scale).to(DT)
    else:
        b_A = tl.where(m_qk, b_A * scale, 0.0).to(DT)
    return b_A


@triton.jit
def _log_rho(
    k, beta, t0, rows, m_r, i_hv, i_h, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    NORMED: tl.constexpr, BETA_ACT: tl.constexpr,
):  # fmt: skip
    """``log max(1, |1 − β_t n_t|)`` of the token rows ``t0 + rows`` (value head ``i_hv``; masked rows ``m_r``: 0), the
    log 2-norm bound of each token's map ``I − β_t k_t k_tᵀ`` beside its gate: β from ``beta`` (``[tokens, HV]``,
    activated by ``BETA_ACT``) and ``n_t = ‖k_t‖²`` from ``k`` (``[tokens, H, K]``), or, ``NORMED`` (k l2-normalised in
    the kernel), ``n_t ≤ 1 + 2^-20`` without reading k. NaN stays NaN."""
    b_beta = load_beta(beta + (t0 * HV + i_hv) + rows * HV, m_r, BETA_ACT)
    if NORMED:
        b_n = tl.zeros_like(b_beta) + 1.00000095367431640625  # 1 + 2^-20
    else:
        o_k = tl.arange(0, BK)
        b_k = tl.load(
            k + (t0 * H + i_h) * K + (rows[:, None] * (H * K) + o_k[None, :]),
            mask=m_r[:, None] & (o_k < K)[None, :],
            other=0,
        ).to(tl.float32)
        b_n = tl.sum(b_k * b_k, 1)
    b_rho = tl.maximum(tl.abs(1.0 - b_beta * b_n), 1.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(m_r, tl.log(b_rho), 0.0)


@triton.jit
def transition_negligible(
    gout,
    k,
    beta,
    bos,
    eos,
    i_hv,
    i_h,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NORMED: tl.constexpr,
    BETA_ACT: tl.constexpr,
):
    """Gated DeltaNet: whether the transition of tokens ``bos .. eos − 1`` (whole chunks of ``BT`` from ``bos``, the
    last one partial) of value head ``i_hv`` is negligible (``kernels.config.SEG_SKIP_LOG``): the bound
    ``Σ_t γ_t + log max(1, |1 − β_t n_t|)`` of its log 2-norm, with γ from ``gout`` (stage 1's cumulative gate per
    chunk, float32 ``[tokens, HV]``: each chunk's last row is its sum) and the rest from :func:`_log_rho`. A NaN
    anywhere gives False (NaN compares false). Wide loads, few iterations (the chains it saves are latency-bound: a
    loop of one chunk per step would cost as much): the gate by ``RC`` chunks per load, β and k by ``RB`` tokens."""
    RC: tl.constexpr = 256
    RB: tl.constexpr = 128
    L = (eos - bos).to(tl.int32)
    NC = tl.cdiv(L, BT)
    o_c = tl.arange(0, RC)
    b_g = tl.zeros([RC], dtype=tl.float32)
    for c0 in range(0, NC, RC):
        c = c0 + o_c
        last = tl.minimum((c + 1) * BT, L) - 1  # the chunk's last row: the chunk's sum of γ
        b_g += tl.load(gout + (bos + last) * HV + i_hv, mask=c < NC, other=0)
    o_r = tl.arange(0, RB)
    b_r = tl.zeros([RB], dtype=tl.float32)
    for r0 in tl.range(0, L, RB, num_stages=2):
        rows = r0 + o_r
        b_r += _log_rho(k, beta, bos, rows, rows < L, i_hv, i_h, H, HV, K, BK, NORMED, BETA_ACT)
    return tl.sum(b_g, 0) + tl.sum(b_r, 0) < SEG_SKIP_LOG


@triton.jit
def _chunk_bound(
    gout, k, beta, t0, o_t, m_t, last, i_hv, i_h, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, NORMED: tl.constexpr, BETA_ACT: tl.constexpr,
):  # fmt: skip
    """One chunk's share of the decay bound (the burn-in scans'): its γ sum, stage 1's cumulative gate on its row
    ``last``, plus :func:`_log_rho` of its rows ``t0 + o_t`` (``m_t``: inside the sequence)."""
    b_g = tl.load(gout + (t0 * HV + i_hv) + o_t * HV, mask=m_t, other=0)
    b_r = _log_rho(k, beta, t0, o_t, m_t, i_hv, i_h, H, HV, K, BK, NORMED, BETA_ACT)
    return tl.sum(tl.where(o_t == last, b_g, 0.0) + b_r, 0)


@triton.jit
def burnin_start(
    gout,
    k,
    beta,
    seq0,
    s_bos,
    i_hv,
    i_h,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NORMED: tl.constexpr,
    BETA_ACT: tl.constexpr,
):
    """Gated DeltaNet, the burn-in of a segment starting at token ``s_bos`` (a chunk boundary) of a sequence starting at
    ``seq0``: going back whole chunks from ``s_bos``, the first chunk start ``c`` where the transition over
    ``[c, s_bos)`` is negligible (its bound, as :func:`transition_negligible`'s, below ``SEG_SKIP_LOG``: a walk from a
    zero state at ``c`` reaches ``s_bos`` with the true state to rounding), else ``seq0`` (the walk from the initial
    state: exact). A NaN in the bound stops the scan at its chunk, which the walk then starts with: the NaN reaches the
    segment's outputs, as in the plain pass. One chunk per step: a few under strong decays; under weak ones the walk
    is long anyway."""
    o_t = tl.arange(0, BT)
    c = s_bos
    acc = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
    go = c > seq0
    while go:
        t0 = c - BT  # a whole chunk of the sequence (segments start on chunk boundaries)
        acc += _chunk_bound(gout, k, beta, t0, o_t, o_t < BT, BT - 1, i_hv, i_h, H, HV, K, BK, NORMED, BETA_ACT)
        c = t0
        go = (c > seq0) & (acc >= SEG_SKIP_LOG)  # (NaN: stops at its chunk, whose walk then carries the NaN on)
    return c


@triton.jit
def burnin_end(
    gout,
    k,
    beta,
    seq_end,
    s_eos,
    i_hv,
    i_h,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    """The reverse pass's burn-in (Gated DeltaNet) of a segment ending at token ``s_eos`` (a chunk boundary) of a
    sequence ending at ``seq_end``: going forward by chunks from ``s_eos``, the first chunk end ``c`` where the adjoint's
    transition over ``[s_eos, c)`` is negligible (the bound of :func:`burnin_start`), else ``seq_end`` (the walk from
    the final state's gradient: exact). A NaN in the bound stops the scan at its chunk, which the walk then carries."""
    o_t = tl.arange(0, BT)
    c = s_eos
    acc = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
    go = c < seq_end
    while go:
        n_left = (seq_end - c).to(tl.int32)
        m_t = o_t < n_left  # (the sequence's last chunk may be partial)
        last = tl.minimum(n_left, BT) - 1
        acc += _chunk_bound(gout, k, beta, c, o_t, m_t, last, i_hv, i_h, H, HV, K, BK, False, 0)
        c = tl.minimum(c + BT, seq_end)
        go = (c < seq_end) & (acc >= SEG_SKIP_LOG)
    return c
