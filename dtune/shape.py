"""The vocabulary every layer shares: the gate mode, the shape of one call, and a grid of shapes.

:class:`Shape` is the one shape type: what :func:`dtune.inputs.check_inputs` returns for a call, what a search
tunes, what a tuned config is bucketed by, what the measurement harness builds inputs for. :class:`ShapeGrid`
is the one grid type: the search space's default grid, the CLI's ``--seq-lens/--head-dims/--heads/--batch``, the
benchmark's grids and the shapes a tuned-config file was tuned on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

BUCKET_KEYS = ("T", "B", "H", "HV", "K", "V")
SHAPE_COLUMNS = ["B", "T", "H", "HV", "K", "V"]  # the shape columns of every table (trials, bench, profile)


class Gate(str, Enum):
    """How the state decays each step: not at all (DeltaNet), by a scalar (Gated DeltaNet), per key channel (KDA)."""

    NONE = "none"
    SCALAR = "scalar"
    CHANNEL = "channel"


@dataclass(frozen=True)
class Shape:
    """The shape of one call: ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, ``N`` sequences.

    ``N`` defaults to ``B`` (fixed-length batches); a packed variable-length batch has ``B = 1``, ``varlen`` and
    ``N = len(cu_seqlens) - 1``.
    """

    B: int  # batch rows (1 with cu_seqlens)
    T: int  # tokens per row
    H: int  # query/key heads
    HV: int  # value heads (HV % H == 0)
    K: int  # key head dim
    V: int  # value head dim
    N: int = -1  # sequences (B, or len(cu_seqlens) - 1); -1: B
    gate: Gate = Gate.NONE
    varlen: bool = False
    # cu_seqlens on the host as dtune.inputs.check_inputs read it (None without cu_seqlens, or while a CUDA graph is
    # captured): the chunk kernels build their tables from it instead of copying cu_seqlens to the host again
    seq_offsets: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.N == -1:
            object.__setattr__(self, "N", self.B)

    @property
    def key(self) -> str:
        """The study's and the export's name of the shape, e.g. ``T4096-B8-H16-HV16-K128-V128``."""
        return f"T{self.T}-B{self.B}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"

    def bucket(self) -> dict[str, int]:
        """The tuned-config bucket of this shape (``T, B, H, HV, K, V``)."""
        return {k: getattr(self, k) for k in BUCKET_KEYS}

    def as_dict(self) -> dict[str, Any]:
        """``shape_key`` and the bucket: what run.json and the studies record."""
        return {"shape_key": self.key, **self.bucket()}

    def names(self) -> dict[str, int]:
        """The names a search-space constraint may use (``B, T, H, HV, K, V, N``)."""
        return {**self.bucket(), "N": self.N}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], gate: Gate | str = Gate.NONE) -> Shape:
        """From a bucket, a run.json shape or a launch spec (``N`` optional)."""
        B = int(d["B"])
        return cls(B, int(d["T"]), int(d["H"]), int(d["HV"]), int(d["K"]), int(d["V"]), int(d.get("N", B)), Gate(gate))

    def lookup_bucket(self) -> dict[str, int]:
        """The bucket a call's config is looked up by: :meth:`bucket`, except that a packed batch (``varlen``) is
        bucketed by its number of sequences (``B = N``) and their mean length (``T = tokens // N``), as
        ``dtune search --packed-seqs`` records it."""
        if not self.varlen:
            return self.bucket()
        N = max(self.N, 1)
        return {**self.bucket(), "T": max(1, self.T // N), "B": N}

    def bucket_distance(self, bucket: Mapping[str, int]) -> tuple[float, ...]:
        """How far a tuned bucket is from this shape's :meth:`lookup_bucket` (:func:`bucket_distance`)."""
        return bucket_distance(self.lookup_bucket(), bucket)


def bucket_distance(mine: Mapping[str, int], bucket: Mapping[str, int]) -> tuple[float, ...]:
    """How far a tuned ``bucket`` is from a shape's lookup bucket ``mine``: the sequence length, then the batch (number
    of sequences), then heads, on a log scale; ties go to the smaller bucket. (Head dims and the value-head ratio come
    first in :func:`dtune.borrow.distance`.)"""
    return (
        abs(math.log(max(mine["T"], 1)) - math.log(bucket["T"])),
        abs(math.log(max(mine["B"], 1)) - math.log(bucket["B"])),
        abs(math.log(mine["H"]) - math.log(bucket["H"])),
        bucket["T"],
        bucket["B"],
        bucket["H"],
    )


@dataclass(frozen=True)
class ShapeGrid:
    """Every (sequence length, head dim, heads, batch) combination, ``K = V`` and ``H = HV``; or explicit shapes.

    With ``batch_tokens`` and no ``batch``, B = max(1, batch_tokens // T); with neither, B = 1.
    """

    seq_lens: tuple[int, ...] = ()
    head_dims: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()
    batch_tokens: int | None = None
    explicit: tuple[Shape, ...] = ()  # wins over the axes

    def shapes(self, gate: Gate = Gate.NONE) -> list[Shape]:
        """The grid's shapes, sequence length outermost (explicit shapes in their order), with ``gate``."""
        if self.explicit:
            return [Shape(s.B, s.T, s.H, s.HV, s.K, s.V, s.N, gate, s.varlen) for s in self.explicit]
        out: list[Shape] = []
        for T, D, H in itertools.product(self.seq_lens, self.head_dims, self.heads):
            batches = self.batch if self.batch else (max(1, (self.batch_tokens or T) // T),)
            out.extend(Shape(B=B, T=T, H=H, HV=H, K=D, V=D, gate=gate) for B in batches)
        return out

    def replace(
        self,
        seq_lens: tuple[int, ...] | None = None,
        head_dims: tuple[int, ...] | None = None,
        heads: tuple[int, ...] | None = None,
        batch: tuple[int, ...] | None = None,
        batch_tokens: int | None = None,
    ) -> ShapeGrid:
        """This grid with the axes given replaced; a ``batch`` wins over ``batch_tokens`` (either replaces both)."""
        if batch:
            bs, bt = tuple(batch), None
        elif batch_tokens:
            bs, bt = (), batch_tokens
        else:
            bs, bt = self.batch, self.batch_tokens
        return ShapeGrid(
            seq_lens=tuple(seq_lens or self.seq_lens),
            head_dims=tuple(head_dims or self.head_dims),
            heads=tuple(heads or self.heads),
            batch=bs,
            batch_tokens=bt,
        )


def packed_and_grouped(shapes: Sequence[Shape], packed: Sequence[int] | None, hv_ratio: int) -> list[Shape]:
    """``shapes`` as one packed variable-length batch of ``packed`` sequence lengths per head dim and heads (bucketed
    as ``B`` = the number of sequences of their mean length, as calls with ``cu_seqlens`` look their config up), and
    with ``hv_ratio`` value heads per query/key head; ValueError on a ratio below 1 or an empty packed batch."""
    if hv_ratio < 1:
        raise ValueError(f"--hv-ratio must be at least 1, got {hv_ratio}")
    out = list(shapes)
    if packed is not None:
        if not packed or min(packed) < 1:
            raise ValueError(f"--packed-seqs needs positive sequence lengths, got {list(packed)}")
        mean = max(1, round(sum(packed) / len(packed)))
        out = list({replace(s, B=len(packed), T=mean, N=len(packed)): None for s in out})
    return [replace(s, HV=s.H * hv_ratio) for s in out]
