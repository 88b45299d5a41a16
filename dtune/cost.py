"""Nominal work of one forward call, for achieved GB/s and TFLOP/s (the same numbers for every config).

Bytes: every input read once (q, k, v, beta, the gate, the initial state) and every output written once
(o, the final state), at their dtypes (gates and states float32). FLOPs: the recurrence's own work,
decay (KV, gated only) + predict (2KV) + write (2KV) + read (2KV) per token and value head; the chunked
form does more arithmetic to gain parallelism, but the nominal count is the same so that configs and
families compare on one scale.
"""

from __future__ import annotations

import torch

from dtune.inputs import Gate, Problem


def nominal_bytes(problem: Problem, dtype: torch.dtype, gate: Gate) -> int:
    p = problem
    e = torch.empty((), dtype=dtype).element_size()
    qk = 2 * p.B * p.T * p.H * p.K * e
    vo = 2 * p.B * p.T * p.HV * p.V * e
    beta = p.B * p.T * p.HV * e
    g = {Gate.NONE: 0, Gate.SCALAR: p.B * p.T * p.HV * 4, Gate.CHANNEL: p.B * p.T * p.HV * p.K * 4}[gate]
    state = 2 * p.N * p.HV * p.K * p.V * 4
    return qk + vo + beta + g + state


def nominal_flops(problem: Problem, gate: Gate) -> int:
    p = problem
    per_token = (6 if gate is Gate.NONE else 7) * p.K * p.V
    return p.B * p.T * p.HV * per_token
