"""Work model of the chunk stages, for the profiler: nominal FLOPs (the useful, triangular work) and compulsory
bytes of every launch of one call (``C = BT`` tokens per chunk, ``ta`` token-heads = tokens · HV)."""

from __future__ import annotations

import torch

from .call import ChunkCall

Cost = tuple[float, float]  # (flops, bytes)


def stage_costs(call: ChunkCall) -> dict[str, Cost]:
    """``{stage name: (flops, bytes)}`` for the stages :func:`~.pipeline.build_stages` launches for ``call``.

    ``WU = "recomputed"``: stage 1 reads no v and writes T ``[tokens, HV, C]`` instead of W and U, the state pass
    reads v, beta and T instead of W and U (and does one more ``[C, C] × [C, V]`` product per chunk);
    ``AQK = "recomputed"``: stage 1 reads no q and writes no A_qk, the state pass reads no A_qk (and does one more
    ``[C, K] × [K, C]`` product per chunk and V tile). KDA's ``"recomputed"``: stage 1 writes ``P = β ⊙ K ⊙ e^γ``
    ``[tokens, HV, K]`` beside T, the state pass reads it (in W's place)."""
    K, V, HV, H, N, C = call.K, call.V, call.HV, call.H, call.N, call.BT
    tokens, NC, gate = call.tokens, call.NC, call.gate
    isz = call.q.element_size()
    osz = torch.empty((), dtype=call.dt).element_size()
    vsz = call.v.element_size()
    bsz = call.beta.element_size()
    gsz = 0 if call.g is None else call.g.element_size() * (K if gate == 2 else 1)
    ta = tokens * HV
    q_read = k_read = tokens * H * K * isz
    wu, qk = not call.recompute, not call.recompute_qk  # stored by stage 1

    gate_out = {0: 0, 1: ta * 4, 2: 2 * ta * K * osz + NC * HV * K * 4}[gate]
    intra_flops = ta * (C * K * (1 + qk) + (C * (K + V) if wu else 0) + C * C / 3)
    intra_in = k_read + (q_read if qk else 0) + ta * ((V * vsz if wu else 0) + bsz + gsz)
    p_k = ta * K * osz if gate == 2 and not wu else 0  # KDA recomputed: P [tokens, HV, K], W's operand
    intra_out = ta * ((K + V) * osz if wu else C * osz) + p_k + (ta * C * osz if qk else 0) + gate_out
    costs: dict[str, Cost] = {"intra": (float(intra_flops), float(intra_in + intra_out))}

    # the state pass reads k~ (KDA) or k (+ the scalar gate's γ), and W, U (stored) or v, beta, T (recomputed)
    k_in = ta * K * osz if gate == 2 else k_read + (ta * 4 if gate == 1 else 0)
    wu_in = ta * (K + V) * osz if wu else ta * (V * vsz + bsz + C * osz) + p_k
    state_flops = ta * (4 * K * V + (0 if wu else 2 * C * V))
    state_bytes = k_in + wu_in + N * HV * K * V * 4 * ((call.h0 is not None) + call.output_final_state)
    out_flops = ta * (2 * K * V + C * V + (0 if qk else 2 * C * K * -(-V // call.h_BV)))
    q_in = ta * K * osz if gate == 2 else q_read

    seg = call.tables.segments
    if seg is not None:
        NS, ti = seg.NS, seg.inner_tokens * HV
        ext = NS * HV * K * (V + K) * 4
        # k~ and W (KDA), k and W (stored) or k, v, beta and T (recomputed); U = 0 in the M columns
        tk_in = ti * K * (2 * osz if gate == 2 else isz + (osz if wu else 0))
        tv_in = ti * V * osz if wu else ti * (V * vsz + bsz + C * osz)
        costs["transitions"] = (float(ti * 4 * K * (V + K)), float(tk_in + tv_in + ext))
        starts = NS * HV * K * V * 4
        costs["segment-starts"] = (float(NS * HV * 2 * K * K * V), float(ext + 2 * starts))
        state_bytes += starts  # each segment reads its entering state

    if call.fuse:
        fused_in = q_in + (ta * C * osz if qk else 0) + ta * V * vsz
        costs["state+output"] = (float(state_flops + out_flops), float(state_bytes + fused_in))
    else:
        costs["state"] = (float(state_flops), float(state_bytes + NC * HV * K * V * osz + ta * V * osz))
        q_out = q_in + (ta * 4 if gate == 1 else 0)
        out_bytes = q_out + NC * HV * K * V * osz + ta * (C + V) * osz + ta * V * vsz
        costs["output"] = (float(out_flops), float(out_bytes))
    return costs
