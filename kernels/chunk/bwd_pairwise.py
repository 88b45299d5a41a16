"""KDA's per-channel pairwise terms over a whole chunk, inside the dq/dk stage (:mod:`.bwd_dqk`).

With ``dA_qk`` (causal, scale folded in) and ``dA_kk`` (strictly lower) ``[BT, BT]`` of the chunk in memory and
``D_ij = exp(γ_i − γ_j)`` per key channel (``γ`` non-increasing down the rows):

* row side: ``dq_i += Σ_{j <= i} dA_qk[i,j] k_j D_ij``, ``R_i = Σ_{j < i} dA_kk[i,j] k_j D_ij``, ``dk_row += β R``,
  ``dβ += Σ_d k ⊙ R``;
* column side: ``dk_col_j += Σ_{i >= j} dA_qk[i,j] q_i D_ij + Σ_{i > j} dA_kk[i,j] β_i k_i D_ij``.

The chunk is cut into ``BT / BC`` blocks of ``BC`` rows; for each block ``J`` its columns of dA (``[BT, BC]``) and its
rows (``[BC, BT]``) are read from memory (L1/L2: written by the dv stage, or by this program just before), so every
product is a ``[BT, BC] × [BC, BK]`` dot whose result is a whole ``[BT, BK]`` tile of the accumulators (no slicing of
register tiles). NUMERICS (for decays no factor exceeds 1 off the diagonal; every factor is the exact ``e^{γ_i − γ_j}``
of the pairs it multiplies, so a positive gate is computed as the recurrence says while its factors stay finite):

* row side, rows after ``J`` against columns in ``J``: reference ``r = γ`` at ``J``'s last row,
  ``e^{γ_i − r} · (dA[:, J] (k_J e^{r − γ_J}))``; column side, columns before ``J`` against rows in ``J``: reference
  ``s = γ`` just before ``J``, ``e^{s − γ_j} · (dA[J, :]ᵀ (x_J e^{γ_J − s}))``. A factor that underflows bounds a term
  smaller still (below ``exp(−87)`` relative).
* the diagonal block ``(J, J)``: the same two dots around ``J``'s middle row ``m`` (factors ``e^{±(γ − γ_m)}``, in
  float32), exact while the block's half span stays below 80 nats; otherwise an element-wise loop over the block's
  columns, ``Σ_{j <= i} dA[i,j] k_j exp(γ_i − γ_j)`` (exact for any gate; only the flagged blocks pay it).
* ``γ`` comes in as the chunk's tile (gates clamped by the caller); each block's rows are moved out of it, not
  recomputed, so that the diagonal's factors cancel exactly at ``i = j``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gamma_row(b_gam, o_t, r):
    """γ of row ``r`` (``[BK]``) from the chunk's ``[BT, BK]`` γ."""
    return tl.sum(tl.where((o_t == r)[:, None], b_gam, 0.0), 0)


@triton.jit
def _block(x, J: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr):
    """Rows ``[J·BC, (J + 1)·BC)`` of the ``[NB·BC, N]`` tile ``x`` (``NB`` in {1, 2, 4}): the same values, moved (so
    that the block's γ agrees bitwise with the chunk's: the diagonal's factors ``e^{γ_i − γ_m} e^{γ_m − γ_j}`` must
    cancel exactly at ``i = j``)."""
    if NB == 1:
        out = x
    elif NB == 2:
        lo, hi = tl.split(tl.permute(tl.reshape(x, [2, BC, x.shape[1]]), (1, 2, 0)))
        if J == 0:
            out = lo
        else:
            out = hi
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(x, [2, 2, BC, x.shape[1]]), (2, 3, 1, 0)))  # split off J // 2
        if J // 2 == 0:
            half = lo
        else:
            half = hi
        lo2, hi2 = tl.split(half)  # then J % 2
        if J % 2 == 0:
            out = lo2
        else:
            out = hi2
    return out


