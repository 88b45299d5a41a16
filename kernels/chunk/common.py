"""Helpers shared by the chunk-parallel kernels (intra variants, output)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_bounds(chunk_info, i_c, T, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first token, sequence end) of chunk ``i_c`` as int64: from the varlen chunk table, or of a [B, T] batch."""
    if VARLEN:
        bos = tl.load(chunk_info + 2 * i_c).to(tl.int64)
        eos = tl.load(chunk_info + 2 * i_c + 1).to(tl.int64)
    else:
        NT = tl.cdiv(T, BT)
        i_b = i_c // NT
        bos = i_b.to(tl.int64) * T + (i_c % NT) * BT
        eos = i_b.to(tl.int64) * T + T
    return bos, eos
