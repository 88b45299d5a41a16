"""The Gluon backward kernels' algebra, step by step as they compute it, in float64, against the chunked reference.

The Gluon reverse pass (kernels/chunk/bwd_state_ws.py) and dq/dk stage (kernels/chunk/bwd_dqk_ws.py) run only on an
sm_90 GPU (Gluon has no interpreter), so their numbers are checked there (tests/kernels/test_chunk_bwd_gpu.py). What
a CPU can check is their algebra: the transposed products, W's product from k (``fh_W = "recomputed"``), A_qk formed in
the pass, dβ's pairwise term from ``k kᵀ``, the gate's terms, and how each kernel masks a chunk's rows past its
sequence, which its TMA tiles read from the next sequence (or as zeros past the tensor's end). The functions below
mirror the kernels' per-chunk steps on whole tiles of a packed batch; their gradients must equal
:func:`dtune.kernels.reference_bwd.chunk_backward_reference`'s to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch
from dtune.kernels.config import GATE_FLOOR
from dtune.kernels.reference_bwd import chunk_backward_reference

Tensor = torch.Tensor
f64 = torch.float64


def _tile(x: Tensor, t0: int, BT: int) -> Tensor:
    """Rows ``t0 .. t0 + BT`` of a token-major tensor, as TMA reads them: whole, zeros past the tensor's end."""
    out = torch.zeros((BT, *x.shape[1:]), dtype=x.dtype)
    rows = x[t0 : t0 + BT]
    out[: rows.shape[0]] = rows
    return out


