"""The sequence-parallel reverse state pass (``dh_SEG_CHUNKS > 0``): its segment table and phase 2.

Few long sequences leave the reverse pass (:mod:`.bwd_state`) with too few programs (``N · HV · V / dh_BV``) to fill
the GPU, each walking thousands of chunks. The adjoint's update is affine (``X_c = P_c X_{c+1} + R_c``, derived in
:mod:`.bwd_state`), so, with each sequence cut into segments of ``dh_SEG_CHUNKS`` chunks (never crossing a sequence
boundary):

1. per segment but the first of each sequence, in parallel: ``R_seg`` (the pass from a zero adjoint) and ``P_seg``
   (the pass on a ``K × K`` adjoint from the identity, without ``dO``): :mod:`.bwd_state`'s ``SEG = 1``;
2. per sequence, sequentially over its few segments from the last (:func:`chunk_bwd_segment_ends_kernel`):
   ``X_end(last) = dS_T`` (the final state's gradient, or 0), ``X_end(s − 1) = X_start(s) = P_s X_end(s) + R_s``;
3. per segment, in parallel: the ordinary reverse pass from ``X_end(s)`` (``SEG = 2``), which stores the chunk
   adjoints and ``dV_new``; the first segment of a sequence stores the initial state's gradient.

Exact (the same sums, in another order; phase 2's products in float32, tf32 dots for 16-bit inputs as the forward's
phase 2). Work grows (phase 1 runs ``(V + K) / V`` times the chain of a segment, plus phase 3), parallelism by the
number of segments. An empty sequence has no segments: phase 2 stores its initial state's gradient (``dS_T``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


@dataclass(frozen=True)
class ReverseSegments:
    """The segments of one call (device int32 tensors): segment ``s`` covers tokens ``bounds[s] .. bounds[s + 1] − 1``
    and (global) chunks ``chunk_offsets[s] ..``; ``first[s]`` is the sequence whose first segment ``s`` is (else −1);
    sequence ``n`` owns segments ``seq_segments[n] .. seq_segments[n + 1] − 1`` (none when it is empty)."""

    NS: int
    bounds: Tensor  # [NS + 1]
    chunk_offsets: Tensor  # [NS + 1]
    first: Tensor  # [NS]
    seq_segments: Tensor  # [N + 1]
    seq_index: Tensor  # [NS] the segment's sequence
    seq_end: Tensor  # [NS] its sequence's end (one past its last token): the burn-in's exact fallback
    empty: Tensor | None  # int64: the empty sequences (no segment), or None when there is none


def reverse_segments(
    offsets: Sequence[int] | None, B: int, T: int, BT: int, seg_chunks: int, device: torch.device
) -> ReverseSegments | None:
    """The segment table for sequences at ``offsets`` (the host copy of ``cu_seqlens``; ``None``: ``B`` rows of
    ``T``), or None when no sequence has more than one segment (then the plain pass runs). Built on the host and
    uploaded in one copy, cached (the layers of a model share their ``cu_seqlens``)."""
    if seg_chunks <= 0:
        return None
    key = None if offsets is None else tuple(int(o) for o in offsets)
    return _build(key, B, T, BT, seg_chunks, device)


@lru_cache(maxsize=64)
def _build(
    offsets: tuple[int, ...] | None, B: int, T: int, BT: int, seg_chunks: int, device: torch.device
) -> ReverseSegments | None:
    offs = torch.tensor(list(offsets) if offsets is not None else [b * T for b in range(B + 1)], dtype=torch.int64)
    lens = offs[1:] - offs[:-1]
    counts = (lens + BT - 1) // BT  # chunks per sequence
    n_segs = (counts + seg_chunks - 1) // seg_chunks
    if not bool((n_segs > 1).any()):
        return None
    chunk_offsets = torch.zeros(offs.numel(), dtype=torch.int64)
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    seq_segments = torch.zeros(offs.numel(), dtype=torch.int64)
    torch.cumsum(n_segs, 0, out=seq_segments[1:])
    NS = int(seq_segments[-1])
    seq = torch.repeat_interleave(torch.arange(lens.numel()), n_segs)
    j = torch.arange(NS) - seq_segments[seq]  # segment index inside its sequence
    bounds = torch.cat([offs[seq] + j * (seg_chunks * BT), offs[-1:]])
    seg_chunk0 = torch.cat([chunk_offsets[seq] + j * seg_chunks, chunk_offsets[-1:]])
    first = torch.where(j == 0, seq, -1)
    flat = torch.cat([bounds, seg_chunk0, first, seq_segments, seq, offs[seq + 1]]).to(torch.int32).to(device)
    a, b, c, d, e = NS + 1, 2 * NS + 2, 3 * NS + 2, 3 * NS + 2 + seq_segments.numel(), 4 * NS + 2 + seq_segments.numel()
    empty = torch.nonzero(lens == 0).reshape(-1).to(device) if bool((lens == 0).any()) else None
    return ReverseSegments(NS, flat[:a], flat[a:b], flat[b:c], flat[c:d], flat[d:e], flat[e:], empty)


@triton.jit
def chunk_bwd_segment_ends_kernel(
    ext,
    dht,
    xend,
    dh0,
    seq_segments,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Phase 2 (one program per sequence, value head and ``BV`` value channels): ``xend[s]`` for every segment of the
    sequence, from its last segment back to its first, ``X ← P_s X + R_s`` with ``ext[s] = [R_s | P_s]`` (float32
    ``[K, V + K]``) loaded whole; ``P_s``, ``R_s`` do not depend on the chain, so the software pipeline loads the next
    segment's while this one multiplies."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    s0 = tl.load(seq_segments + i_n)
    s1 = tl.load(seq_segments + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    off_h = o_k[:, None] * V + o_v[None, :]
    LD = V + K  # row stride of the extended adjoint
    off_r = o_k[:, None] * LD + o_v[None, :]
    off_p = o_k[:, None] * LD + V + o_k[None, :]
    b_x = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_x += tl.load(dht + i_nh.to(tl.int64) * K * V + off_h, mask=m_h, other=0).to(tl.float32)
    if STORE_DH0 and s1 == s0:  # an empty sequence: the initial state's gradient is the final state's
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_h, b_x, mask=m_h)
    for r in range(s1 - s0):
        s = s1 - 1 - r
        tl.store(xend + (s * HV + i_hv).to(tl.int64) * (K * V) + off_h, b_x, mask=m_h)
        if s > s0:  # the adjoint at the start of segment s ends segment s − 1
            e_b = ext + (s * HV + i_hv).to(tl.int64) * (K * LD)
            b_p = tl.load(e_b + off_p, mask=m_k[:, None] & m_k[None, :], other=0)
            b_r = tl.load(e_b + off_r, mask=m_h, other=0)
            # (a non-finite adjoint reaches the next even where P_s was skipped as zero: 0 · NaN is NaN)
            b_x = tl.dot(b_p, b_x, b_r, input_precision=DOT_PREC)
