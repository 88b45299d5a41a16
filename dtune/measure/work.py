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
    "chunk_bwd_flops",
    "chunk_flops",
    "describe",
    "grad_bytes",
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


def chunk_bwd_flops(p: Shape, chunk: int = NOMINAL_CHUNK) -> float:
    """Nominal FLOPs of the chunkwise backward (given the forward's chunk states): ``tokens · HV · (8C(K + V) +
    12KV)``. Per chunk of ``C`` tokens, counted as full ``C × C`` products like the forward's: the reverse state pass
    ``dV_new = A_qkᵀ dO + k̃ X`` and ``X ← X + q̃ᵀ dO − Wᵀ dV_new`` (``CV + 3KV`` multiply-adds per token), the
    ``V`` contractions ``dA_qk = dO V_newᵀ``, ``dVβ = Tᵀ dV_new``, ``dA_kk = dVβ V_newᵀ`` (``3CV``), the state
    contractions ``dO S_cᵀ``, ``V_new Xᵀ``, ``dVβ S_cᵀ`` (``3KV``) and the pairwise terms ``dA_qk k``, ``dA_qkᵀ q``,
    ``dA_kkᵀ (βk)``, ``dA_kk k`` (``4CK``)."""
    return float(_tokens(p) * p.HV * (8 * chunk * (p.K + p.V) + 12 * p.K * p.V))


def grad_bytes(p: Shape, dtype: torch.dtype, initial_state: bool = False, final_state: bool = False) -> float:
    """Compulsory bytes of the backward: read q, k, v, beta, g and the output's gradient, write dq, dk, dv, dbeta, dg
    (as :func:`io_bytes` counts them: the same sizes), read the final state's gradient and write the initial
    state's (float32) when there are such states."""
    return io_bytes(p, dtype, initial_state, final_state) + io_bytes(p, dtype) - _o_bytes(p, dtype)


def _o_bytes(p: Shape, dtype: torch.dtype) -> float:
    return float(_tokens(p) * p.HV * p.V * torch.tensor([], dtype=dtype).element_size())


FLOP_MODELS = {"chunk": chunk_flops, "fused_recurrent": recurrent_flops}  # by kernel family


def work(
    kernel: str,
    p: Shape,
    dtype: torch.dtype,
    initial_state: bool = False,
    final_state: bool = False,
) -> Work:
    """The nominal work of one call of ``kernel`` on shape ``p``; for a backward kernel (``chunk_*_bwd``) of its
    measured call, the training step: the forward's work plus the backward's (:func:`chunk_bwd_flops`,
    :func:`grad_bytes`)."""
    from dtune.kernels import KERNELS

    spec = KERNELS.get(kernel)
    # a family without a model of its own (a plugin's, an unregistered name) is counted as its name says: chunk_*,
    # else token by token
    named = chunk_flops if kernel.startswith("chunk") else recurrent_flops
    model = FLOP_MODELS.get(spec.family, named) if spec is not None else named
    fwd = Work(model(p), io_bytes(p, dtype, initial_state, final_state))
    if spec is None or not spec.backward:
        return fwd
    return fwd + Work(chunk_bwd_flops(p), grad_bytes(p, dtype, initial_state, final_state))


def describe(ms: float, w: Work, roofs: Roofs | None) -> str:
    """How far ``ms`` is from the floor, e.g. ``"3.1× floor, memory-bound"``; ``""`` without roofs."""
    if roofs is None or not (ms > 0) or math.isnan(ms):
        return ""
    floor = roofs.floor_ms(w)
    if floor <= 0:
        return ""
    return f"{ms / floor:.1f}× floor, {roofs.bound(w)}-bound"


# ---- the training step, stage by stage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StageWork:
    """One launch of a pipeline: its name, the Triton kernel it runs (what a profiler reports) and its work."""

    name: str
    kernel: str
    work: Work