def _forward(q, k, v, g, beta, h0, bounds, BT, scale):
    """What stage 1 and the training forward's state pass store, per token and per chunk (float64): γ (chunk-local
    cumulative gate), T and A_qk rows (zero above their diagonals), W rows, V_new, the chunk states."""
    NTOK, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    gout = torch.zeros(NTOK, HV, dtype=f64)
    Tr = torch.zeros(NTOK, HV, BT, dtype=f64)
    Ar = torch.zeros(NTOK, HV, BT, dtype=f64)
    Wr = torch.zeros(NTOK, HV, K, dtype=f64)
    vnew = torch.zeros(NTOK, HV, V, dtype=f64)
    states = []
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        for hv in range(HV):
            S = h0[n, hv].clone()
            for t0 in range(bos, eos, BT):
                L = min(eos, t0 + BT) - t0
                kk, qq = k[t0 : t0 + L, hv // G], q[t0 : t0 + L, hv // G]
                vv, bb = v[t0 : t0 + L, hv], beta[t0 : t0 + L, hv]
                gam = torch.zeros(L, dtype=f64) if g is None else g[t0 : t0 + L, hv].clamp_min(GATE_FLOOR).cumsum(0)
                D = (gam[:, None] - gam[None, :]).clamp_max(0).exp()
                P = (kk @ kk.T) * D * torch.ones(L, L, dtype=f64).tril(-1)
                Tm = torch.linalg.inv(torch.eye(L, dtype=f64) + bb[:, None] * P)
                W = Tm @ (bb[:, None] * kk * gam.exp()[:, None])
                U = Tm @ (bb[:, None] * vv)
                vn = U - W @ S
                gout[t0 : t0 + L, hv] = gam
                Tr[t0 : t0 + L, hv, :L] = Tm
                Ar[t0 : t0 + L, hv, :L] = scale * (qq @ kk.T) * D * torch.ones(L, L, dtype=f64).tril(0)
                Wr[t0 : t0 + L, hv] = W
                vnew[t0 : t0 + L, hv] = vn
                states.append(((t0, hv), S.clone()))
                S = gam[-1].exp() * S + (kk * (gam[-1] - gam).exp()[:, None]).T @ vn
    return gout, Tr, Ar, Wr, vnew, dict(states)


def _reverse(q, k, v, beta, do, dht, fwd, bounds, BT, scale, gated, w_read, qk_re):
    """The Gluon reverse pass's steps (bwd_state_ws._compute), one program per sequence and value head on the whole
    value width: the adjoint per chunk, dVβ, dv, dβ's v part, the initial state's gradient."""
    gout, Tr, Ar, Wr, _, _ = fwd
    NTOK, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    dh, dvb, dv = {}, torch.zeros(NTOK, HV, V, dtype=f64), torch.zeros(NTOK, HV, V, dtype=f64)
    dbv = torch.zeros(NTOK, HV, dtype=f64)
    dh0 = torch.zeros(len(bounds) - 1, HV, K, V, dtype=f64)
    o = torch.arange(BT)
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        for hv in range(HV):
            xt = dht[n, hv].T.clone()  # Xᵀ [V, K]
            for t0 in reversed(range(bos, eos, BT)):
                L = min(eos - t0, BT)
                m = o < L
                kb, qb = _tile(k[:, hv // G], t0, BT), _tile(q[:, hv // G], t0, BT)
                b_beta = torch.where(m, _tile(beta[:, hv], t0, BT), 0.0)
                gam = torch.where(m, _tile(gout[:, hv], t0, BT), 0.0) if gated else torch.zeros(BT, dtype=f64)
                gC = gout[t0 + L - 1, hv] if gated else torch.tensor(0.0, dtype=f64)
                dh[(t0, hv)] = xt.T.clone()
                dot = torch.where(m[None, :], _tile(do[:, hv], t0, BT).T, 0.0)
                p = (xt @ kb.T) * (gC - gam).exp()[None, :]
                if qk_re:
                    mask = (o[None, :] <= o[:, None]) & m[:, None]
                    A = torch.where(
                        mask, scale * (qb @ kb.T) * torch.where(mask, gam[:, None] - gam[None, :], 0.0).exp(), 0.0
                    )
                else:
                    A = _tile(Ar[:, hv], t0, BT)
                dvn = torch.where(m[None, :], dot @ A + p, 0.0)
                dvbt = dvn @ _tile(Tr[:, hv], t0, BT)
                vt = _tile(v[:, hv], t0, BT).T
                dbv[t0 : t0 + L, hv] = (dvbt * vt).sum(0)[:L]
                dv[t0 : t0 + L, hv] = (dvbt * b_beta[None, :]).T[:L]
                dvb[t0 : t0 + L, hv] = dvbt.T[:L]
                xt = xt * gC.exp() + (dot * (scale * gam.exp())[None, :]) @ qb
                if w_read:
                    xt = xt - dvn @ _tile(Wr[:, hv], t0, BT)
                else:
                    xt = xt - (dvbt * (b_beta * gam.exp())[None, :]) @ kb
            dh0[n, hv] = xt.T
    return dh, dvb, dv, dbv, dh0


def _dqk(q, k, g, beta, do, fwd, rev, bounds, BT, scale):
    """The Gluon dq/dk stage's steps (bwd_dqk_ws._compute), one item per chunk and value head: dq, dk per value head,
    dβ's k part, dγ."""
    _, _, _, _, vnew, states = fwd
    dh, dvb, _, _, _ = rev
    NTOK, H, K = q.shape
    HV = vnew.shape[1]
    G = HV // H
    dq, dk = torch.zeros(NTOK, HV, K, dtype=f64), torch.zeros(NTOK, HV, K, dtype=f64)
    dbk, dgam = torch.zeros(NTOK, HV, dtype=f64), torch.zeros(NTOK, HV, dtype=f64)
    o = torch.arange(BT)
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        for t0 in range(bos, eos, BT):
            L = min(eos - t0, BT)
            m = o < L
            for hv in range(HV):
                b_do, b_vn, b_dvb = (_tile(x[:, hv], t0, BT) for x in (do, vnew, dvb))
                h, x = states[(t0, hv)], dh[(t0, hv)]
                acc_dq, acc_dk, acc_kb = b_do @ h.T, b_vn @ x.T, b_dvb @ h.T
                acc_aq, acc_ak = b_do @ b_vn.T, b_dvb @ b_vn.T
                dec = (h * x).sum(1)
                b_beta = torch.where(m, _tile(beta[:, hv], t0, BT), 0.0)
                if g is not None:
                    graw = torch.where(m, _tile(g[:, hv], t0, BT), 0.0)
                    gl = graw.clamp_min(GATE_FLOOR)
                    gam = gl.cumsum(0)
                    gC = torch.where(m, gl, 0.0).sum()
                else:
                    gam, gC = torch.zeros(BT, dtype=f64), torch.tensor(0.0, dtype=f64)
                e, ekc = gam.exp(), (gC - gam).exp()
                low = (o[None, :] <= o[:, None]) & m[:, None]
                strict = (o[None, :] < o[:, None]) & m[:, None]
                D = torch.where(low, gam[:, None] - gam[None, :], float("-inf")).exp()
                aq = torch.where(low, acc_aq * D * scale, 0.0)
                ak = torch.where(strict, -acc_ak * D, 0.0)
                akb = ak * b_beta[:, None]
                kb, qb = _tile(k[:, hv // G], t0, BT), _tile(q[:, hv // G], t0, BT)
                km = torch.where(m[:, None], kb, 0.0)
                b_dq = acc_dq * (scale * e)[:, None] + aq @ kb
                dkcol = acc_dk * ekc[:, None]
                dgc = (km * dkcol).sum() + gC.exp() * dec.sum()
                dkcol = dkcol + aq.T @ qb + akb.T @ kb
                b_db = -(acc_kb * km).sum(1) * e + (ak * (kb @ kb.T)).sum(1)
                dkrow = acc_kb * (-(b_beta * e))[:, None] + akb @ kb
                dgam_c = (qb * b_dq + km * (dkrow - dkcol)).sum(1) + torch.where(o == L - 1, dgc, 0.0)
                dq[t0 : t0 + L, hv], dk[t0 : t0 + L, hv] = b_dq[:L], (dkrow + dkcol)[:L]
                dbk[t0 : t0 + L, hv], dgam[t0 : t0 + L, hv] = b_db[:L], dgam_c[:L]
    return dq, dk, dbk, dgam


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
@pytest.mark.parametrize(
    ("w_read", "qk_re"), [(False, False), (True, False), (False, True)], ids=["w-from-k", "w", "aqk"]
)
def test_the_gluon_backward_algebra_matches_the_chunked_reference(gated: bool, w_read: bool, qk_re: bool) -> None:
    torch.manual_seed(0)
    lens, H, HV, K, V, BT = [5, 3, 0, 7, 1], 2, 4, 8, 6, 4
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    NTOK, N = bounds[-1], len(lens)
    q = torch.randn(NTOK, H, K, dtype=f64) / 2
    k = torch.nn.functional.normalize(torch.randn(NTOK, H, K, dtype=f64), dim=-1)
    v = torch.randn(NTOK, HV, V, dtype=f64)
    beta = torch.rand(NTOK, HV, dtype=f64)
    g = -torch.rand(NTOK, HV, dtype=f64) * 5 if gated else None
    if g is not None:
        g[6, 1] = float("-inf")  # a full forget: clamped, gradient 0
    h0 = torch.randn(N, HV, K, V, dtype=f64)
    do = torch.randn(NTOK, HV, V, dtype=f64)
    dht = torch.randn(N, HV, K, V, dtype=f64)
    scale = K**-0.5
    fwd = _forward(q, k, v, g, beta, h0, bounds, BT, scale)
    rev = _reverse(q, k, v, beta, do, dht, fwd, bounds, BT, scale, gated, w_read, qk_re)
    dq, dk, dbk, dgam = _dqk(q, k, g, beta, do, fwd, rev, bounds, BT, scale)
    _, _, dv, dbv, dh0 = rev
    # the finish stage: dβ's parts summed; dg the reverse cumulative sum of dγ inside each chunk, 0 where clamped
    dg = torch.zeros(NTOK, HV, dtype=f64)
    for n in range(N):
        for t0 in range(bounds[n], bounds[n + 1], BT):
            t1 = min(bounds[n + 1], t0 + BT)
            dg[t0:t1] = dgam[t0:t1].flip(0).cumsum(0).flip(0)
    ref = chunk_backward_reference(
        q[None], k[None], v[None], None if g is None else g[None], beta[None], do[None], dht, scale, h0,
        torch.tensor(bounds), chunk_size=BT,
    )  # fmt: skip
    got = {
        "q": dq.view(NTOK, H, HV // H, K).sum(2), "k": dk.view(NTOK, H, HV // H, K).sum(2), "v": dv,
        "beta": dbv + dbk, "initial_state": dh0,
    }  # fmt: skip
    if g is not None:
        got["g"] = torch.where(g < GATE_FLOOR, 0.0, dg)
    for name, want in ref.items():
        if want is None:
            continue
        want = want[0] if name != "initial_state" else want
        err = (got[name] - want).abs().max().item()
        assert err < 1e-9 * (1 + want.abs().max().item()), f"d{name}: {err:.3g}"
