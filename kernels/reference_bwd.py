"""Reference of the chunkwise backward: the formulas the Triton backward implements, in float64 PyTorch.

The ground truth for gradients is float64 autograd through :func:`.reference.naive_recurrent`; this module is the
*second* reference: the chunk backward written out by hand, stage by stage as the kernels compute it, so that each
formula is checked against autograd once (tests/kernels/test_chunk_bwd.py) and the kernels can be read against it.

Notation (docs/DESIGN.md §1), per chunk of ``C`` rows, incoming state ``S_c``, ``γ`` the cumulative log gate inside the
chunk (per key channel for KDA, one number per row for Gated DeltaNet, 0 for DeltaNet), ``γ_C`` its last row,
``D_ij = exp(γ_i − γ_j)`` for ``j <= i``:

Forward: ``Kβ = β K e^γ``, ``Vβ = β V``, ``A_kk = β_i Σ_d k_i k_j D_ij`` (``j < i``), ``T = (I + A_kk)⁻¹``,
``W = T Kβ``, ``U = T Vβ``, ``q̃ = scale q e^γ``, ``k̃ = k e^{γ_C − γ}``, ``A_qk = scale Σ_d q_i k_j D_ij`` (``j <= i``),
``V_new = U − W S_c``, ``O = q̃ S_c + A_qk V_new``, ``S_{c+1} = diag(e^{γ_C}) S_c + k̃ᵀ V_new``.

Backward, reverse over a sequence's chunks (``X_{c+1}``: adjoint of the state after chunk c; the last one is the
final state's gradient, or 0):

* state pass: ``dV_new = A_qkᵀ dO + k̃ X_{c+1}``, ``X_c = diag(e^{γ_C}) X_{c+1} + q̃ᵀ dO − Wᵀ dV_new``; ``dS_0 = X_0``.
* chunk-local: ``dq̃ = dO S_cᵀ``, ``dA_qk = causal(dO V_newᵀ)``, ``dk̃ = V_new X_{c+1}ᵀ``,
  ``dVβ = Tᵀ dV_new``, ``dKβ = Tᵀ dW = −dVβ S_cᵀ`` (as ``dW = −dV_new S_cᵀ``), ``dA_kk = strict(−dVβ V_newᵀ)``
  (``−Tᵀ dT Tᵀ`` with ``dT = dW Kβᵀ + dU Vβᵀ`` collapses to this because ``V_new = T (Vβ − Kβ S_c)``), and
  ``d(e^{γ_C}) = Σ_v S_c ⊙ X_{c+1}``.
* inputs: ``dv = β dVβ``; ``dβ_i = Σ_v dVβ_i v_i + Σ_d dKβ_i k_i e^{γ_i} + Σ_j dA_kk[i,j] P_ij``;
  ``dq = scale e^γ dq̃ + scale Σ_j dA_qk[i,j] k_j D_ij``; ``dk`` = the "row" terms (``β e^γ dKβ``,
  ``β_i Σ_j dA_kk[i,j] k_j D_ij``) plus the "column" terms (``e^{γ_C − γ} dk̃``, ``Σ_i β_i dA_kk[i,j] k_i D_ij``,
  ``scale Σ_i dA_qk[i,j] q_i D_ij``).
* gate: every factor ``e^{γ_i}`` of a row term gives ``dγ_i += x_i ⊙ dx_i``, every ``e^{−γ_j}`` of a column term
  ``dγ_j −= x_j ⊙ dx_j``, so ``dγ = q ⊙ dq + k ⊙ (dk_row − dk_col)``, plus ``dγ_C = Σ_i k̃_i ⊙ dk̃_i +
  e^{γ_C} ⊙ d(e^{γ_C})`` on the chunk's last row; ``dg_t = Σ_{i >= t} dγ_i`` (reverse cumsum inside the chunk).
  Gated DeltaNet sums ``dγ`` over the channels.

Gates below :data:`GATE_FLOOR` (``-inf`` included: a full forget) are clamped to it, as the kernels do; their
gradient is the clamp's, 0 (``kernels/config.py`` says why −20 nats is a full forget to float32 precision).
"""

from __future__ import annotations

import torch

from .config import GATE_FLOOR
from .reference import _expand_heads, _sequences

Tensor = torch.Tensor


