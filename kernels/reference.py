"""References for the delta-rule family: the ground truth every kernel and every tuned config is checked against.

Two implementations of docs/DESIGN.md §1, in plain PyTorch:

* :func:`naive_recurrent` — the token-by-token loop, in float64, written exactly as the contract reads
  (decay -> predict -> correct -> write -> read). Slow; the ground truth.
* :func:`chunk_reference` — the chunkwise (WY/UT) form, vectorised over chunks and heads, with only the
  inter-chunk state pass sequential. Fast enough to be the correctness gate's reference at real sizes on a
  GPU; checked against the loop in tests.

Layout (flash-linear-attention's): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; beta ``[B, T, HV]``; gate ``g`` in
log space, ``None`` (DeltaNet), ``[B, T, HV]`` (Gated DeltaNet) or ``[B, T, HV, K]`` (KDA); state
``[N, HV, K, V]``. Value head ``hv`` reads query/key head ``hv // (HV // H)``. With ``cu_seqlens`` (``B == 1``)
the N sequences are packed along T and each starts from its own initial state.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def _expand_heads(x: Tensor, hv: int) -> Tensor:
    """[B, T, H, ...] -> [B, T, HV, ...]: value head hv reads head hv // (HV // H)."""
    h = x.shape[2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=2)


def _sequences(t: int, cu_seqlens: Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, t)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def naive_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token float64 loop of docs/DESIGN.md §1. Returns (o in float64 [B,T,HV,V], final state float64 or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    q, k = _expand_heads(q.to(f64), HV), _expand_heads(k.to(f64), HV)
    v, beta = v.to(f64), beta.to(f64)
    g = None if g is None else g.to(f64)
    o = torch.zeros(B, T, HV, V, dtype=f64, device=q.device)
    seqs = _sequences(T, cu_seqlens)
    finals = []
    for n, (bos, eos) in enumerate(seqs):
        # Without cu_seqlens the B rows are the sequences; with it, B == 1 and row 0 holds all N.
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        if initial_state is None:
            S = torch.zeros(B if cu_seqlens is None else 1, HV, K, V, dtype=f64, device=q.device)
        else:
            S = initial_state.to(f64).clone() if cu_seqlens is None else initial_state[n : n + 1].to(f64).clone()
        for t in range(bos, eos):
            q_t, k_t, v_t, b_t = q[rows, t], k[rows, t], v[rows, t], beta[rows, t]
            if g is not None:  # decay: scalar per head, or per key channel (rows of S)
                decay = g[rows, t].exp()
                S = S * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
            pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # predict
            u = b_t[..., None] * (v_t - pred)  # correct
            S = S + k_t[..., :, None] * u[..., None, :]  # write (rank 1)
            o[rows, t] = torch.einsum("bhk,bhkv->bhv", q_t * scale, S)  # read after the write
        finals.append(S)
    final = torch.cat(finals, 0) if output_final_state else None
    return o, final


def chunk_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 32,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise form of the same math, vectorised over chunks and heads.

    Computes in ``dtype`` (float64 by default). In float64 the factorisation ``exp(γ_i) · exp(-γ_j)`` of the
    intra-chunk decay is exact enough and cannot overflow while ``chunk_size · max|g| < 700`` (chunk 32 with
    per-step log decay down to -20), so the intra-chunk products are plain batched matmuls.
    Returns (o in ``dtype`` [B,T,HV,V], final state in ``dtype`` [N,HV,K,V] or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    o = torch.empty(B, T, HV, V, dtype=dtype, device=q.device)
    finals = []
    for n, (bos, eos) in enumerate(_sequences(T, cu_seqlens)):
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        if initial_state is None:
            h0 = None
        else:
            h0 = initial_state if cu_seqlens is None else initial_state[n : n + 1]
        S: Tensor | None = h0
        # Windows of whole chunks, the state carried from one to the next: the exact chunk form, its float64
        # intermediates bounded by WORKING_SET_BYTES whatever the sequence's length.
        rows_n = B if cu_seqlens is None else 1
        step = window_tokens(rows_n, HV, K, V, chunk_size, dtype)
        for start in range(bos, max(eos, bos + 1), step):
            seg = slice(start, min(start + step, eos))
            o_seq, S = _chunk_one(
                q[rows, seg],
                k[rows, seg],
                v[rows, seg],
                None if g is None else g[rows, seg],
                beta[rows, seg],
                scale,
                S,
                chunk_size,
                dtype,
            )
            o[rows, seg] = o_seq
        assert S is not None  # the loop ran at least once
        finals.append(S)
    return o, (torch.cat(finals, 0) if output_final_state else None)


WORKING_SET_BYTES = 2 << 30  # the chunk reference's intermediates per window of chunks (a T = 128K prompt of 32
# heads at K = V = 128 needs about 70 GB at once in float64; the float64 output itself is allocated whole)


def window_tokens(rows: int, hv: int, k: int, v: int, chunk_size: int, dtype: torch.dtype) -> int:
    """Tokens per window of :func:`chunk_reference`: a multiple of ``chunk_size`` (at least one chunk) whose
    intermediates, about 16 ``[rows, hv, tokens, max(K, V)]`` and 4 ``[rows, hv, tokens, chunk_size]`` tensors of
    ``dtype``, fit :data:`WORKING_SET_BYTES`."""
    per_token = rows * hv * (16 * max(k, v) + 4 * chunk_size) * torch.finfo(dtype).bits // 8
    return max(1, WORKING_SET_BYTES // max(per_token, 1) // chunk_size) * chunk_size


def _chunk_one(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float,
    h0: Tensor | None,
    C: int,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Chunk form for equal-length rows: q,k [B,L,H,K], v [B,L,HV,V]. Returns o [B,L,HV,V], S [B,HV,K,V]."""
    B, L, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    S = torch.zeros(B, HV, K, V, dtype=dtype, device=dev) if h0 is None else h0.to(dtype).clone()
    if L == 0:
        return torch.empty(B, 0, HV, V, dtype=dtype, device=dev), S
    NT = -(-L // C)
    pad = NT * C - L

    def heads_first(x: Tensor) -> Tensor:
        """[B, L, HV, ...] -> [B, HV, NT, C, ...], zero-padded at the end (padded tokens have k = v = 0)."""
        x = x.to(dtype).transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(x.shape[0], x.shape[1], NT, C, *x.shape[3:])

    qc = heads_first(_expand_heads(q, HV)) * scale
    kc = heads_first(_expand_heads(k, HV))
    vc = heads_first(v)
    bc = heads_first(beta[..., None])  # [B,HV,NT,C,1]
    if g is None:
        gam = torch.zeros(B, HV, NT, C, 1, dtype=dtype, device=dev)
    else:
        gc = heads_first(g if g.dim() == 4 else g[..., None])  # [B,HV,NT,C,K or 1]
        gam = gc.cumsum(3)  # γ: cumulative log decay inside the chunk
        low = float(gam.detach().min()) if gam.numel() else 0.0
        if not low >= -math.log(torch.finfo(dtype).max) + 8:  # exp(-γ) would overflow (NaN in the result); -inf too
            raise ValueError(
                f"chunk_reference: a chunk's cumulative log gate reaches {low:.4g}, past what exp(-γ) holds in "
                f"{dtype} at chunk_size={C}: use a smaller chunk_size (chunk_size · max|g| < 700 in float64) or "
                "naive_recurrent"
            )
    eg = gam.exp()
    eg_inv = (-gam).exp()
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril(0)
    ke, ki = kc * eg, kc * eg_inv
    A_kk = (bc * ke) @ ki.transpose(-1, -2)  # β_i Σ_d k_i k_j exp(γ_i - γ_j)
    A_kk = A_kk.masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=dtype, device=dev)
    Tm = torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk).contiguous(), upper=False)
    W = Tm @ (bc * ke)  # T (β ⊙ K ⊙ exp(γ))
    U = Tm @ (bc * vc)  # T (β ⊙ V)
    A_qk = ((qc * eg) @ ki.transpose(-1, -2)).masked_fill(~causal, 0)
    g_last = gam[:, :, :, -1:, :]  # γ_C (padding has g = 0, so the last row is the chunk's total)
    k_to_end = kc * (g_last - gam).exp()  # K ⊙ exp(γ_C - γ)
    q_dec = qc * eg  # scale Q ⊙ exp(γ)
    decay_end = g_last.squeeze(3).exp()  # [B,HV,NT,K or 1]
    out = torch.empty(B, HV, NT, C, V, dtype=dtype, device=dev)
    for c in range(NT):
        v_new = U[:, :, c] - W[:, :, c] @ S
        out[:, :, c] = q_dec[:, :, c] @ S + A_qk[:, :, c] @ v_new
        S = decay_end[:, :, c, :, None] * S + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    o = out.reshape(B, HV, NT * C, V)[:, :, :L].transpose(1, 2)
    return o, S


# ---- fla's in-kernel options, as pre- and post-processing of the references' inputs ----------------------------
#
# flash-linear-attention's ops take options that transform their inputs before the recurrence (fla-core 0.6.0,
# fla/ops/{gated_delta_rule,kda}/chunk.py, fla/ops/kda/fused_recurrent.py). Written here in plain PyTorch, in the
# dtype of their inputs (float64 for a reference), exactly as fla defines them:
#   use_qk_l2norm_in_kernel     q, k <- x / sqrt(Σ_d x_d² + 1e-6)                     (fla.modules.l2norm, eps 1e-6)
#   use_gate_in_kernel          g <- -exp(A_log) · softplus(g + dt_bias)               (A_log [HV]; dt_bias [HV] for
#                               with lower_bound: lower_bound · sigmoid(exp(A_log) · (g + dt_bias))   Gated DeltaNet,
#                               and A_log None:   lower_bound · sigmoid(g + dt_bias)                  [HV·K] for KDA)
#   use_beta_sigmoid_in_kernel  beta <- sigmoid(beta), times 2 with allow_neg_eigval
#   state_v_first               initial and final states are [N, HV, V, K] (transposed)

L2NORM_EPS = 1e-6  # fla's l2norm_fwd default


def l2_normalize(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, in x's dtype (use_qk_l2norm_in_kernel)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gate_from_raw(
    g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None = None, lower_bound: float | None = None
) -> Tensor:
    """The log-space gate of use_gate_in_kernel, in g's dtype: ``g`` ``[B, T, HV]`` (Gated DeltaNet) or
    ``[B, T, HV, K]`` (KDA); ``A_log`` ``[HV]`` (None only with ``lower_bound``); ``dt_bias`` ``[HV]`` or ``[HV·K]``."""
    HV = g.shape[2]
    per_channel = g.dim() == 4
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(g.dtype).reshape((HV, -1) if per_channel else (HV,))
    a = None if A_log is None else A_log.to(g.dtype).reshape(HV, 1) if per_channel else A_log.to(g.dtype).reshape(HV)
    if lower_bound is None:
        if a is None:
            raise ValueError("use_gate_in_kernel needs A_log unless lower_bound is set")
        return -a.exp() * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(x if a is None else a.exp() * x)


def beta_from_logits(beta: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """``sigmoid(beta)``, times 2 with ``allow_neg_eigval`` (use_beta_sigmoid_in_kernel)."""
    b = torch.sigmoid(beta)
    return 2 * b if allow_neg_eigval else b


def reference_with_options(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    chunked: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The float64 reference of a call with fla's options: the options applied to the inputs (in float64), then
    :func:`naive_recurrent` (or :func:`chunk_reference` with ``chunked``), the final state transposed back with
    ``state_v_first``. Differentiable: float64 autograd through it gives the reference gradients of every input,
    ``A_log`` and ``dt_bias`` included."""
    f64 = torch.float64
    q, k, v, beta = q.to(f64), k.to(f64), v.to(f64), beta.to(f64)
    g = None if g is None else g.to(f64)
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_gate_in_kernel:
        if g is None:
            raise ValueError("use_gate_in_kernel needs a gate g")
        g = gate_from_raw(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = beta_from_logits(beta, allow_neg_eigval)
    elif allow_neg_eigval:
        raise ValueError("allow_neg_eigval needs use_beta_sigmoid_in_kernel (as in fla)")
    h0 = initial_state
    if h0 is not None:
        h0 = h0.to(f64)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    run = chunk_reference if chunked else naive_recurrent
    o, ht = run(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens)
    if ht is not None and state_v_first:
        ht = ht.transpose(-1, -2)
    return o, ht
