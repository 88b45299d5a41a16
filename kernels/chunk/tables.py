"""Index tables of one call, built on the host once and uploaded in one copy: chunks, and the state-pass segments.

Chunks: every sequence starts its own chunks of ``BT`` tokens at its own offset; chunk ``c`` of the whole batch
covers tokens ``[chunk_info[c, 0], min(chunk_info[c, 0] + BT, chunk_info[c, 1]))``; sequence ``n`` owns chunks
``chunk_offsets[n] .. chunk_offsets[n + 1] - 1``. A fixed-length ``[B, T]`` batch needs no chunk table (the kernels
compute the same numbering), a varlen one (``cu_seqlens``) does.

Segments (the sequence-parallel state pass, ``SEG_CHUNKS > 0``): each sequence is cut into runs of ``SEG_CHUNKS``
chunks (the last one shorter); segments never cross a sequence boundary and start on chunk boundaries, so the
chunks keep their global numbering. Because they tile the tokens in order, segment ``s`` covers tokens
``bounds[s] .. bounds[s + 1] - 1`` and chunks ``chunk_offsets[s] .. chunk_offsets[s + 1] - 1`` (the same layout as
``cu_seqlens`` / the chunk offsets of sequences, so the state kernel's varlen mode runs over segments as they
are). ``last[s]`` is the sequence whose last segment ``s`` is (else −1); sequence ``n`` owns segments
``seq_segments[n] .. seq_segments[n + 1] - 1`` (none when it is empty); segment ``s`` belongs to sequence
``seq_index[s]``, whose first token is ``seq_first[s]`` (the burn-in's exact fallback, ``SEG_START = "burnin"``);
``empty`` lists the sequences without a segment (their final state is their initial state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class SegmentTable:
    """The segments of a call (device int32 tensors; see the module docstring)."""

    NS: int  # segments
    seg_chunks: int  # SEG_CHUNKS
    inner_tokens: int  # tokens of the segments that are not the last of their sequence (phase 1's work)
    bounds: Tensor  # [NS + 1] first token of each segment, then the end of the last
    chunk_offsets: Tensor  # [NS + 1] first (global) chunk of each segment, then the total
    last: Tensor  # [NS] sequence index if the segment ends its sequence, else -1
    seq_segments: Tensor  # [N + 1] first segment of each sequence
    seq_index: Tensor  # [NS] the segment's sequence
    seq_first: Tensor  # [NS] its sequence's first token
    empty: Tensor | None  # int64: the empty sequences (no segment), or None when there is none


@dataclass(frozen=True)
class ChunkTables:
    """Chunk and segment tables of one call."""

    NC: int  # chunks of the whole batch
    seq_bounds: Tensor | None  # [N + 1] int32: cu_seqlens on the device (varlen only)
    chunk_info: Tensor | None  # [NC, 2] int32 (first token, sequence end) (varlen only)
    chunk_offsets: Tensor | None  # [N + 1] int32 first chunk of each sequence (varlen only)
    segments: SegmentTable | None  # None: SEG_CHUNKS = 0, or no sequence has more than one segment


_OFFSETS_CACHE: list[tuple[Tensor, int, tuple[int, ...]]] = []  # (tensor, its version, its values), newest last
OFFSETS_CACHE_SIZE = 8


def host_offsets(cu_seqlens: Tensor) -> tuple[int, ...]:
    """The offsets of ``cu_seqlens`` on the host, read once per tensor: a call with the very tensor object of one of
    the last :data:`OFFSETS_CACHE_SIZE` calls, unchanged since (same in-place version counter), reuses its values,
    so the layers of a model that share one ``cu_seqlens`` (and a backward after its forward) pay one device-to-host
    copy, and its sync, per batch instead of one per call. The cache holds those few small tensors alive, so a
    cached object can never be a new tensor at a recycled address; writing into a cached tensor bumps its version
    and it is read again.

    Refused while a CUDA graph is being captured: the chunk tables are built on the host from these values, so a
    replay with new offsets copied into the same tensor would run the old tables (a wrong answer, not an error)."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the chunk ops cannot be captured in a CUDA graph with cu_seqlens: their chunk tables are built on the "
            "host from cu_seqlens' values, which a replay could change; call them eagerly, or capture fixed-length "
            "calls (the fused-recurrent ops read cu_seqlens on the device and can be captured with it)"
        )
    version = cu_seqlens._version
    for i, (t, v, offs) in enumerate(_OFFSETS_CACHE):
        if t is cu_seqlens and v == version:
            _OFFSETS_CACHE.append(_OFFSETS_CACHE.pop(i))
            return offs
    offs = tuple(int(x) for x in cu_seqlens.detach().to("cpu", torch.int64).tolist())
    _OFFSETS_CACHE[:] = [e for e in _OFFSETS_CACHE if e[0] is not cu_seqlens][-(OFFSETS_CACHE_SIZE - 1) :]
    _OFFSETS_CACHE.append((cu_seqlens, version, offs))
    return offs


