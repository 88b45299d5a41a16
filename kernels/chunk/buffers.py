"""The buffers of one chunk forward: outputs, the intermediates the stages pass on, the segment scratch.

Layouts are token-major like the inputs (``tokens = B · T`` rows, the packed batch for varlen); ``dt`` is the
intermediates' dtype (the inputs' promoted dtype: float32 stays float32, 16-bit inputs keep 16-bit intermediates).
Every buffer comes from :func:`~dtune.kernels.config.new_output`, so the correctness gate's poisoning NaN-fills
the intermediates too: an element a stage fails to write and a later stage reads shows up as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import new_output
from .call import ChunkCall

Tensor = torch.Tensor


@dataclass
class Intermediates:
    """What the forward stages hand each other (and what a backward pass recomputes from).

    With chunk ``c`` of ``C = BT`` tokens, ``γ`` the cumulative log gate inside the chunk (clamped at −20 per step,
    see ``common.GATE_FLOOR``) and ``T = (I + A_kk)⁻¹`` (docs/DESIGN.md §1):

    * ``w`` ``[tokens, HV, K]`` dt: ``W = T (β ⊙ K ⊙ exp(γ))``
    * ``u`` ``[tokens, HV, V]`` dt: ``U = T (β ⊙ V)``
    * ``aqk`` ``[tokens, HV, BT]`` dt: row ``i`` of the chunk holds ``scale · A_qk[i, :]`` (causal, zeros right of
      the diagonal, columns are the chunk's tokens)
    * ``ai`` ``[tokens, HV, BT]`` dt: row ``i`` of the chunk holds row ``i`` of ``T`` (zeros right of the diagonal)
      — only with ``WU = "recomputed"``, where ``w`` and ``u`` are None (the state pass forms ``V_new`` from T and
      the inputs; KDA: ``w`` then holds ``P = β ⊙ K ⊙ exp(γ)``, W's operand, and ``u`` is None: the state pass forms
      ``V_new = T (β ⊙ V − P S)``); ``aqk`` is None with ``AQK = "recomputed"`` (the state pass forms it from q and k)
    * ``qg``, ``kg`` ``[tokens, HV, K]`` dt (KDA only, else None): ``q̃ = scale · q ⊙ exp(γ)``,
      ``k̃ = k ⊙ exp(γ_C − γ)``
    * ``gout``: Gated DeltaNet ``[tokens, HV]`` float32 ``γ`` (cumulative inside each chunk); KDA ``[NC, HV, K]``
      float32 ``exp(γ_C)`` per chunk; DeltaNet None
    * ``h`` ``[NC, HV, K, V]`` dt: the state entering each chunk; ``v_new`` ``[tokens, HV, V]`` dt:
      ``V_new = U − W S_c`` — both only without ``FUSE_OUTPUT`` (else None: the fused state pass keeps them in
      registers)
    * ``flags`` ``[NC · HV]`` int32: the guarded diagonal's marks (KDA with ``SAFE_DIAG``: chunks the first intra
      pass found too steep for the middle-row dot, which the second pass redoes exactly), else None
    * ``rnorm`` ``[2, tokens, H]`` float32: the l2norm's factors ``1 / sqrt(Σ x² + eps)`` of q's (``[0]``) and k's
      (``[1]``) rows, stored by stage 1 for the state and output passes (fla's ``use_qk_l2norm_in_kernel``, DeltaNet
      and Gated DeltaNet; KDA's q̃ and k̃ come normalised), else None

    Chunk ``c``'s rows start at token ``chunk_info[c, 0]`` (varlen) or ``(c // ⌈T/BT⌉) · T + (c mod ⌈T/BT⌉) · BT``.
    """

    w: Tensor | None
    u: Tensor | None
    aqk: Tensor | None
    qg: Tensor | None
    kg: Tensor | None
    gout: Tensor | None
    h: Tensor | None
    v_new: Tensor | None
    flags: Tensor | None
    ai: Tensor | None = None
    rnorm: Tensor | None = None

    def rnorm_args(self) -> dict[str, Tensor]:
        """The kernels' ``rq``, ``rk`` arguments (none without the stored factors)."""
        return {} if self.rnorm is None else {"rq": self.rnorm[0], "rk": self.rnorm[1]}


@dataclass
class Outputs:
    o: Tensor  # [B, T, HV, V], v's dtype
    final_state: Tensor | None  # [N, HV, K, V] float32


@dataclass
class SegmentScratch:
    """Float32 scratch of the sequence-parallel state pass (``NS`` segments).

    ``transitions[s, hv]`` is ``[K, V + K]``: columns ``:V`` hold ``N_s`` (the segment's state pass from zero),
    columns ``V:`` hold ``M_s`` (the segment's transition, K × K), so that ``S_end = M_s S_start + N_s``.
    ``starts[s, hv]`` ``[K, V]`` is the true state entering segment ``s``.
    """

    transitions: Tensor
    starts: Tensor


def allocate(call: ChunkCall) -> tuple[Intermediates, Outputs]:
    """Every intermediate and output buffer of ``call`` (uninitialised, or NaN when outputs are poisoned)."""
    dev, dt, tokens, HV, K, V = call.device, call.dt, call.tokens, call.HV, call.K, call.V
    NC1 = max(call.NC, 1)
    o = new_output(call.B, call.T, HV, V, dtype=call.v.dtype, device=dev)
    ht = new_output(call.N, HV, K, V, dtype=torch.float32, device=dev) if call.output_final_state else None
    qg = kg = gout = None
    if call.gate == 2:
        qg = new_output(tokens, HV, K, dtype=dt, device=dev)
        kg = new_output(tokens, HV, K, dtype=dt, device=dev)
        gout = new_output(NC1, HV, K, dtype=torch.float32, device=dev)
    elif call.gate == 1:
        gout = new_output(tokens, HV, dtype=torch.float32, device=dev)
    two_pass = call.gate == 2 and bool(call.config.get("SAFE_DIAG", True))  # the guarded KDA diagonal's marks
    stored = not call.recompute
    inter = Intermediates(
        w=new_output(tokens, HV, K, dtype=dt, device=dev) if stored or call.gate == 2 else None,  # (KDA recomputed: P)
        u=new_output(tokens, HV, V, dtype=dt, device=dev) if stored else None,
        aqk=None if call.recompute_qk else new_output(tokens, HV, call.BT, dtype=dt, device=dev),
        qg=qg,
        kg=kg,
        gout=gout,
        h=None if call.fuse else new_output(NC1, HV, K, V, dtype=dt, device=dev),
        v_new=None if call.fuse else new_output(tokens, HV, V, dtype=dt, device=dev),
        flags=torch.empty(NC1 * HV, dtype=torch.int32, device=dev) if two_pass else None,
        ai=None if stored else new_output(tokens, HV, call.BT, dtype=dt, device=dev),
        rnorm=new_output(2, tokens, call.H, dtype=torch.float32, device=dev)
        if call.in_kernel.l2norm and call.gate != 2
        else None,
    )
    return inter, Outputs(o, ht)


def allocate_segments(call: ChunkCall) -> SegmentScratch | None:
    """The segment scratch, or None when the call runs the plain state pass."""
    seg = call.tables.segments
    if seg is None:
        return None
    HV, K, V = call.HV, call.K, call.V
    return SegmentScratch(
        transitions=new_output(seg.NS, HV, K, V + K, dtype=torch.float32, device=call.device),
        starts=new_output(seg.NS, HV, K, V, dtype=torch.float32, device=call.device),
    )


def tensors_of(*objs: object) -> list[Tensor | None]:
    """Every tensor field of ``objs`` (dataclasses: a call, its tables and options, its buffers), nested dataclasses
    walked, in field order, with None where a field is None: the call's tensors as the launch cache locates pointers
    in them (the same order for calls of one signature)."""
    out: list[Tensor | None] = []
    for obj in objs:
        if obj is None:
            out.append(None)
            continue
        for name in _tensor_fields(obj):
            value = getattr(obj, name)
            if value is None or isinstance(value, Tensor):
                out.append(value)
            elif hasattr(type(value), "__dataclass_fields__"):
                out.extend(tensors_of(value))
            # (else a field None on the class's first instance and a number here: an option's value, in the key)
    return out


_FIELDS: dict[type, tuple[str, ...]] = {}


def _tensor_fields(obj: object) -> tuple[str, ...]:
    """The fields of ``obj``'s class that hold a tensor, a dataclass or None (an optional one): the others (ints,
    strings, the config) are read once per class, on its first instance."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        keep = []
        for f in fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            if value is None or isinstance(value, Tensor) or hasattr(type(value), "__dataclass_fields__"):
                keep.append(f.name)
        names = _FIELDS[cls] = tuple(keep)
    return names
