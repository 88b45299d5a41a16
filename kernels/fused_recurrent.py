"""Fused-recurrent template: one program per (sequence, value head, V tile) walks the tokens in order.

The state tile ``[BK, BV]`` (all key channels, a slice of value channels) lives in registers in float32;
each token applies decay -> predict -> correct -> write -> read (docs/DESIGN.md §1). The key dimension cannot be
split (the prediction ``Sᵀk`` reduces over all of K), so the value tile ``BV`` is the parallel axis.
Serves decoding (T = 1 against a cached state) and short prompts; its roofline is the state's bytes.

Tunable: ``BV`` (value tile), ``num_warps``, ``num_stages`` (software pipelining of the token loop's loads).

flash-linear-attention's in-kernel options (:class:`InKernel`) are applied here, per token as it is loaded, rather
than as passes before the launch: the l2norm of q and k (the whole key row is in registers), the gate's activation
from the raw ``g`` with ``A_log`` / ``dt_bias`` (or ``lower_bound``), beta's sigmoid, and the ``[V, K]`` state layout
of ``state_v_first`` (the initial state read and the final state written transposed). A decode step is then one
launch instead of up to six (two l2norms, the gate, beta's two PyTorch ops, the final state's transpose), and no
float32 copy of the gate is written and read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launches as launch_cache
from .config import GATE_CODES, Config, cdiv, new_output, next_power_of_2
from .options import NO_IN_KERNEL, InKernel, activated_beta, activated_gate, gate_act, rnorm

PARAMS: dict[str, tuple[int, ...]] = {
    "BV": (4, 8, 16, 32, 64, 128, 256),
    "num_warps": (1, 2, 4, 8, 16),
    "num_stages": (1, 2, 3, 4),
}


def legal_params(gate: str) -> dict[str, tuple[int, ...]]:
    return PARAMS


def default_config(K: int, V: int, gate: str) -> Config:
    """A configuration that is correct for every supported shape (K, V <= 256) and reasonable everywhere."""
    BK = next_power_of_2(K)
    BV = min(next_power_of_2(V), 32 if BK <= 128 else 16)
    return {"BV": BV, "num_warps": 4 if BK * BV >= 2048 else 1, "num_stages": 1}


@triton.jit(do_not_specialize=["T"])
def fused_recurrent_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    VARLEN: tl.constexpr,
    L2NORM: tl.constexpr,
    BETA_ACT: tl.constexpr,
    STATE_VK: tl.constexpr,
    A_log=None,
    dt_bias=None,
    lower_bound=0.0,
    GACT: tl.constexpr = 0,
):
    """``GACT`` (``InKernel.gate_code``): ``g`` raw, activated with ``A_log``, ``dt_bias``, ``lower_bound`` as
    :func:`.options.activated_gate` says (0: the log gate as given); ``BETA_ACT``: 0, 1 ``sigmoid``, 2
    ``2 · sigmoid``; ``STATE_VK``: the states ``[V, K]``."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_beta = beta + bos * HV + i_hv
    if GATE == 1:
        p_g = g + bos * HV + i_hv
    elif GATE == 2:
        p_g = g + (bos * HV + i_hv) * K + o_k

    # the gate activation's per-head factor exp(A_log) and bias (KDA: its key channels, loaded once)
    act = gate_act(A_log, dt_bias, lower_bound, i_hv, K, GATE, GACT)
    b_bias = act[1]
    if GATE == 2 and (GACT // 4) % 2 == 1:
        b_bias = tl.load(act[1] + o_k, mask=m_k, other=0).to(tl.float32)

    if STATE_VK:
        off_h = i_nh.to(tl.int64) * K * V + o_k[:, None] + o_v[None, :] * K
    else:
        off_h = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + off_h, mask=m_h, other=0).to(tl.float32)

    for _ in range(bos, eos):
        b_q = tl.load(p_q, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0).to(tl.float32)
        if L2NORM:
            b_q *= rnorm(b_q, 0)
            b_k *= rnorm(b_k, 0)
        b_q = b_q * scale
        b_v = tl.load(p_v, mask=m_v, other=0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        b_beta = activated_beta(b_beta, BETA_ACT)
        if GATE == 1:
            b_gl = activated_gate(tl.load(p_g).to(tl.float32), act[0], b_bias, act[2], GACT % 4)
            b_h *= tl.exp(b_gl)
        elif GATE == 2:
            b_gl = activated_gate(tl.load(p_g, mask=m_k, other=0).to(tl.float32), act[0], b_bias, act[2], GACT % 4)
            b_h *= tl.exp(b_gl)[:, None]
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))  # predict, correct
        b_h += b_k[:, None] * b_u[None, :]  # write
        b_o = tl.sum(b_h * b_q[:, None], 0)  # read after the write
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_beta += HV
        if GATE == 1:
            p_g += HV
        elif GATE == 2:
            p_g += HV * K

    if STORE_HT:
        tl.store(ht + off_h, b_h.to(ht.dtype.element_ty), mask=m_h)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    gate: str,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    config: Config,
    in_kernel: InKernel = NO_IN_KERNEL,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the template on validated inputs with a checked, complete config. With ``in_kernel``, ``g`` and
    ``beta`` are the raw inputs of the options it names, and the states are ``[N, HV, V, K]`` with ``state_vk``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK, BV = next_power_of_2(K), config["BV"]
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    o = new_output(B, T, HV, V, dtype=v.dtype, device=v.device)
    state = (V, K) if in_kernel.state_vk else (K, V)
    ht = new_output(N, HV, *state, dtype=torch.float32, device=v.device) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    grid = (cdiv(V, BV), N * HV)

    def launch_all() -> None:
        fused_recurrent_fwd_kernel[grid](
            q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, GATE=GATE_CODES[gate], USE_H0=h0 is not None,
            STORE_HT=output_final_state, VARLEN=cu_seqlens is not None, L2NORM=in_kernel.l2norm,
            BETA_ACT=in_kernel.beta_sigmoid, STATE_VK=in_kernel.state_vk, **in_kernel.gate_args(),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )  # fmt: skip

    if not launch_cache.active(q):
        launch_all()
        return o, ht
    tensors = [q, k, v, g, beta, h0, cu_seqlens, in_kernel.A_log, in_kernel.dt_bias, o, ht]
    key = (
        "fused-recurrent", launch_cache.device_key(q), gate, float(scale), output_final_state,
        tuple(config.items()), in_kernel.flags(), launch_cache.layout(tensors[:9]),
    )  # fmt: skip
    launch_cache.run(key, tensors, launch_all)  # a repeated call replays its launch (dtune.kernels.launches)
    return o, ht