def chunk_backward_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    do: Tensor,
    dht: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 16,
) -> dict[str, Tensor | None]:
    """Gradients of ``<o, do> + <final_state, dht>`` by the chunk formulas above, in float64.

    Returns ``{"q", "k", "v", "g", "beta", "initial_state"}`` (``g`` None without a gate, ``initial_state`` always
    the state's gradient, ``[N, HV, K, V]``), shapes as the inputs.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    grads: dict[str, Tensor] = {
        "q": torch.zeros(B, T, HV, K, dtype=f64, device=q.device),
        "k": torch.zeros(B, T, HV, K, dtype=f64, device=q.device),
        "v": torch.zeros(v.shape, dtype=f64, device=q.device),
        "beta": torch.zeros(beta.shape, dtype=f64, device=q.device),
        "g": torch.zeros(g.shape, dtype=f64, device=q.device) if g is not None else torch.empty(0),
    }
    dh0 = []
    for n, (bos, eos) in enumerate(_sequences(T, cu_seqlens)):
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        pick = slice(None) if cu_seqlens is None else slice(n, n + 1)
        seg = slice(bos, eos)
        out = _bwd_one(
            q[rows, seg],
            k[rows, seg],
            v[rows, seg],
            None if g is None else g[rows, seg],
            beta[rows, seg],
            do[rows, seg],
            None if dht is None else dht[pick],
            None if initial_state is None else initial_state[pick],
            scale,
            chunk_size,
        )
        for name in ("q", "k", "v", "beta") + (("g",) if g is not None else ()):
            grads[name][rows, seg] = out[name]
        dh0.append(out["initial_state"])
    G = HV // H
    result: dict[str, Tensor | None] = dict(grads)
    result["q"] = grads["q"].view(B, T, H, G, K).sum(3)
    result["k"] = grads["k"].view(B, T, H, G, K).sum(3)
    result["g"] = grads["g"] if g is not None else None
    result["initial_state"] = torch.cat(dh0, 0)
    return result


def _bwd_one(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    do: Tensor,
    dht: Tensor | None,
    h0: Tensor | None,
    scale: float,
    C: int,
) -> dict[str, Tensor]:
    """One length-L batch of rows: q,k [B,L,H,K], v/do [B,L,HV,V]; gradients with q,k per value head."""
    f64 = torch.float64
    B, L, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    NT = -(-L // C) if L else 0
    pad = NT * C - L

    def chunks(x: Tensor) -> Tensor:
        """[B, L, HV, ...] -> [B, HV, NT, C, ...] float64, zero-padded rows at the end."""
        x = x.to(f64).transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(x.shape[0], x.shape[1], NT, C, *x.shape[3:])

    def unchunk(x: Tensor) -> Tensor:
        """Inverse of chunks (drops the padding)."""
        x = x.reshape(x.shape[0], x.shape[1], NT * C, *x.shape[4:])[:, :, :L]
        return x.transpose(1, 2)

    S0 = torch.zeros(B, HV, K, V, dtype=f64, device=dev) if h0 is None else h0.to(f64)
    X_last = torch.zeros(B, HV, K, V, dtype=f64, device=dev) if dht is None else dht.to(f64)
    if L == 0:
        z = torch.zeros
        return {
            "q": z(B, 0, HV, K, dtype=f64, device=dev),
            "k": z(B, 0, HV, K, dtype=f64, device=dev),
            "v": z(B, 0, HV, V, dtype=f64, device=dev),
            "beta": z(B, 0, HV, dtype=f64, device=dev),
            "g": z((B, 0, *((HV,) if g is None else g.shape[2:])), dtype=f64, device=dev),
            "initial_state": X_last,
        }
    qc, kc = chunks(_expand_heads(q, HV)), chunks(_expand_heads(k, HV))
    vc, doc, bc = chunks(v), chunks(do), chunks(beta[..., None])  # bc [B,HV,NT,C,1]
    if g is None:
        gc = torch.zeros(B, HV, NT, C, 1, dtype=f64, device=dev)
        floored = torch.zeros_like(gc, dtype=torch.bool)
    else:
        graw = chunks(g if g.dim() == 4 else g[..., None])
        floored = graw < GATE_FLOOR
        gc = graw.clamp_min(GATE_FLOOR)
    gam = gc.cumsum(3)  # [B,HV,NT,C,Kg]
    gC = gam[:, :, :, -1:]  # padded rows have g = 0: the last row holds γ_C
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril(0)
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    # D[..., i, j, d] = exp(γ_i − γ_j) for j <= i, else 0 (formed as a difference: no overflow)
    diff = gam[..., :, None, :] - gam[..., None, :, :]
    D = torch.where(causal[..., None], diff.clamp_max(0).exp(), torch.zeros((), dtype=f64, device=dev))
    P = torch.einsum("...id,...jd,...ijd->...ij", kc, kc, D) * strict
    Qm = scale * torch.einsum("...id,...jd,...ijd->...ij", qc, kc, D)
    A_kk = bc * P
    eye = torch.eye(C, dtype=f64, device=dev)
    Tm = torch.linalg.solve_triangular(eye + A_kk, eye.expand_as(A_kk).contiguous(), upper=False)
    eg = gam.exp()
    Kb = bc * kc * eg
    W, U = Tm @ Kb, Tm @ (bc * vc)
    qt = scale * qc * eg
    kt = kc * (gC - gam).exp()
    eC = gC.squeeze(3).exp()  # [B,HV,NT,Kg]

    # forward state pass: chunk-start states and V_new
    S = S0
    states, vnew = [], []
    for c in range(NT):
        states.append(S)
        vn = U[:, :, c] - W[:, :, c] @ S
        vnew.append(vn)
        S = eC[:, :, c, :, None] * S + kt[:, :, c].transpose(-1, -2) @ vn
    Sc, Vn = torch.stack(states, 2), torch.stack(vnew, 2)  # [B,HV,NT,K,V], [B,HV,NT,C,V]

    # reverse state pass
    X = X_last
    xs: list[Tensor] = [X] * NT
    dvn: list[Tensor] = [X] * NT
    for c in reversed(range(NT)):
        xs[c] = X
        dv_c = Qm[:, :, c].transpose(-1, -2) @ doc[:, :, c] + kt[:, :, c] @ X
        dvn[c] = dv_c
        X = (
            eC[:, :, c, :, None] * X
            + qt[:, :, c].transpose(-1, -2) @ doc[:, :, c]
            - W[:, :, c].transpose(-1, -2) @ dv_c
        )
    Xn, dVn = torch.stack(xs, 2), torch.stack(dvn, 2)

    # chunk-local gradients
    dqt = doc @ Sc.transpose(-1, -2)
    dAq = (doc @ Vn.transpose(-1, -2)) * causal
    dkt = Vn @ Xn.transpose(-1, -2)
    dVb = Tm.transpose(-1, -2) @ dVn
    dKb = -dVb @ Sc.transpose(-1, -2)
    dAk = -(dVb @ Vn.transpose(-1, -2)) * strict
    dEC = (Sc * Xn).sum(-1)  # [B,HV,NT,K]

    dv = bc * dVb
    dbeta = (dVb * vc).sum(-1) + (dKb * kc * eg).sum(-1) + (dAk * P).sum(-1)
    dq = scale * eg * dqt + scale * torch.einsum("...ij,...jd,...ijd->...id", dAq, kc, D)
    dk_row = bc * eg * dKb + bc * torch.einsum("...ij,...jd,...ijd->...id", dAk, kc, D)
    dk_col = (
        (gC - gam).exp() * dkt
        + torch.einsum("...ij,...id,...ijd->...jd", bc.squeeze(-1)[..., :, None] * dAk, kc, D)
        + scale * torch.einsum("...ij,...id,...ijd->...jd", dAq, qc, D)
    )
    dk = dk_row + dk_col
    dgam = qc * dq + kc * (dk_row - dk_col)
    dgamC = (kt * dkt).sum(3)  # [B,HV,NT,K]
    if g is not None and g.dim() == 3:  # scalar gate: one γ per row, the channels summed
        dgam = dgam.sum(-1, keepdim=True)
        dgamC = dgamC.sum(-1, keepdim=True) + eC * dEC.sum(-1, keepdim=True)
    else:
        dgamC = dgamC + eC * dEC
    dgam[:, :, :, -1] += dgamC
    dg = dgam.flip(3).cumsum(3).flip(3).masked_fill(floored, 0)
    return {
        "q": unchunk(dq),
        "k": unchunk(dk),
        "v": unchunk(dv),
        "beta": unchunk(dbeta[..., None]).squeeze(-1),
        "g": unchunk(dg) if g is None or g.dim() == 4 else unchunk(dg).squeeze(-1),
        "initial_state": X,
    }
