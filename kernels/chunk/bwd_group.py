"""Backward, grouped value heads (``HV = G·H``): ``dq`` and ``dk`` summed over each key head's ``G`` value heads.

The chunk-parallel stage (or the reverse pass with ``REVERSE_DQK``) writes them per value head in float32 (or, with
``dqk_GROUP = "input"``, in the inputs' dtype), ``[tokens, HV, K]``; value head ``hv`` reads key head ``hv // G``, so a
key head's value heads are ``G`` adjacent rows: ``[tokens, H, G, K]``. One pass reads them once, sums in float32 and
writes ``[tokens, H, K]`` in the inputs' dtypes (as ``view(..., H, G, K).sum(-2).to(dtype)`` does in two passes, with a
float32 ``[tokens, H, K]`` round trip between them). Grid: ``⌈tokens·H / BR⌉`` programs of ``BR`` rows, the whole
(padded) key width each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import next_power_of_2

ROWS = 32  # rows (token, key head) per program
WARPS = 4


@triton.jit(do_not_specialize=["rows"])
def chunk_bwd_group_sum_kernel(
    dq,
    dk,
    dq_out,
    dk_out,
    rows,
    G: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
):
    o_r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    src = o_r[:, None] * (G * K) + o_k[None, :]  # value head j of the row's group at src + j·K
    b_dq = tl.zeros([BR, BK], dtype=tl.float32)
    b_dk = tl.zeros([BR, BK], dtype=tl.float32)
    for j in range(G):
        b_dq += tl.load(dq + src + j * K, mask=m, other=0)
        b_dk += tl.load(dk + src + j * K, mask=m, other=0)
    dst = o_r[:, None] * K + o_k[None, :]
    tl.store(dq_out + dst, b_dq.to(dq_out.dtype.element_ty), mask=m)
    tl.store(dk_out + dst, b_dk.to(dk_out.dtype.element_ty), mask=m)


def launch_group_sum(
    dq: torch.Tensor, dk: torch.Tensor, dq_out: torch.Tensor, dk_out: torch.Tensor, H: int, HV: int, K: int
) -> None:
    """``dq``, ``dk``: ``[tokens, HV, K]`` float32 or the inputs' dtype (contiguous; summed in float32); ``dq_out``,
    ``dk_out``: ``[tokens·H·K]`` elements, written."""
    rows = dq.numel() // (HV * K) * H
    if rows == 0:
        return
    chunk_bwd_group_sum_kernel[(triton.cdiv(rows, ROWS),)](
        dq, dk, dq_out, dk_out, rows, G=HV // H, K=K, BK=next_power_of_2(K), BR=ROWS, num_warps=WARPS
    )