def _segments(p: Shape, C: int, seg_chunks: int) -> tuple[int, int] | None:
    """(segments, tokens of the inner segments) of a sequence-parallel pass with ``seg_chunks`` chunks of ``C`` per
    segment (sequences of ``tokens / N`` tokens), or None where no sequence has two segments (the plain pass runs)."""
    if seg_chunks <= 0 or p.N <= 0:
        return None
    length = _tokens(p) // p.N
    chunks = -(-length // C)
    per_seq = -(-chunks // seg_chunks)
    if per_seq < 2:
        return None
    return p.N * per_seq, _tokens(p) - p.N * min(length, seg_chunks * C)


def backward_stages(
    p: Shape,
    dtype: torch.dtype,
    fwd_config: dict[str, Any],
    bwd_config: dict[str, Any],
    initial_state: bool = True,
    final_state: bool = True,
) -> list[StageWork]:
    """The floors of the chunk training step (forward under autograd, then the backward), stage by stage: nominal
    FLOPs (full ``C × C`` products, ``C = BT`` of the backward config) and the bytes each launch must move, its
    intermediates included (W, U, A_qk, T and KDA's q̃, k̃ written by the forward's stage 1; the chunk states ``S``
    and their adjoints ``X``, ``[chunks, HV, K, V]``; ``V_new``, ``dV_new``; unfused, ``dVβ`` and both dA), for the
    pipeline that ``fwd_config`` and ``bwd_config`` (complete configs) launch. ``kernel`` names the Triton kernel, so
    that a profiler's per-kernel times (``dtune profile --mode fwd+bwd``) can be set against these floors.

    Against the compulsory bytes of :func:`work` (a floor no pipeline reaches), these count what this pipeline moves:
    a stage far above its own floor is the one to improve.
    """
    e = torch.tensor([], dtype=dtype).element_size()
    f = 4
    C = int(bwd_config["BT"])
    K, V, gate = p.K, p.V, p.gate
    tq = _tokens(p) * p.H  # token-heads of q and k
    ta = _tokens(p) * p.HV  # token-heads of v, the intermediates and the gradients
    chunks = p.B * -(-p.T // C) if not p.varlen else -(-_tokens(p) // C) + p.N
    S = chunks * p.HV * K * V * e  # the chunk states (or their adjoints) in the intermediates' dtype
    state_io = p.N * p.HV * K * V * f
    g_in = {Gate.NONE: 0, Gate.SCALAR: ta * f, Gate.CHANNEL: ta * K * f}[gate]
    kda = gate is Gate.CHANNEL
    qk = 2 * tq * K * e
    kq_tilde = 2 * ta * K * e if kda else qk + (ta * f if gate is Gate.SCALAR else 0)  # q̃, k̃ (or q, k and γ)
    k_tilde = ta * K * e if kda else qk / 2 + (ta * f if gate is Gate.SCALAR else 0)
    save = bwd_config["SAVE"]
    fused_out = bool(fwd_config.get("FUSE_OUTPUT", True))  # with SAVE = "all" the fused pass stores S, V_new too
    NK = -(-K // min(int(bwd_config["dqk_BK"]), max(16, 1 << (K - 1).bit_length())))
    # programs of the dq/dk stage doing its value side (dA, dVβ; KDA's dA copy): every key tile's, or with dqk_KLOOP one
    # per chunk (which then writes dVβ over dV_new: one more [tokens, V] store)
    kloop = bool(bwd_config.get("dqk_KLOOP", False)) and NK > 1
    NVS = 1 if kloop else NK
    out: list[StageWork] = []

    def add(name: str, kernel: str, flops: float, nbytes: float) -> None:
        out.append(StageWork(name, kernel, Work(float(flops), float(nbytes))))

    # stage 1 of the forward under autograd (and of its re-run): KDA's one-pass kernel where fh_INTRA says so (its
    # diagonal guard's redo of the few flagged chunks by the blocks kernel is left unfloored)
    onepass = kda and bwd_config.get("fh_INTRA") == "onepass"
    intra_kernel = "chunk_intra_onepass_kernel" if onepass else "chunk_intra_blocks_kernel"
    intra_flops = ta * 2 * (3 * C * K + C * V + C * C / 3)
    # fh_U = "recomputed": stage 1 writes no U; the state pass reads T and v instead of W and U, one more product
    u_rec = bwd_config.get("fh_U") == "recomputed"
    # fh_W = "recomputed": no W written (the reverse pass forms its product from K and dVβ: no W read either);
    # fh_AQK = "recomputed": no A_qk written, the fused output and the reverse pass form it from q and k (one product)
    w_rec = u_rec and bwd_config.get("fh_W") == "recomputed"
    aqk_rec = bwd_config.get("fh_AQK") == "recomputed"
    intra_flops -= ta * 2 * C * K * (w_rec + aqk_rec)
    w_out = 0 if w_rec else K
    intra_bytes = qk + ta * (V * e + e) + g_in + ta * (w_out + (0 if u_rec else V) + (1 if aqk_rec else 2) * C) * e
    intra_bytes += 2 * ta * K * e if kda else 0
    state_flops = ta * 2 * (2 * K * V + (C * V if u_rec else 0))
    state_bytes = ta * ((C if u_rec else K) + V) * e + k_tilde
    out_flops = ta * 2 * (K * V + C * V)
    # sequence-parallel passes: the forward's (its config's SEG_CHUNKS, as long in tokens at the backward's chunk) and
    # the reverse pass's (dh_SEG_CHUNKS); the inner segments (all but one per sequence) run phase 1
    fseg = int(fwd_config.get("SEG_CHUNKS", 0))
    fseg = max(1, fseg * int(fwd_config.get("BT", C)) // C) if fseg > 0 else 0
    fwd_seg = _segments(p, C, fseg)
    rev_seg = _segments(p, C, int(bwd_config.get("dh_SEG_CHUNKS", 0)))
    starts_io = 0.0
    if fwd_seg is not None:
        NS, inner = fwd_seg
        ti = inner * p.HV
        ext = NS * p.HV * K * (V + K) * f
        starts_io = NS * p.HV * K * V * f
        fwd_phase1 = (ti * 4 * K * (V + K), ti * K * (2 * e if kda else e) + ti * V * e + ext)
        fwd_phase2 = (NS * p.HV * 2 * K * K * V, ext + 2 * starts_io)
    # forward under autograd
    add("fwd intra (W, U, A_qk, T)", intra_kernel, intra_flops, intra_bytes)
    if fwd_seg is not None:
        add("fwd transitions", "chunk_state_kernel", *fwd_phase1)
        add("fwd segment starts", "chunk_segment_starts_regs_kernel", *fwd_phase2)
    if fused_out or aqk_rec:  # (fh_AQK forces the fused output)
        fwd_state = state_bytes + (0 if aqk_rec else ta * C * e) + (ta * K * e if kda else qk / 2) + ta * V * e
        fwd_state += starts_io + (S + ta * V * e if save == "all" else 0)
        fwd_flops = state_flops + out_flops + (ta * 2 * C * K if aqk_rec else 0)
        add("fwd state + output", "chunk_state_kernel", fwd_flops, fwd_state + state_io * final_state)
    else:
        fwd_state = state_bytes + S + ta * V * e + state_io * final_state + starts_io
        add("fwd state", "chunk_state_kernel", state_flops, fwd_state)
        o_bytes = (ta * K * e if kda else qk / 2) + S + ta * (C + 2 * V) * e
        add("fwd output", "chunk_output_kernel", out_flops, o_bytes)
    # backward: the forward's intermediates again ("intra" re-runs from the kept segment starts)
    if save == "none":
        add("bwd intra re-run", intra_kernel, intra_flops, intra_bytes)
        if fwd_seg is not None:
            add("bwd transitions re-run", "chunk_state_kernel", *fwd_phase1)
            add("bwd segment starts re-run", "chunk_segment_starts_regs_kernel", *fwd_phase2)
    if save != "all":
        add("bwd state re-run (S, V_new)", "chunk_state_kernel", state_flops, state_bytes + S + ta * V * e + starts_io)
    rev_dv = bool(bwd_config.get("REVERSE_DV", False)) and bool(bwd_config["FUSE_DV"])
    n_v = -(-V // min(int(bwd_config["dh_BV"]), max(16, 1 << (V - 1).bit_length()))) if rev_dv else 1
    rev_flops = ta * 2 * (C * V + 3 * K * V + (C * K if aqk_rec else 0))
    # W, q~ and k~ (or q, k, γ), A_qk, dO
    rev_in = ta * w_out * e + kq_tilde + (0 if aqk_rec else ta * C * e) + ta * V * e
    rev_bytes = rev_in + S + ta * V * e + state_io * (initial_state + final_state)
    if rev_dv:  # dVβ = Tᵀ dV_new, dv, dβ's v part: T and v read, dv and the v part written
        rev_flops += ta * 2 * C * V
        rev_bytes += ta * C * e + ta * V * e + ta * V * e + n_v * ta * f
    if rev_seg is not None:
        NS, inner = rev_seg
        ti = inner * p.HV
        ext = NS * p.HV * K * (V + K) * f
        xend = NS * p.HV * K * V * f
        rev_in_inner = rev_in * inner / _tokens(p)
        add("bwd reverse transitions (R, P)", "chunk_bwd_state_kernel", ti * 2 * (C * V + 3 * K * (V + K)),
            rev_in_inner + ext)  # fmt: skip
        add("bwd segment ends", "chunk_bwd_segment_ends_kernel", NS * p.HV * 2 * K * K * V, ext + 2 * xend)
        rev_bytes += xend
    pair_flops = ta * 2 * 4 * C * K
    part = f if bwd_config.get("dqk_GROUP", "float32") == "float32" else e  # grouped heads' dq/dk partials
    grads_qk = 2 * ta * K * (part if p.HV != p.H else e)
    if rev_dv and bool(bwd_config.get("REVERSE_DQK", False)):
        # the dq/dk and finish stages' work in the pass: S and V_new read, q and k again (the local terms), dq, dk,
        # dβ and the gate's gradient written; no adjoints X, dVβ or dβ partials stored (nor read back)
        rev_bytes += S + ta * V * e + qk + grads_qk + ta * e + (ta * f if gate is Gate.SCALAR else 0)
        rev_bytes -= S + ta * V * e + n_v * ta * f
        rev_flops += ta * 2 * (3 * K * V + 2 * C * V) + pair_flops
        add("bwd reverse state pass + dq/dk", "chunk_bwd_state_kernel", rev_flops, rev_bytes)
        return out + _group_sum(p, e, part)
    add("bwd reverse state pass", "chunk_bwd_state_kernel", rev_flops, rev_bytes)
    gate_io = {Gate.NONE: 0, Gate.SCALAR: ta * f * (1 + NK), Gate.CHANNEL: 2 * ta * K * f}[gate]
    if bwd_config["FUSE_DV"] and rev_dv:  # dVβ read instead of dV_new; no T, v, dv, v part
        dqk_bytes = qk + ta * e + 2 * S + ta * 3 * V * e + grads_qk + gate_io + NK * ta * f
        dqk_bytes += 2 * NVS * ta * C * e if kda else 0
        dqk_flops = ta * 2 * (2 * NVS * C * V + 3 * K * V) + pair_flops
        add("bwd dq/dk (dVβ given)", "chunk_bwd_dqk_kernel", dqk_flops, dqk_bytes)
    elif bwd_config["FUSE_DV"]:
        dqk_bytes = qk + ta * e + 2 * S + ta * (4 * V + C) * e + grads_qk + ta * V * e + gate_io + (1 + NK) * ta * f
        dqk_bytes += 2 * NVS * ta * C * e if kda else 0  # KDA: each key tile's dA copy, read back by blocks
        dqk_bytes += ta * V * e if kloop else 0
        dqk_flops = ta * 2 * (3 * NVS * C * V + 3 * K * V) + pair_flops
        add("bwd dq/dk/dv (fused)", "chunk_bwd_dqk_kernel", dqk_flops, dqk_bytes)
    else:
        dv_bytes = ta * C * e + 4 * ta * V * e + ta * e + 2 * ta * V * e + 2 * ta * C * e + ta * f
        add("bwd dv, dA", "chunk_bwd_dv_kernel", ta * 2 * 3 * C * V, dv_bytes)
        dqk_bytes = qk + ta * e + 2 * S + 3 * ta * V * e + 2 * ta * C * e + grads_qk + gate_io + NK * ta * f
        add("bwd dq/dk", "chunk_bwd_dqk_kernel", ta * 2 * 3 * K * V + pair_flops, dqk_bytes)
    fin_bytes = (n_v + NK) * ta * f + ta * e + (ta * f * (NK + 2) if gate is Gate.SCALAR else 0)
    add("bwd finish (dβ)", "chunk_bwd_finish_kernel", 0.0, fin_bytes)
    return out + _group_sum(p, e, part)


def _group_sum(p: Shape, e: int, part: int) -> list[StageWork]:
    """Grouped value heads: dq and dk per value head (``part`` bytes each: float32, or the inputs' dtype with
    ``dqk_GROUP = "input"``) read once, summed per key head, written in ``e``."""
    if p.HV == p.H:
        return []
    nbytes = 2 * _tokens(p) * p.K * (p.HV * part + p.H * e)
    return [StageWork("bwd group sum (dq, dk)", "chunk_bwd_group_sum_kernel", Work(0.0, float(nbytes)))]