def remember_host_offsets(cu_seqlens: Tensor, host_copy: Tensor) -> None:
    """Record ``host_copy`` (a CPU tensor holding the same offsets, e.g. flash-linear-attention's ``cu_seqlens_cpu``)
    as the host values of ``cu_seqlens``, so that :func:`host_offsets` reads no device memory for it. The caller
    vouches that the two agree (only their lengths are checked: comparing values would be the read this saves)."""
    if host_copy.device.type != "cpu":
        raise ValueError(f"the host copy of cu_seqlens must be a CPU tensor, got one on {host_copy.device}")
    if host_copy.numel() != cu_seqlens.numel():
        raise ValueError(
            f"the host copy of cu_seqlens has {host_copy.numel()} offsets, but cu_seqlens has {cu_seqlens.numel()}"
        )
    if any(t is cu_seqlens and v == cu_seqlens._version for t, v, _ in _OFFSETS_CACHE):
        return  # known already (the layers of one batch share cu_seqlens)
    offs = tuple(int(x) for x in host_copy.to(torch.int64).tolist())
    _OFFSETS_CACHE[:] = [e for e in _OFFSETS_CACHE if e[0] is not cu_seqlens][-(OFFSETS_CACHE_SIZE - 1) :]
    _OFFSETS_CACHE.append((cu_seqlens, cu_seqlens._version, offs))


def build_tables(
    offsets: Sequence[int] | None, B: int, T: int, BT: int, seg_chunks: int, device: torch.device
) -> ChunkTables:
    """Tables for sequences at ``offsets`` (host copy of ``cu_seqlens``; ``None``: ``B`` rows of ``T`` tokens).

    Cached (the last 64 distinct calls): the layers of one model's forward share their ``cu_seqlens``, so the
    tables are built and uploaded once per batch, not once per layer. The cached tensors are only ever read. Built
    from host integers on host tensors (no device read), uploaded without a host sync (:func:`_upload`).
    """
    key = None if offsets is None else offsets if isinstance(offsets, tuple) else tuple(int(o) for o in offsets)
    return _build_cached(key, B, T, BT, seg_chunks, device)


@lru_cache(maxsize=64)
def _build_cached(
    offsets: tuple[int, ...] | None, B: int, T: int, BT: int, seg_chunks: int, device: torch.device
) -> ChunkTables:
    varlen = offsets is not None
    offs = torch.tensor(list(offsets) if offsets is not None else [b * T for b in range(B + 1)], dtype=torch.int64)
    lens = offs[1:] - offs[:-1]
    counts = (lens + BT - 1) // BT
    chunk_offsets = torch.zeros(offs.numel(), dtype=torch.int64)
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    NC = int(chunk_offsets[-1])
    parts: dict[str, Tensor] = {}
    if varlen:
        seq = torch.repeat_interleave(torch.arange(lens.numel()), counts)
        idx = torch.arange(NC) - chunk_offsets[seq]
        parts["seq_bounds"] = offs
        parts["chunk_info"] = torch.stack([offs[seq] + idx * BT, offs[seq + 1]], 1).reshape(-1)
        parts["chunk_offsets"] = chunk_offsets
    n_segs = (counts + seg_chunks - 1) // seg_chunks if seg_chunks > 0 else counts.clamp(max=1)
    use_segments = seg_chunks > 0 and bool((n_segs > 1).any())
    NS = int(n_segs.sum())
    inner_tokens = 0
    if use_segments:
        seq_segments = torch.zeros(offs.numel(), dtype=torch.int64)
        torch.cumsum(n_segs, 0, out=seq_segments[1:])
        seq = torch.repeat_interleave(torch.arange(lens.numel()), n_segs)
        j = torch.arange(NS) - seq_segments[seq]  # segment index inside its sequence
        first_tok = offs[seq] + j * (seg_chunks * BT)
        parts["seg_bounds"] = torch.cat([first_tok, offs[-1:]])
        parts["seg_chunks"] = torch.cat([chunk_offsets[seq] + j * seg_chunks, chunk_offsets[-1:]])
        parts["seg_last"] = torch.where(j == n_segs[seq] - 1, seq, -1)
        parts["seq_segments"] = seq_segments
        parts["seg_seq"] = seq
        parts["seg_seq_first"] = offs[seq]
        if bool((lens == 0).any()):
            parts["seq_empty"] = torch.nonzero(lens == 0).reshape(-1)
        seg_lens = parts["seg_bounds"][1:] - parts["seg_bounds"][:-1]
        inner_tokens = int(seg_lens[parts["seg_last"] < 0].sum())
    dev = _upload(parts, device)
    segments = None
    if use_segments:
        segments = SegmentTable(
            NS, seg_chunks, inner_tokens, dev["seg_bounds"], dev["seg_chunks"], dev["seg_last"], dev["seq_segments"],
            dev["seg_seq"], dev["seg_seq_first"], dev["seq_empty"].long() if "seq_empty" in dev else None,
        )  # fmt: skip
    return ChunkTables(NC, dev.get("seq_bounds"), dev.get("chunk_info"), dev.get("chunk_offsets"), segments)


def _upload(parts: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """All tables as int32 in one host-to-device copy; returns views of it by name (chunk_info as [NC, 2]).

    To a GPU from pinned memory, asynchronously: a pageable copy would synchronise the host with the stream (it waits
    for every kernel queued before it). The pinned buffer is not reused before the copy is done (torch's host
    allocator records the copy's stream). Refused while a CUDA graph is being captured: the graph would copy from a
    buffer freed after capture, and the cache would hold tables that only a replay fills."""
    if not parts:
        return {}
    flat = torch.cat([p.reshape(-1) for p in parts.values()]).to(torch.int32)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "dtune's chunk tables for this shape (sequence lengths, chunk size, segments) are not built yet, and "
                "they cannot be built while a CUDA graph is captured: run the call once before capturing it (a "
                "warm-up call, as CUDA-graph capture needs anyway)"
            )
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    out: dict[str, Tensor] = {}
    start = 0
    for name, p in parts.items():
        out[name] = flat[start : start + p.numel()]
        start += p.numel()
    if "chunk_info" in out:
        out["chunk_info"] = out["chunk_info"].view(-1, 2)
    return out
