"""The chunk-parallel backward's work done inside the reverse state pass (``REVERSE_DQK``; DeltaNet, Gated DeltaNet):
per chunk, with the adjoint ``X_{c+1}`` still in registers, everything :mod:`.bwd_dqk` and :mod:`.bwd_finish` do for
that chunk, so that neither the adjoints nor ``dVβ`` go through memory and no chunk-parallel stage runs after the pass.

The reverse pass's program holds the whole state (all ``K`` key and ``V`` value channels of one sequence or segment
and value head). Per chunk, from ``dO``, ``dVβ = Tᵀ dV_new`` (computed by the pass, ``REVERSE_DV``), the chunk-start
state ``S_c`` and ``V_new`` (the forward's, kept or re-run) and ``X_{c+1}``:

* the contractions over V: ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``, ``dKβ = −dVβ S_cᵀ``,
  ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``, ``dA_qk = scale · causal(dO V_newᵀ)``, ``dA_kk = strictly_lower(−dVβ V_newᵀ)``;
* the chunk-local terms (the formulas of :func:`.bwd_local.chunk_local_grads`, written out in an order that consumes
  each ``[BT, K]`` accumulator before the next is formed: ``dq`` first, then ``dk``'s row part with ``dβ``, then its
  column part with the gate's terms);
* the per-row results: ``dq``, ``dk`` (per value head), ``dβ`` (its ``v`` part from the pass), Gated DeltaNet's
  ``dg_t = Σ_{i >= t} dγ_i`` inside the chunk (zero where the gate was below the floor).

Operand dtypes as in the stages it replaces: ``S_c``, ``V_new`` and ``dVβ`` in the intermediates' dtype, ``X_{c+1}``
rounded to it (the stage reads the stored adjoint), so the results are those of the staged backward to rounding.
With ``TRANS`` (the pass's ``"vk"`` layout) the pass's tiles are transposed: ``[V, BT]`` token tiles and ``[V, K]``
state tiles; the products are formed from their transposes.

Registers (sm_90a, Triton 3.6, 8 warps, ``"vk"``): the whole fp32 adjoint, its rounded copy, ``S_c`` and three
``[BT, K]`` accumulators exceed the register file at K = V = 128: 255 registers with 0.9 (DeltaNet) to 3 KB (Gated
DeltaNet) of spills per thread at ``BT = 64``, 0.6-1 KB at 32; at K = V = 64 and ``BT = 64`` 0.35-0.55 KB (the
pass alone: none). 16 warps spill more; block pointers for q, k, dq, dk and the states and ``V_new`` by TMA did not
reduce them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import floor_gate


@triton.jit
def reverse_chunk_grads(
    b_do,
    b_dvb,
    b_dbv,
    b_xc,
    b_h,
    b_vn,
    b_beta,
    q,
    k,
    g,
    beta,
    dq,
    dk,
    dg,
    dbeta,
    row_hv,
    row_h,
    o_t,
    m_t,
    L,
    scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    TRANS: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """One chunk's gradients (see the module). ``b_do``, ``b_dvb`` (``DT``): the chunk's ``dO`` and ``dVβ``
    (``[BT, V]``, or ``[V, BT]`` with ``TRANS``); ``b_dbv``: dβ's ``v`` part ``[BT]``; ``b_xc``: ``X_{c+1}`` in ``DT``
    (``[K, V]`` or ``[V, K]``); ``h_off``: the chunk's state in ``hbuf`` (``off_h``/``m_h`` the pass's state tile);
    ``off_v``/``m_tv``: the pass's token tile of ``[tokens, HV, V]`` rows from ``row_hv``; ``row_h``: the chunk's
    first row of ``[tokens, H, K]``; ``L``: its valid rows."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    off_q = row_h * K + o_t[:, None] * (H * K) + o_k[None, :]
    off_hk = row_hv * K + o_t[:, None] * (HV * K) + o_k[None, :]
    # ---- the gate's factors (both <= 1) and the [BT, BT] decay, masked (as bwd_local) ----------------------------
    if GATE == 1:
        b_graw = tl.load(g + row_hv + o_t * HV, mask=m_t, other=0).to(tl.float32)
        b_gam = tl.cumsum(floor_gate(b_graw, FLOOR), 0)
        b_gC = tl.sum(tl.where(m_t, floor_gate(b_graw, FLOOR), 0.0), 0)
        b_e = tl.exp(b_gam)[:, None]
        b_ekc = tl.exp(b_gC - b_gam)[:, None]
        b_D = tl.exp(tl.where(o_t[None, :] <= o_t[:, None], b_gam[:, None] - b_gam[None, :], float("-inf")))
    else:
        b_e = tl.full([BT, 1], 1.0, dtype=tl.float32)
        b_ekc = b_e
        b_D = tl.full([BT, BT], 1.0, dtype=tl.float32)
    # ---- both dA (V contractions), masked, scale folded into dA_qk, rounded to the intermediates' dtype, then
    # times the decay (as the chunk-parallel stage keeps and uses them) ---------------------------------------------
    b_vn = b_vn.to(DT)
    if TRANS:  # [V, BT] token tiles, [V, K] state tiles
        b_daq = tl.dot(tl.trans(b_do), b_vn, input_precision=DOT_PREC)
        b_dak = -tl.dot(tl.trans(b_dvb), b_vn, input_precision=DOT_PREC)
    else:
        b_daq = tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dak = -tl.dot(b_dvb, tl.trans(b_vn), input_precision=DOT_PREC)
    b_daq = (tl.where(m_t[:, None] & (o_t[None, :] <= o_t[:, None]), b_daq, 0.0) * scale).to(DT)
    b_dak = tl.where(m_t[:, None] & (o_t[None, :] < o_t[:, None]), b_dak, 0.0).to(DT)
    if GATE == 1:
        b_daq = (b_daq.to(tl.float32) * b_D).to(DT)
        b_dak = (b_dak.to(tl.float32) * b_D).to(DT)
    b_k = tl.load(k + off_q, mask=m_tk, other=0).to(DT)
    b_q = tl.load(q + off_q, mask=m_tk, other=0).to(DT)
    # ---- dq = scale e^γ dO S_cᵀ + (dA_qk ⊙ D) k; then dk's row part β (e^γ dKβ + R), R = (dA_kk ⊙ D) k, with
    # dβ = Σ_d k ⊙ (e^γ dKβ + R): each accumulator consumed before the next is formed ----------------------------
    b_h = b_h.to(DT)
    if TRANS:
        b_dq = tl.dot(tl.trans(b_do), b_h, input_precision=DOT_PREC)
    else:
        b_dq = tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
    b_dq = scale * b_e * b_dq + tl.dot(b_daq, b_k, input_precision=DOT_PREC)
    tl.store(dq + off_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    b_dgam = tl.sum(b_q.to(tl.float32) * b_dq, 1)
    if TRANS:
        b_row = -tl.dot(tl.trans(b_dvb), b_h, input_precision=DOT_PREC)
        b_dec = tl.sum(b_h.to(tl.float32) * b_xc.to(tl.float32), 0)
    else:
        b_row = -tl.dot(b_dvb, tl.trans(b_h), input_precision=DOT_PREC)
        b_dec = tl.sum(b_h.to(tl.float32) * b_xc.to(tl.float32), 1)
    b_row = b_e * b_row + tl.dot(b_dak, b_k, input_precision=DOT_PREC)
    b_db = tl.sum(b_k.to(tl.float32) * b_row, 1) + b_dbv
    b_row *= b_beta[:, None]  # dk's row part
    # ---- dk's column part e^{γ_C − γ} V_new X_{c+1}ᵀ + (dA_qk ⊙ D)ᵀ q + (β ⊙ dA_kk ⊙ D)ᵀ k; the gate ------------
    if TRANS:
        b_col = b_ekc * tl.dot(tl.trans(b_vn), b_xc, input_precision=DOT_PREC)
    else:
        b_col = b_ekc * tl.dot(b_vn, tl.trans(b_xc), input_precision=DOT_PREC)
    b_dgc = tl.sum(b_k.to(tl.float32) * b_col, 0)  # Σ_i k̃_i ⊙ dk̃_i [BK] (the gate's last-row term)
    b_col += tl.dot(tl.trans(b_daq), b_q, input_precision=DOT_PREC)
    b_col += tl.dot(tl.trans((b_dak.to(tl.float32) * b_beta[:, None]).to(DT)), b_k, input_precision=DOT_PREC)
    b_dgam += tl.sum(b_k.to(tl.float32) * (b_row - b_col), 1)
    tl.store(dk + off_hk, (b_row + b_col).to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + row_hv + o_t * HV, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if GATE == 1:  # dγ of every key channel and the last row's terms; the reverse cumsum inside the chunk, the clamp's
        b_dgc1 = tl.sum(b_dgc, 0) + tl.exp(b_gC) * tl.sum(b_dec, 0)
        b_dg = b_dgam + tl.where(o_t == L - 1, b_dgc1, 0.0)
        b_dgt = tl.cumsum(b_dg, 0, reverse=True)
        tl.store(dg + row_hv + o_t * HV, tl.where(b_graw < FLOOR, 0.0, b_dgt).to(dg.dtype.element_ty), mask=m_t)