@triton.jit
def kda_pairwise(
    b_dq,
    b_dkr,
    b_dkc,
    b_db,
    b_k,
    b_beta,
    b_gam,
    a_q,
    a_k,
    q_b,
    k_b,
    be_b,
    o_k,
    m_k,
    L,
    r0,
    SA: tl.constexpr,
    SK: tl.constexpr,
    SB: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Add the chunk's pairwise terms (see the module) to ``dq``, ``dk_row``, ``dk_col`` (``[BT, BK]`` float32) and
    ``dβ`` (``[BT]``); returns the four.

    ``b_k``, ``b_gam``: the chunk's ``[BT, BK]`` float32 tiles (zero rows past its end ``L``); ``b_beta``:
    ``[BT]``. ``a_q``, ``a_k``: dA_qk, dA_kk at the chunk's first row (row stride ``SA``, ``BT`` columns, ``DT``);
    ``q_b``, ``k_b`` (row stride ``SK``), ``be_b`` (row stride ``SB``): the chunk's first
    row of q, k and beta; ``o_k``/``m_k``: this program's key channels. ``r0``: zero, added to the row indices; inside
    a loop over key tiles (``dqk_KLOOP``) a zero the compiler cannot prove loop-invariant, so that the blocks' address
    and mask tensors (``[BT, BC]`` and ``[BT, BK]``, several per block) are formed where they are used, not hoisted out
    of the loop and kept live over it (sm_90a, BT = 64, BC = 16, dqk_BK = 16: 292 bytes of spills)."""
    NB: tl.constexpr = BT // BC
    o_t = r0 + tl.arange(0, BT)
    o_c = r0 + tl.arange(0, BC)
    blk = o_t // BC
    m_t = o_t < L
    for J in tl.static_range(NB):
        rj = J * BC + o_c  # the block's rows
        m_j = rj < L
        m_jk = m_j[:, None] & m_k[None, :]
        in_j = (blk == J)[:, None]
        # γ, k, q, β of the block's rows; γ before the block (s), at its middle row (m) and at its last row (r)
        if J > 0:
            b_s = _gamma_row(b_gam, o_t, J * BC - 1)
        else:
            b_s = tl.zeros([b_gam.shape[1]], dtype=tl.float32)
        b_gj = _block(b_gam, J, NB, BC)
        b_m = _gamma_row(b_gam, o_t, J * BC + BC // 2)
        b_r = _gamma_row(b_gam, o_t, J * BC + BC - 1)
        b_kj = tl.load(k_b + rj[:, None] * SK + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
        b_qj = tl.load(q_b + rj[:, None] * SK + o_k[None, :], mask=m_jk, other=0).to(tl.float32)
        b_bj = tl.load(be_b + rj * SB, mask=m_j, other=0).to(tl.float32)
        # dA's columns of the block [BT, BC] and its rows [BC, BT]
        m_col = m_t[:, None] & m_j[None, :]
        m_row = m_j[:, None] & m_t[None, :]
        b_aqc = tl.load(a_q + o_t[:, None] * SA + rj[None, :], mask=m_col, other=0)
        b_akc = tl.load(a_k + o_t[:, None] * SA + rj[None, :], mask=m_col, other=0)
        b_aqr = tl.load(a_q + rj[:, None] * SA + o_t[None, :], mask=m_row, other=0)
        b_akr = tl.load(a_k + rj[:, None] * SA + o_t[None, :], mask=m_row, other=0)

        # ---- off the diagonal --------------------------------------------------------------------------------------
        if J < NB - 1:  # row side: rows after the block, reference r
            b_kin = (b_kj * tl.exp(b_r[None, :] - b_gj)).to(DT)
            b_out = tl.exp(tl.where((blk > J)[:, None], b_gam - b_r[None, :], float("-inf")))
            b_dq += b_out * tl.dot(b_aqc.to(DT), b_kin, input_precision=DOT_PREC)
            b_R = b_out * tl.dot(b_akc.to(DT), b_kin, input_precision=DOT_PREC)
            b_dkr += b_beta[:, None] * b_R
            b_db += tl.sum(b_k * b_R, 1)
        if J > 0:  # column side: columns before the block, reference s
            b_ein = tl.exp(b_gj - b_s[None, :])
            b_c = tl.dot(tl.trans(b_aqr.to(DT)), (b_qj * b_ein).to(DT), input_precision=DOT_PREC)
            b_c += tl.dot(tl.trans(b_akr.to(DT)), (b_kj * b_bj[:, None] * b_ein).to(DT), input_precision=DOT_PREC)
            b_dkc += tl.exp(tl.where((blk < J)[:, None], b_s[None, :] - b_gam, float("-inf"))) * b_c

        # ---- the diagonal block ------------------------------------------------------------------------------------
        b_half = tl.max(tl.max(tl.where(m_jk, tl.abs(b_gj - b_m[None, :]), 0.0), 1), 0)
        b_aqd = tl.where(in_j, b_aqc.to(tl.float32), 0.0)  # rows of the block (the columns are the block's)
        b_akd = tl.where(in_j, b_akc.to(tl.float32), 0.0)
        if b_half <= 80.0:  # one dot per side around the middle row, in float32 (factors up to e^80)
            b_fo = tl.where(in_j, tl.exp(tl.where(in_j, b_gam - b_m[None, :], 0.0)), 0.0)  # e^{γ_i − γ_m}
            b_kmid = b_kj * tl.exp(b_m[None, :] - b_gj)  # e^{γ_m − γ_j}
            b_dq += b_fo * tl.dot(b_aqd, b_kmid, input_precision=DOT_PREC)
            b_R = b_fo * tl.dot(b_akd, b_kmid, input_precision=DOT_PREC)
            b_dkr += b_beta[:, None] * b_R
            b_db += tl.sum(b_k * b_R, 1)
            b_ein = tl.exp(b_gj - b_m[None, :])  # e^{γ_i − γ_m}, rows of the block
            col_j = (blk == J)[None, :]
            b_c = tl.dot(tl.trans(tl.where(col_j, b_aqr.to(tl.float32), 0.0)), b_qj * b_ein, input_precision=DOT_PREC)
            b_c += tl.dot(
                tl.trans(tl.where(col_j, b_akr.to(tl.float32), 0.0)),
                b_kj * b_bj[:, None] * b_ein,
                input_precision=DOT_PREC,
            )
            b_dkc += tl.where(in_j, tl.exp(tl.where(in_j, b_m[None, :] - b_gam, 0.0)), 0.0) * b_c
        else:  # element-wise over the block's columns: exact for any gate
            b_xq = b_qj  # the column side's rows (the block's)
            b_xk = b_kj * b_bj[:, None]
            for c in range(BC):
                j = J * BC + c
                b_gc = _gamma_row(b_gam, o_t, j)  # γ_j [BK]
                b_kc = tl.sum(tl.where((o_c == c)[:, None], b_kj, 0.0), 0)  # k_j [BK]
                # row side: column j of the block's dA against k_j, rows i >= j of the block
                b_e = tl.exp(tl.where((o_t >= j)[:, None], b_gam - b_gc[None, :], 0.0))  # e^{γ_i − γ_j}, i >= j
                b_aqj = tl.sum(tl.where((o_c == c)[None, :], b_aqd, 0.0), 1)
                b_akj = tl.sum(tl.where((o_c == c)[None, :], b_akd, 0.0), 1)
                b_dq += b_aqj[:, None] * b_e * b_kc[None, :]
                b_R = b_akj[:, None] * b_e * b_kc[None, :]
                b_dkr += b_beta[:, None] * b_R
                b_db += tl.sum(b_k * b_R, 1)
                # column side: row j of the output from the block's rows i >= j
                b_ej = tl.exp(tl.where((rj >= j)[:, None], b_gj - b_gc[None, :], 0.0))  # [BC, BK], i >= j
                b_rq = tl.sum(tl.where((o_t == j)[None, :], b_aqr.to(tl.float32), 0.0), 1)  # dA_qk[i, j], i in J
                b_rk = tl.sum(tl.where((o_t == j)[None, :], b_akr.to(tl.float32), 0.0), 1)
                b_cj = tl.sum((b_rq[:, None] * b_xq + b_rk[:, None] * b_xk) * b_ej, 0)
                b_dkc += tl.where((o_t == j)[:, None], b_cj[None, :], 0.0)
    return b_dq, b_dkr, b_dkc, b_db
