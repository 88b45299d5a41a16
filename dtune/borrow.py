"""Configs for shapes nobody tuned: the nearest tuned buckets' configs, adjusted to the shape (:func:`borrow`).

:mod:`dtune.store` returns a tuned entry verbatim when the call's own bucket was tuned (``exact``). Otherwise it asks
:func:`borrow`, which builds the config (``borrowed``) in three steps, each a small rule of its own:

1. **The donor** (:func:`distance`): among the entries of the same kernel and dtype, the one with the nearest head dims
   (K, then V, log scale), then value-head ratio HV/H, then :meth:`dtune.shape.Shape.bucket_distance` (sequence
   length, then number of sequences, then heads). Its config is the start: the same K and V first, then the nearest
   T.
2. **Head dims** (:func:`fit_head_dims`): a config tuned at other head dims keeps every choice that does not depend on
   them (chunk size, stage variants, layout, precision); its tiles are cut to the padded head dim (a wider tile only
   wastes lanes, as the search spaces' ``*_le_*`` constraints say), and where the padded key dim grows by a factor r,
   the tiles that hold a ``[K, tile]`` float32 state in registers shrink by r and the pipeline stages of ``[BT, K]``
   rows by r, so registers and shared memory per program stay the donor's.
3. **Segments** (:func:`segment_chunks`, the chunk forward): the sequence-parallel state pass's ``SEG_CHUNKS`` for this
   shape's sequences × value heads and length. Segmentation exists because the plain pass runs ``N · HV · ⌈V / h_BV⌉``
   programs, each walking a whole sequence: few long sequences leave most SMs idle. When the rule and the donor
   disagree on whether to segment, the state pass's parameters (:data:`STATE_PASS`: layout, V tile, warps, stages,
   the segment phases' tiles) come from the nearest entry that agrees, since an unsegmented pass picks its V tile to
   spread programs over the SMs and a segmented one gets its parallelism from the segments (H200: chunk_kda at D = 64,
   B = 2, T = 16384 searched to ``h_BV`` 64 and ``SEG_CHUNKS`` 32 where the D = 64 T = 4096 entry has ``h_BV`` 32,
   unsegmented).

4. **The reverse pass** (:func:`reverse_pass`, the chunk backward): its segments by the same regime (a sequence of
   8192 tokens or more whose plain pass leaves SMs idle; at least two segments per sequence), a segmented donor's
   segment length scaled so that the shape runs as many programs as the donor was tuned to (twice the value heads:
   segments twice as long), and its transposed layout only where the value tile keeps 64 rows.

Every value set comes from the template's legal values, so the result passes the kernel's ``check_config``. The
:class:`Choice` says where the config came from and what was changed (``dtune list --shape``, ``dtune bench``'s
``config_source``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dtune.kernels import get_kernel
from dtune.kernels.config import next_power_of_2
from dtune.shape import Shape, bucket_distance

EXACT, BORROWED, DEFAULT = "exact", "borrowed", "default"

# ---- the segmentation rule -----------------------------------------------------------------------------------------

# Fitted to the shipped H200 entries (dtune/configs/h200.json, 2026-11-30): the segmented ones run 256-1024 programs in
# the state pass's phase 3 (N · segments · HV · ⌈V / h_BV⌉), median 512, i.e. about 4 per SM on 132 SMs; the rule aims
# there (tests/dtune/test_borrow.py recomputes the median from the file).
PROGRAMS_PER_SM = 4
# Segmentation was only searched from here on (the search spaces' seg_underfilled constraint: a shorter sequence's
# chain is at most 256 chunks at BT = 32), so the rule never segments below it either.
MIN_SEGMENTED_TOKENS = 8192
SEG_RANGE = (8, 256)  # SEG_CHUNKS the search spaces try (0 = off)


def state_programs(N: int, HV: int, V: int, h_BV: int) -> int:
    """Programs of the plain state pass: one per sequence, value head and V tile (the tile cut to the padded V, at
    least 16, as the kernel launches it)."""
    tile = max(16, min(h_BV, next_power_of_2(V)))
    return N * HV * math.ceil(V / tile)


def segment_length(chunks: int, segments: float) -> int:
    """Chunks per segment for ``chunks`` cut into about ``segments``: a power of two (log scale) within SEG_RANGE."""
    lo, hi = SEG_RANGE
    return min(hi, max(lo, 2 ** round(math.log2(max(chunks / segments, 1.0)))))


def segment_chunks(N: int, HV: int, V: int, T: int, BT: int, h_BV: int, sm_count: int) -> int:
    """``SEG_CHUNKS`` for ``N`` sequences of ``T`` tokens each (a packed batch: its mean length), 0 for off.

    Off when the plain pass already has a program per SM (``N · HV · ⌈V / h_BV⌉ >= sm_count``) or the sequences are
    shorter than :data:`MIN_SEGMENTED_TOKENS`. Otherwise each sequence is cut into enough segments for about
    :data:`PROGRAMS_PER_SM` programs per SM, the segment length rounded to a power of two (log scale) within
    :data:`SEG_RANGE`, with at least two segments per sequence.
    """
    programs = state_programs(N, HV, V, h_BV)
    if T < MIN_SEGMENTED_TOKENS or programs >= sm_count:
        return 0
    chunks = math.ceil(T / BT)
    segments = PROGRAMS_PER_SM * sm_count / programs
    seg = segment_length(chunks, segments)
    while seg > SEG_RANGE[0] and seg * BT >= T:
        seg //= 2
    return seg if seg * BT < T else 0


# ---- head dims ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """A parameter that tiles a head dim: ``dim`` ("K" or "V"), the smallest value the padded-dim rule allows
    (``tile <= max(floor, next_power_of_2(dim))``), whether it holds a ``[K, tile]`` float32 state in registers, and
    the (parameter, value) under which the template does not use it (then it is left as it is)."""

    dim: str
    floor: int
    state: bool = False
    unused_when: tuple[str, Any] | None = None

    def used(self, config: Mapping[str, Any]) -> bool:
        return self.unused_when is None or config.get(self.unused_when[0]) != self.unused_when[1]


# Which parameters tile which head dim, per template (the search spaces' tile constraints), and which count pipeline
# stages of [BT, K] rows. ``tr_BV = 0`` means "h_BV" and stays 0.
TILES: dict[str, dict[str, Tile]] = {
    "chunk": {
        "intra_BK": Tile("K", 32),
        "intra_BV": Tile("V", 32),
        "h_BV": Tile("V", 16, state=True),
        "tr_BV": Tile("V", 16, state=True, unused_when=("SEG_CHUNKS", 0)),
        "seg_BV": Tile("V", 16, state=True, unused_when=("SEG_CHUNKS", 0)),
        "o_BK": Tile("K", 32, unused_when=("FUSE_OUTPUT", True)),
        "o_BV": Tile("V", 32, unused_when=("FUSE_OUTPUT", True)),
    },
    "chunk_bwd": {
        "dh_BV": Tile("V", 16, state=True),
        "dv_BV": Tile("V", 32, unused_when=("FUSE_DV", True)),
        "dqk_BK": Tile("K", 32),
        "dqk_BV": Tile("V", 32),
    },
    "fused_recurrent": {"BV": Tile("V", 8, state=True)},
}
ROW_STAGES: dict[str, tuple[str, ...]] = {
    "chunk": ("h_num_stages",),
    "chunk_bwd": ("dh_num_stages",),
    "fused_recurrent": ("num_stages",),
}
# The state pass's own parameters (chunk forward), taken together from one entry.
STATE_PASS = ("STATE_LAYOUT", "h_BV", "h_num_warps", "h_num_stages", "SEG_COMBINE", "seg_BV", "tr_BV", "tr_num_warps")
STATE_WHY = "the state pass's entry"  # a parameter taken from Choice.state_bucket (described with it)
# unused without segments: the default then (SEG_DECAY: Gated DeltaNet's only)
SEGMENT_ONLY = ("SEG_COMBINE", "seg_BV", "tr_BV", "tr_num_warps", "SEG_DECAY")


@dataclass(frozen=True)
class Change:
    """One parameter the adjustment changed, and why."""

    param: str
    old: Any
    new: Any
    why: str

    def __str__(self) -> str:
        return f"{self.param} {self.old}→{self.new}" + (f" ({self.why})" if self.why else "")


def _template(kernel: str) -> str:
    spec = get_kernel(kernel)
    return f"{spec.family}_bwd" if spec.backward else spec.family


def _largest(legal: Sequence[Any], limit: int) -> Any:
    """The largest legal value at most ``limit`` (the smallest legal one when none is)."""
    fits = [x for x in legal if isinstance(x, int) and not isinstance(x, bool) and 0 < x <= limit]
    return max(fits) if fits else min(x for x in legal if isinstance(x, int) and x > 0)


def fit_head_dims(kernel: str, config: Mapping[str, Any], K0: int, V0: int, K: int, V: int) -> list[Change]:
    """The changes that fit ``config`` (a full config tuned at head dims ``K0, V0``) to ``K, V`` (see the module's
    docstring, step 2); none at the same padded dims."""
    template = _template(kernel)
    legal = get_kernel(kernel).legal_params()
    padded = {"K": next_power_of_2(K), "V": next_power_of_2(V)}
    grow = next_power_of_2(K) // next_power_of_2(K0) if next_power_of_2(K) > next_power_of_2(K0) else 1
    changes: list[Change] = []
    for name, t in TILES.get(template, {}).items():
        value = config.get(name)
        if not isinstance(value, int) or value == 0 or not t.used(config):
            continue
        new, why = value, ""
        if t.state and grow > 1 and value // grow >= 1:
            new, why = _largest(legal[name], max(t.floor, value // grow)), f"K {K0}→{K}: same state tile size"
        limit = max(t.floor, padded[t.dim])
        if new > limit:
            new, why = _largest(legal[name], limit), f"{t.dim} = {K if t.dim == 'K' else V}: tile cut to the padded dim"
        if new != value:
            changes.append(Change(name, value, new, why))
    if grow > 1:
        for name in ROW_STAGES.get(template, ()):
            value = config.get(name)
            if isinstance(value, int) and value > 1:
                new = _largest(legal[name], max(1, value // grow))
                if new != value:
                    changes.append(Change(name, value, new, f"K {K0}→{K}: same shared memory per stage"))
    return changes


# ---- the donor and the whole choice ---------------------------------------------------------------------------------


class Tuned(Protocol):
    """A tuned entry as the store holds it (:class:`dtune.store.Entry`)."""

    @property
    def kernel(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def bucket(self) -> dict[str, int]: ...
    @property
    def config(self) -> dict[str, Any]: ...


def distance(shape: Shape, bucket: Mapping[str, int], mine: Mapping[str, int] | None = None) -> tuple[float, ...]:
    """How far a tuned bucket is from ``shape`` (``mine``: its lookup bucket, when already at hand): head dims (K, then
    V), value-head ratio, then :func:`dtune.shape.bucket_distance`; ties go to the smaller bucket."""
    return (
        abs(math.log(shape.K / bucket["K"])),
        abs(math.log(shape.V / bucket["V"])),
        abs(math.log((shape.HV / shape.H) / (bucket["HV"] / bucket["H"]))),
        *bucket_distance(shape.lookup_bucket() if mine is None else mine, bucket),
    )


def bucket_text(b: Mapping[str, int]) -> str:
    return f"T{b['T']}-B{b['B']}-H{b['H']}-HV{b['HV']}-K{b['K']}-V{b['V']}"


@dataclass(frozen=True)
class Choice:
    """The config a call runs and where it came from: ``match`` is "exact" (its own bucket, verbatim) or "borrowed"
    (``bucket``'s config with ``changes``; the state pass's parameters from ``state_bucket`` when that is another)."""

    config: dict[str, Any]
    match: str
    bucket: dict[str, int]
    changes: tuple[Change, ...] = ()
    state_bucket: dict[str, int] | None = None
    source: str = ""  # the tuned-config file's name

    def describe(self) -> str:
        """One line, the match first: ``exact: h200.json T4096-B8-...`` or ``borrowed: h200.json T4096-B8-... (state
        pass from ...; SEG_CHUNKS 0→32 (...))``."""
        head = f"{self.match}: {self.source + ' ' if self.source else ''}{bucket_text(self.bucket)}"
        theirs = [c for c in self.changes if c.why == STATE_WHY]
        moved = ", ".join(f"{c.param} {c.old}→{c.new}" for c in theirs)
        parts = [f"state pass from {bucket_text(self.state_bucket)}: {moved}"] if theirs and self.state_bucket else []
        parts += [str(c) for c in self.changes if c not in theirs or not self.state_bucket]
        return head + (f" ({'; '.join(parts)})" if parts else "")


def borrow(entries: Iterable[Tuned], kernel: str, dtype: str, shape: Shape, sm_count: int | None) -> Choice | None:
    """The config for ``shape`` from ``entries`` (see the module's docstring); None when no entry has this kernel and
    dtype. ``sm_count``: the GPU's SMs (None: the donor's ``SEG_CHUNKS`` is kept)."""
    candidates = [e for e in entries if e.kernel == kernel and e.dtype == dtype]
    if not candidates:
        return None
    target = shape.lookup_bucket()
    for e in candidates:
        if dict(e.bucket) == target:
            return Choice(dict(e.config), EXACT, dict(e.bucket))
    by_distance = sorted(candidates, key=lambda e: distance(shape, e.bucket, target))
    donor = by_distance[0]
    spec = get_kernel(kernel)
    b = donor.bucket
    full = spec.check_config(b["K"], b["V"], donor.config)
    new = dict(full)
    why: dict[str, str] = {}
    for c in fit_head_dims(kernel, full, b["K"], b["V"], shape.K, shape.V):
        new[c.param], why[c.param] = c.new, c.why
    state_bucket: dict[str, int] | None = None
    if "SEG_CHUNKS" in full and sm_count is not None:
        seg, state, state_bucket = _segments(by_distance, kernel, new, shape, target, sm_count)
        for name, value in state.items():
            new[name], why[name] = value, STATE_WHY
        programs = state_programs(target["B"], shape.HV, shape.V, int(new["h_BV"]))
        new["SEG_CHUNKS"], why["SEG_CHUNKS"] = (
            seg,
            (
                f"{target['B']} sequence(s) × {shape.HV} value heads of {target['T']} tokens: {programs} state-pass "
                f"programs for {sm_count} SMs"
            ),
        )
        if seg == 0:  # the segment phases' parameters are unused: the template's defaults
            default = spec.default_config(shape.K, shape.V)
            for name in SEGMENT_ONLY:
                if name in new and new[name] != default[name]:
                    new[name], why[name] = default[name], "no segments"
    if "dh_SEG_CHUNKS" in full:
        for name, (value, reason) in reverse_pass(new, target, shape.HV, shape.V, sm_count, b).items():
            new[name], why[name] = value, reason
    changes = tuple(Change(n, full[n], new[n], why.get(n, "")) for n in new if new[n] != full[n])
    config = {**donor.config, **{c.param: c.new for c in changes}}
    return Choice(config, BORROWED, dict(b), changes, state_bucket)


# The backward's reverse state pass: the transposed layout needs state tiles of at least 64 value rows (the search
# spaces' dh_vk_rows); segments only for sequences of 8192 tokens or more whose plain pass leaves SMs idle
# (dh_seg_underfilled), split into more than one segment (dh_seg_splits); 64 chunks when the donor had none (H200,
# B = 1, T = 32768, chunk 64: 1.4-1.5x the plain pass in the training step, benchmarks/bwd_variants.py).
VK_MIN_ROWS = 64
REVERSE_SEG_START = 64


def reverse_pass(
    config: Mapping[str, Any],
    target: Mapping[str, int],
    HV: int,
    V: int,
    sm_count: int | None,
    donor: Mapping[str, int] | None = None,
) -> dict[str, tuple[Any, str]]:
    """The backward's reverse-pass parameters for the target bucket (``dh_LAYOUT``, ``dh_SEG_CHUNKS``): what changes,
    with why. ``sm_count`` None: the donor's segments are kept where they still split the sequence. ``donor``: the
    donor's bucket (B, T, HV); a segmented donor's segment length is scaled so that the target runs as many
    segmented programs as the donor was tuned to (more sequences or value heads: longer segments)."""
    out: dict[str, tuple[Any, str]] = {}
    dh_BV = int(config["dh_BV"])
    if config["dh_LAYOUT"] == "vk" and dh_BV < VK_MIN_ROWS:
        out["dh_LAYOUT"] = ("kv", f"dh_BV = {dh_BV}: the transposed layout needs {VK_MIN_ROWS} value rows")
    N, T, BT, seg = target["B"], target["T"], int(config["BT"]), int(config["dh_SEG_CHUNKS"])
    tiles = math.ceil(V / max(16, min(dh_BV, next_power_of_2(V))))
    programs = N * HV * tiles
    if sm_count is not None:
        want = T >= MIN_SEGMENTED_TOKENS and programs < sm_count
        if not want:
            seg = 0
        elif seg == 0:
            seg = REVERSE_SEG_START
        elif donor is not None:  # the donor's programs (sequences x segments x value heads x tiles) kept
            donor_programs = donor["B"] * donor["HV"] * tiles * math.ceil(donor["T"] / (BT * seg))
            segments = max(donor_programs / programs, 2.0)
            seg = segment_length(math.ceil(T / BT), segments)
    while seg > SEG_RANGE[0] and seg * BT >= T:  # at least two segments per sequence
        seg //= 2
    if seg * BT >= T:
        seg = 0
    if seg != int(config["dh_SEG_CHUNKS"]):
        fill = f"{N} sequence(s) × {HV} value heads of {T} tokens: {programs} reverse-pass programs"
        out["dh_SEG_CHUNKS"] = (seg, fill + (f" for {sm_count} SMs" if sm_count is not None else ""))
    if seg == 0 and config.get("dh_SEG_DECAY") is True:  # unused without segments: the default (False) then
        out["dh_SEG_DECAY"] = (False, "no segments")
    return out


def _segments(
    by_distance: Sequence[Tuned], kernel: str, fitted: Mapping[str, Any], shape: Shape, target: Mapping[str, int],
    sm_count: int,
) -> tuple[int, dict[str, Any], dict[str, int] | None]:  # fmt: skip
    """``SEG_CHUNKS`` by the rule for ``fitted`` (the donor's config fitted to the head dims) and, when the donor's
    regime (segmented or not) differs from the rule's, the state pass's parameters (:data:`STATE_PASS`, fitted to the
    head dims) of the nearest entry whose regime agrees: ``(SEG_CHUNKS, those parameters, that entry's bucket)``, or
    ``(SEG_CHUNKS, {}, None)``."""
    N, T, BT = target["B"], target["T"], int(fitted["BT"])

    def rule(h_BV: int) -> int:
        return segment_chunks(N, shape.HV, shape.V, T, BT, h_BV, sm_count)

    seg = rule(int(fitted["h_BV"]))
    if (seg > 0) == (int(fitted["SEG_CHUNKS"]) > 0):
        return seg, {}, None
    spec = get_kernel(kernel)
    for other in by_distance[1:]:
        ob = other.bucket
        theirs = spec.check_config(ob["K"], ob["V"], other.config)
        if (int(theirs["SEG_CHUNKS"]) > 0) != (seg > 0):
            continue
        fit = {c.param: c.new for c in fit_head_dims(kernel, theirs, ob["K"], ob["V"], shape.K, shape.V)}
        state = {name: fit.get(name, theirs[name]) for name in STATE_PASS}
        seg2 = rule(int(state["h_BV"]))
        if (seg2 > 0) != (seg > 0):  # with their V tile the plain pass fills the GPU the other way: keep the donor's
            break
        return seg2, {n: v for n, v in state.items() if v != fitted[n]}, dict(ob)
    return seg, {}, None
