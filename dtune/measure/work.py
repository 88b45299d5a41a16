"""The one FLOP and byte model of the delta-rule kernels (one per kernel family), and how far a time is from its floor.

Every achieved GB/s and TFLOP/s dtune reports — a trial's in ``trials.csv``, ``dtune bench``'s, ``dtune
profile``'s whole-op row, the HTML report's roofline — is this model over the measured time. (The chunk pipeline's
per-stage rows in ``dtune profile`` use the stage cost model of ``dtune.kernels.chunk.plan``.) Nominal, as in
docs/DESIGN.md and docs/anchors/fla-0.6.0_h200.md, so numbers compare across configs and with fla:

* chunk FLOPs per token per value head: ``2C(3K + 2V) + 6KV`` with a nominal chunk ``C = 64`` (whatever chunk
  size a config uses: the work is the same problem);
* fused-recurrent FLOPs per token per value head: ``6KV`` (predict ``Sᵀk``, rank-1 write, read ``Sᵀq``), plus
  ``KV`` for the decay when gated;
* compulsory bytes: q, k, v, o and beta in the input dtype, the gate ``g`` in float32, and the float32 state
  (``4·K·V`` bytes per value head per sequence) when an initial state is read or a final state written — at
  decode (T = 1) that state traffic, ``8·K·V`` bytes per head per step, is the roofline.

The floor of a call is ``max(bytes / bandwidth, FLOPs / matmul rate)`` against :class:`Roofs`: the GPU's
ceilings measured in the same run (:func:`dtune.measure.ceilings`) or taken from its profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dtune.shape import Gate, Shape

NOMINAL_CHUNK = 64
GATE_BYTES = 4  # gates are kept in float32
STATE_BYTES = 4  # the state is float32

__all__ = [
    "NOMINAL_CHUNK",
    "Roofs",
    "Work",
    "chunk_flops",
    "describe",
    "io_bytes",
    "recurrent_flops",
    "work",
]


@dataclass(frozen=True)
class Work:
    """What one call must do: nominal FLOPs and compulsory bytes."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else math.inf

    def tflops(self, ms: float) -> float:
        """Achieved TFLOP/s at ``ms`` milliseconds per call."""
        return self.flops / (ms * 1e-3) / 1e12 if ms > 0 else math.nan

    def gbs(self, ms: float) -> float:
        """Achieved GB/s of compulsory bytes at ``ms`` milliseconds per call."""
        return self.bytes / (ms * 1e-3) / 1e9 if ms > 0 else math.nan

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class Roofs:
    """A GPU's ceilings: bandwidth in GB/s and matmul rate in TFLOP/s, and where they came from."""

    gbs: float
    tflops: float
    source: str  # "measured" | "profile:<key>" | ...

    @classmethod
    def from_ceilings(cls, ceilings: dict[str, float]) -> Roofs:
        """From :func:`dtune.measure.ceilings`'s dict (``copy_gbs``, ``bf16_tflops``)."""
        return cls(float(ceilings["copy_gbs"]), float(ceilings["bf16_tflops"]), "measured")

    @classmethod
    def from_profile(cls, profile: Any) -> Roofs:
        """From a :class:`dtune.gpu.GpuProfile` or its dict (``hbm_gbs``, ``bf16_tflops``, ``key``)."""
        get = profile.get if isinstance(profile, dict) else lambda name, default=None: getattr(profile, name, default)
        return cls(float(get("hbm_gbs", 0.0)), float(get("bf16_tflops", 0.0)), f"profile:{get('key', '?')}")

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the memory roof meets the compute roof."""
        return self.tflops * 1e12 / (self.gbs * 1e9)

    def floor_ms(self, w: Work) -> float:
        """The least time the call can take: its bytes at full bandwidth or its FLOPs at full matmul rate."""
        return max(self.memory_ms(w), self.compute_ms(w))

    def memory_ms(self, w: Work) -> float:
        return w.bytes / (self.gbs * 1e9) * 1e3

    def compute_ms(self, w: Work) -> float:
        return w.flops / (self.tflops * 1e12) * 1e3

    def bound(self, w: Work) -> str:
        """``"memory"`` or ``"compute"``: which roof sets the floor."""
        return "memory" if self.memory_ms(w) >= self.compute_ms(w) else "compute"

    def attainable_tflops(self, intensity: float) -> float:
        """The roofline: min(matmul rate, intensity × bandwidth), in TFLOP/s."""
        return min(self.tflops, intensity * self.gbs / 1e3)


def _tokens(p: Shape) -> int:
    return p.B * p.T


def chunk_flops(p: Shape, chunk: int = NOMINAL_CHUNK) -> float:
    """Nominal FLOPs of the chunkwise forward: ``tokens · HV · (2C(3K + 2V) + 6KV)``."""
    return float(_tokens(p) * p.HV * (2 * chunk * (3 * p.K + 2 * p.V) + 6 * p.K * p.V))


def recurrent_flops(p: Shape) -> float:
    """Nominal FLOPs of the token-by-token recurrence: ``tokens · HV · (6KV [+ KV decay])``."""
    per = 6 * p.K * p.V + (p.K * p.V if p.gate is not Gate.NONE else 0)
    return float(_tokens(p) * p.HV * per)


def io_bytes(
    p: Shape,
    dtype: torch.dtype,
    initial_state: bool = False,
    final_state: bool = False,
) -> float:
    """Compulsory bytes: q, k (H heads), v, o, beta (HV heads) in ``dtype``, g in float32, the float32 state."""
    e = torch.tensor([], dtype=dtype).element_size()
    tok = _tokens(p)
    qk = 2 * tok * p.H * p.K * e
    vo = 2 * tok * p.HV * p.V * e
    beta = tok * p.HV * e
    g_width = {Gate.NONE: 0, Gate.SCALAR: 1, Gate.CHANNEL: p.K}[p.gate]
    g = tok * p.HV * g_width * GATE_BYTES
    state = p.N * p.HV * p.K * p.V * STATE_BYTES * (int(initial_state) + int(final_state))
    return float(qk + vo + beta + g + state)


FLOP_MODELS = {"chunk": chunk_flops, "fused_recurrent": recurrent_flops}  # by kernel family


def work(
    kernel: str,
    p: Shape,
    dtype: torch.dtype,
    initial_state: bool = False,
    final_state: bool = False,
) -> Work:
    """The nominal work of one call of ``kernel`` (``chunk_*`` or ``fused_recurrent_*``) on shape ``p``."""
    family = "chunk" if kernel.startswith("chunk") else "fused_recurrent"
    return Work(FLOP_MODELS[family](p), io_bytes(p, dtype, initial_state, final_state))


def describe(ms: float, w: Work, roofs: Roofs | None) -> str:
    """How far ``ms`` is from the floor, e.g. ``"3.1× floor, memory-bound"``; ``""`` without roofs."""
    if roofs is None or not (ms > 0) or math.isnan(ms):
        return ""
    floor = roofs.floor_ms(w)
    if floor <= 0:
        return ""
    return f"{ms / floor:.1f}× floor, {roofs.bound(w)}-bound"
