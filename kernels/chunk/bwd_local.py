"""The chunk-local gradient formulas of the backward's chunk-parallel stage (:mod:`.bwd_dqk`), kept apart from its
loads so that any pass holding a chunk's contractions can call them: from a chunk's contractions over V, the
gradients of q, k, beta and the gate.

Inputs, for the chunk's rows and ``BK`` key channels (float32): ``dq̃ = dO S_cᵀ``, ``dk̃ = V_new X_{c+1}ᵀ``,
``dKβ = −dVβ S_cᵀ`` (``[BT, BK]``), ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}`` (``[BK]``), and both dA (``[BT, BT]``, scale
folded into ``dA_qk``; KDA's by pointers to memory, read by blocks in :mod:`.bwd_pairwise`). With ``e^γ`` and
``e^{γ_C − γ}`` (factors ≤ 1):

* local terms: ``dq = scale e^γ dq̃``; ``dk_row = β e^γ dKβ``; ``dk_col = e^{γ_C − γ} dk̃``; ``dβ = Σ_d dKβ k e^γ``;
* pairwise terms: DeltaNet and Gated DeltaNet over the whole chunk, with the ``[BT, BT]`` decay
  ``D_ij = exp(γ_i − γ_j)`` formed masked (safe at every ``BT``): ``dq += (dA_qk ⊙ D) k``,
  ``dk_col += (dA_qk ⊙ D)ᵀ q + (β ⊙ dA_kk ⊙ D)ᵀ k``, ``R = (dA_kk ⊙ D) k``, ``dk_row += β R``, ``dβ += Σ_d k ⊙ R``;
  KDA's per-channel terms by blocks of ``BC`` rows (:mod:`.bwd_pairwise`);
* the gate: ``dγ = q ⊙ dq + k ⊙ (dk_row − dk_col)``, plus ``dγ_C = Σ_i k̃_i ⊙ dk̃_i + e^{γ_C} d(e^{γ_C})`` on the
  chunk's last row. KDA: ``dg_t = Σ_{i >= t} dγ_i`` (zero where the gate was below the floor: the clamp's gradient);
  Gated DeltaNet: ``dγ`` summed over these key channels (the caller sums over key tiles, then the reverse cumsum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bwd_pairwise import kda_pairwise
from .common import floor_gate


@triton.jit
def chunk_local_grads(
    b_dqt,
    b_dkt,
    b_dkb,
    b_dec,
    b_daq,
    b_dak,
    a_b,
    ak_b,
    b_beta,
    q_b,
    k_b,
    g_b,
    be_b,
    k0,
    o_t,
    o_k,
    m_t,
    m_k,
    L,
    scale,
    r0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    SA: tl.constexpr,
    GATE: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FLOOR: tl.constexpr,
    b_g1=None,
    DA_DECAYED: tl.constexpr = False,
):
    """``(dq, dk, dβ, dg)`` of one chunk and key tile (see the module): ``dq``, ``dk`` ``[BT, BK]`` float32, ``dβ``
    ``[BT]`` (the k side; the caller adds ``Σ_v dVβ ⊙ v``), ``dg``: KDA ``[BT, BK]`` (final), Gated DeltaNet
    ``[BT]`` (``dγ`` of these key channels), DeltaNet ``dβ`` again (unused).

    ``b_daq``/``b_dak``: both dA in registers, ``DT`` (DeltaNet, Gated DeltaNet); KDA reads them from ``a_b``/``ak_b``
    (the chunk's first row, row stride ``SA``). ``q_b``, ``k_b``: the chunk's first row of q and k (``[tokens, H, K]``,
    at this head), ``g_b``: of the gate (``[tokens, HV]`` or ``[tokens, HV, K]``, at this value head), ``be_b``: of
    beta; the tile's key channels are ``k0 + o_k`` (``m_k`` their mask), its rows ``o_t < L`` (``m_t``). ``r0``: zero
    (KDA's pairwise terms add it to their load rows: :func:`.bwd_pairwise.kda_pairwise`).

    ``DA_DECAYED`` (Gated DeltaNet, ``dqk_DECAY = "value"``): ``b_daq``, ``b_dak`` come with the decay ``D`` already applied (by
    the value side, in float32 before their rounding), so the pairwise terms use them as they are: the same formulas,
    no float32 round trip of both dA here, another register allocation."""
    m_tk = m_t[:, None] & m_k[None, :]
    off_q = o_t[:, None] * (H * K) + (k0 + o_k)[None, :]  # [BT, BK] of [tokens, H, K] from the chunk's first row
    off_g = o_t[:, None] * (HV * K) + (k0 + o_k)[None, :]  # ... of [tokens, HV, K]
    # ---- the gate's factors (both <= 1) ----------------------------------------------------------------------
    if GATE == 2:
        b_gam = tl.cumsum(floor_gate(tl.load(g_b + off_g, mask=m_tk, other=0).to(tl.float32), FLOOR), 0)
        b_gC = tl.sum(tl.where((o_t == L - 1)[:, None], b_gam, 0.0), 0)  # γ at the last valid row
        b_e = tl.exp(b_gam)
        b_ekc = tl.exp(b_gC[None, :] - b_gam)
    elif GATE == 1:
        if b_g1 is None:
            b_graw = tl.load(g_b + o_t * HV, mask=m_t, other=0).to(tl.float32)
        else:  # loaded by the caller before its V contractions (off the epilogue's critical path)
            b_graw = b_g1
        b_gam1 = tl.cumsum(floor_gate(b_graw, FLOOR), 0)
        b_gC1 = tl.sum(tl.where(m_t, floor_gate(b_graw, FLOOR), 0.0), 0)
        b_e = tl.exp(b_gam1)[:, None]
        b_ekc = tl.exp(b_gC1 - b_gam1)[:, None]
    else:
        b_e = tl.full([BT, 1], 1.0, dtype=tl.float32)
        b_ekc = b_e
    b_k = tl.load(k_b + off_q, mask=m_tk, other=0).to(tl.float32)

    # ---- local terms (the V contractions' accumulators die here) --------------------------------------------------
    b_dq = scale * b_e * b_dqt
    b_dkrow = b_beta[:, None] * b_e * b_dkb
    b_dkcol = b_ekc * b_dkt
    b_db = tl.sum(b_dkb * (b_k * b_e), 1)
    if GATE == 1:  # Gated DeltaNet needs its total only: row sums first, each thread's own rows (no [BT, BK] layout
        # conversion through shared memory; H100, B8 T4096: step -0.7%)
        b_dgc = tl.sum(b_k * b_dkcol, 1)
    else:
        b_dgc = tl.sum(b_k * b_dkcol, 0)  # Σ_i k̃_i ⊙ dk̃_i  [BK] (the gate's last-row term)

    # ---- pairwise terms -----------------------------------------------------------------------------------------
    if GATE == 2:  # KDA's per-channel pairwise terms, by blocks of BC rows, accumulated in place
        b_dq, b_dkrow, b_dkcol, b_db = kda_pairwise(
            b_dq, b_dkrow, b_dkcol, b_db, b_k, b_beta, b_gam, a_b, ak_b,
            q_b, k_b, be_b, k0 + o_k, m_k, L, r0,
            SA, H * K, HV, BT, BC, DT, DOT_PREC,
        )  # fmt: skip
    b_q = tl.load(q_b + off_q, mask=m_tk, other=0).to(tl.float32)  # (loaded late: not live through KDA's terms)
    if GATE != 2:  # DeltaNet, Gated DeltaNet: over the whole chunk with the masked [BT, BT] decay (safe at every BT)
        if GATE == 1 and not DA_DECAYED:
            b_D = tl.exp(tl.where(o_t[None, :] <= o_t[:, None], b_gam1[:, None] - b_gam1[None, :], float("-inf")))
            b_daq = (b_daq.to(tl.float32) * b_D).to(DT)
            b_dak = (b_dak.to(tl.float32) * b_D).to(DT)
        b_qc = b_q.to(DT)
        b_kc = b_k.to(DT)
        b_dq += tl.dot(b_daq, b_kc, input_precision=DOT_PREC)
        if GATE == 0:  # both transposed products into one accumulator, added once: one [BT, BK] float32 layout
            # conversion instead of two (H100, B8 T4096: DeltaNet's step -1%; Gated DeltaNet's +0.3%, its second
            # accumulator spills: 20 -> 164 bytes at sm_90a). Both branches spell the β-scaled dA_kk operand in place:
            # hoisted into one variable it compiles to another register allocation, not the code timed above
            b_tr = tl.dot(tl.trans(b_daq), b_qc, input_precision=DOT_PREC)
            b_tr = tl.dot(
                tl.trans((b_dak.to(tl.float32) * b_beta[:, None]).to(DT)), b_kc, b_tr, input_precision=DOT_PREC
            )
            b_dkcol += b_tr
        else:
            b_dkcol += tl.dot(tl.trans(b_daq), b_qc, input_precision=DOT_PREC)
            b_dkcol += tl.dot(tl.trans((b_dak.to(tl.float32) * b_beta[:, None]).to(DT)), b_kc, input_precision=DOT_PREC)
        b_R = tl.dot(b_dak, b_kc, input_precision=DOT_PREC)
        b_dkrow += b_beta[:, None] * b_R
        b_db += tl.sum(b_k * b_R, 1)

    # ---- the gate -------------------------------------------------------------------------------------------------
    b_dg = b_db
    if GATE != 0:
        b_dgam = b_q * b_dq + b_k * (b_dkrow - b_dkcol)
        last = (o_t == L - 1)[:, None]
        if GATE == 2:
            b_dgc += tl.exp(b_gC) * b_dec
            b_dgam += tl.where(last, b_dgc[None, :], 0.0)
            b_dg = tl.cumsum(b_dgam, 0, reverse=True)
            b_graw = tl.load(g_b + off_g, mask=m_tk, other=0).to(tl.float32)
            b_dg = tl.where(b_graw < FLOOR, 0.0, b_dg)
        else:
            b_dgc1 = tl.sum(b_dgc, 0) + tl.exp(b_gC1) * tl.sum(b_dec, 0)
            b_dg = tl.sum(b_dgam, 1) + tl.where(o_t == L - 1, b_dgc1, 0.0)
    return b_dq, b_dkrow + b_dkcol, b_db, b_dg
