"""Work model of the chunk stages, for the profiler: nominal FLOPs (the useful, triangular work) and compulsory
bytes of every launch of one call (``C = BT`` tokens per chunk, ``ta`` token-heads = tokens · HV)."""

from __future__ import annotations

import torch

from .call import ChunkCall

Cost = tuple[float, float]  # (flops, bytes)


def stage_costs(call: ChunkCall) -> dict[str, Cost]:
    """``{stage name: (flops, bytes)}`` for the stages :func:`~.pipeline.build_stages` launches for ``call``."""
    K, V, HV, H, N, C = call.K, call.V, call.HV, call.H, call.N, call.BT
    tokens, NC, gate = call.tokens, call.NC, call.gate
    isz = call.q.element_size()
    osz = torch.empty((), dtype=call.dt).element_size()
    vsz = call.v.element_size()
    gsz = 0 if call.g is None else call.g.element_size() * (K if gate == 2 else 1)
    ta = tokens * HV
    qk_read = 2 * tokens * H * K * isz

    gate_out = {0: 0, 1: ta * 4, 2: 2 * ta * K * osz + NC * HV * K * 4}[gate]
    intra = (
        ta * (3 * C * K + C * V + C * C / 3),
        qk_read + ta * (V * isz + isz + gsz) + ta * (K + V + C) * osz + gate_out,
    )

    # the state pass reads W, U and k~ (KDA) or k (+ the scalar gate's γ)
    state_in = ta * (K + V) * osz + (ta * 2 * K * osz if gate == 2 else qk_read + (ta * 4 if gate == 1 else 0))
    state_flops = ta * 4 * K * V
    state_bytes = state_in + N * HV * K * V * 4 * ((call.h0 is not None) + call.output_final_state)
    out_flops = ta * (2 * K * V + C * V)
    costs: dict[str, Cost] = {}
    costs["intra"] = (float(intra[0]), float(intra[1]))

    seg = call.tables.segments
    if seg is not None:
        NS, ti = seg.NS, seg.inner_tokens * HV
        ext = NS * HV * K * (V + K) * 4
        k_in = ti * K * (2 * osz if gate == 2 else isz)
        costs["transitions"] = (float(ti * 4 * K * (V + K)), float(k_in + ti * V * osz + ext))
        starts = NS * HV * K * V * 4
        costs["segment-starts"] = (float(NS * HV * 2 * K * K * V), float(ext + 2 * starts))
        state_bytes += starts  # each segment reads its entering state

    if call.fuse:
        costs["state+output"] = (float(state_flops + out_flops), float(state_bytes + ta * (C * osz + V * vsz)))
    else:
        costs["state"] = (float(state_flops), float(state_bytes + NC * HV * K * V * osz + ta * V * osz))
        q_out = ta * K * osz if gate == 2 else qk_read / 2 + (ta * 4 if gate == 1 else 0)
        out_bytes = q_out + NC * HV * K * V * osz + ta * (C + V) * osz + ta * V * vsz
        costs["output"] = (float(out_flops), float(out_bytes))
    return costs
