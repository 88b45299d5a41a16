"""Backward of the chunkwise templates (DeltaNet, Gated DeltaNet, KDA): gradients of q, k, v, g, beta and the
initial state from the gradients of the output and of the final state.

Math: :mod:`dtune.kernels.reference_bwd` (the same formulas in float64 PyTorch, checked against autograd through the
token-by-token loop). Pipeline, after the forward's intermediates (saved by the forward, or recomputed here):

1. :mod:`.bwd_state` (sequential over chunks, parallel over sequences × value heads × ``dh_BV`` channels): the
   state adjoint ``X`` (``[K, dh_BV]``, or transposed with ``dh_LAYOUT = "vk"``); stores ``X_{c+1}`` per chunk and
   ``dV_new``; returns the initial state's gradient. With ``dh_SEG_CHUNKS``, sequence-parallel over segments of
   that many chunks (three phases, :mod:`.bwd_segments`: the adjoint's update is affine). With ``REVERSE_DV`` it
   also does stage 2's value-separable work (``dVβ``, ``dv``, dβ's ``v`` part) and stores ``dVβ`` for it.
2. :mod:`.bwd_dqk` (chunk × key tile × value head): with ``FUSE_DV`` (default) everything chunk-parallel in one
   stage: ``dVβ = Tᵀ dV_new`` (so ``dv``), ``dA_qk``, ``dA_kk = −dVβ V_newᵀ`` in registers, then ``dq``, ``dk``, the
   pairwise terms (KDA's per channel by blocks of ``BC`` rows, :mod:`.bwd_pairwise`) and the gate's gradient
   (KDA: ``dg`` itself); with ``dqk_KLOOP`` (chunk × value head) the key tiles in a loop, the value side once.
   Without ``FUSE_DV``, :mod:`.bwd_dv` (chunk × value head) computes ``dv`` and both dA first
   and stores them (``dVβ``, ``dA_qk``, ``dA_kk`` through memory), then :mod:`.bwd_dqk` reads them.
3. :mod:`.bwd_finish` (chunk × value head): ``dβ`` from its partials; Gated DeltaNet's ``dg``.

With ``REVERSE_DQK`` (DeltaNet, Gated DeltaNet; with ``REVERSE_DV``) stages 2 and 3 run inside stage 1, per chunk,
on the whole state per program (:mod:`.bwd_reverse_dqk`): no adjoints, ``dVβ`` or dβ partials stored, nothing
launched after the reverse pass but the group sum.

Grouped value heads (``HV = G·H``): stage 2 writes ``dq``, ``dk`` per value head (float32, or with ``dqk_GROUP =
"input"`` the inputs' dtypes: half the bytes, each partial rounded) and the group's value heads are summed at the end,
in one pass that writes the inputs' dtypes (:mod:`.bwd_group`).

Where the time goes (H200, bf16, B·T = 32768, H = 16, K = V = 128; floors per stage in
:func:`dtune.measure.work.backward_stages`): the sequential passes (the forward's state pass, its re-run with
``SAVE = "intra"``, the reverse state pass) are latency-bound chains; the chunk-parallel stages are memory-bound.
On Hopper the chunk is best 64: at ``BT = 32`` the chunk-parallel stage's dots have 32 rows and compile to
``mma.sync`` instead of wgmma (sm_90a, Triton 3.6), the chunk states and adjoints (the largest tensors moved) double
and the sequential chains are twice as long.
``FUSE_DV`` removes the dv stage's pass over ``do``, ``V_new``, ``dV_new`` and the ``dVβ``/``dA`` round trip, and
for KDA the per-channel pairwise stage and its three float32 ``[tokens, HV, K]`` partials (written, then read back):
16 of the ~68 ``[tokens, HV, 128]``-sized bf16 passes of KDA's step at ``BT = 64``.

``SAVE`` (memory against time): ``"all"``: the forward keeps stage 1's outputs (W, U, A_qk, T,
and q̃, k̃, e^{γ_C} or γ), the chunk-start states and ``V_new`` (stored by the state pass, which computes the output
too where the forward config fuses it); ``"intra"``: it keeps stage 1's outputs and the
backward re-runs the state pass; ``"none"``: the forward is the plain one (its own config) and the backward
re-runs stages 1 and 2 of the forward. With ``"all"``/``"intra"`` the forward under autograd runs stage 1 as
``INTRA = "blocks"`` (KDA with ``fh_INTRA = "onepass"``: the forward's one-pass kernel) with the backward config's
``BT``/``BC`` (it stores ``T``; so does the re-run of ``"none"``), then the forward's own state-pass
launchers: sequence-parallel where the forward config has segments (``SEG_CHUNKS``, kept as long in tokens; with
``"intra"`` the segments' entering states are kept for the re-run, which then skips phases 1 and 2); its other
parameters (tiles, warps, the state layout) from the forward config, or from the backward's ``fh_*``.

Gates: entries below :data:`GATE_FLOOR` (``-inf`` included, a full forget) are clamped to it: by the backward's
kernels at load, as the forward's kernels do (``kernels/config.py``); their
gradient is the clamp's, zero. NaN is not clamped: it reaches the gradients, as in the recurrence.

Tunable parameters (:func:`legal_params`, checked like the forward's, :func:`check_config`): ``BT``, ``BC``
(``BC <= BT <= 4·BC``), ``SAVE``, ``FUSE_DV``, the tiles, warps and pipeline stages of each backward stage
(``dh_*``, ``dv_*`` (unfused only), ``dqk_*``), ``F32_DOT`` (dots on float32 inputs); the reverse pass's layout
``dh_LAYOUT``, segments ``dh_SEG_CHUNKS`` and ``REVERSE_DV``; KDA's pairwise block rows ``dqk_BC``; the forward state pass's tiles
under autograd ``fh_*`` (its loads by TMA: ``fh_TMA``), stage 1's ``fi_*``; KDA's stage 1 under autograd ``fh_INTRA``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch
import triton

from ..config import GATE_CODES, GATE_FLOOR, Config, new_output, next_power_of_2
from ..config import check_config as _check
from .buffers import Intermediates as FwdIntermediates
from .buffers import Outputs, SegmentScratch, allocate_segments
from .bwd_dqk import chunk_bwd_dqk_kernel
from .bwd_dqk import descriptors as dqk_descriptors
from .bwd_dv import chunk_bwd_dv_kernel
from .bwd_finish import chunk_bwd_finish_kernel
from .bwd_group import launch_group_sum
from .bwd_state import launch_reverse
from .call import prepare_call, register_cap
from .call import tile as _tile
from .intra_blocks import chunk_intra_blocks_kernel
from .intra_kda import chunk_intra_onepass_kernel
from .output import launch_output
from .pipeline import Stage
from .pipeline import forward as chunk_forward
from .segments import launch_segment_starts
from .state import burns_in, launch_state, launch_transitions
from .tables import build_tables, host_offsets

Tensor = torch.Tensor

_COMMON: dict[str, tuple[Any, ...]] = {
    "BT": (16, 32, 64, 128),
    "BC": (16, 32, 64),
    "SAVE": ("none", "intra", "all"),
    "FUSE_DV": (True, False),
    "REVERSE_DV": (False, True),  # (with FUSE_DV) dVβ, dv and dβ's v part in the reverse pass, off its chain
    "dh_BV": (16, 32, 64, 128),
    "dh_num_warps": (1, 2, 4, 8, 16),
    "dh_num_stages": (1, 2, 3, 4),
    "dh_LAYOUT": ("kv", "vk"),
    "dh_SEG_CHUNKS": (0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
    # ... and its loads: by pointers (False), or its tiles by TMA tensor descriptors (True, on shapes that allow them:
    # K a power of two, dh_BV dividing V; the sequence-parallel pass's phase 3, not its phase 1)
    "dh_TMA": (False, True),
    # ... and its store of each chunk's adjoint (read by the dq/dk stage): by pointers (False), or the whole [K, dh_BV]
    # tile by one TMA store (True, where K is a power of two and dh_BV divides V): no layout conversion through
    # shared memory and its two barriers on the pass's sequential chain (sm_90a, Triton 3.6, Gated DeltaNet's
    # shipped B8 entry: 69 -> 60 bar.sync; DeltaNet's with dh_TMA: 68 -> 58 and spills 136 -> 24 bytes)
    "dh_STORE_TMA": (False, True),
    # ... and its chain's last product: subtracted from the adjoint after the dot (False), or accumulated into it by the
    # dot, an operand negated (True): the same sums, one float32 tile fewer alive, another register allocation
    "dh_ACC": (False, True),
    "dv_BV": (16, 32, 64, 128),
    "dv_num_warps": (1, 2, 4, 8),
    "dv_num_stages": (1, 2, 3, 4),
    "dqk_BK": (16, 32, 64, 128),
    "dqk_BV": (16, 32, 64, 128),
    "dqk_num_warps": (1, 2, 4, 8),
    "dqk_num_stages": (1, 2, 3, 4),
    # the dq/dk stage's key tiles: one program each (False), or in a loop inside one program per chunk (True): the
    # value side (dVβ, dv, both dA, KDA's dA scratch) once per chunk instead of once per key tile
    "dqk_KLOOP": (False, True),
    # ... and its loads: by pointers (False), or its value-side and state tiles by TMA descriptors (True, fused, on
    # shapes that allow them: dqk_BK dividing K, dqk_BV dividing V)
    "dqk_TMA": (False, True),
    # ... and a cap on its registers per thread (ptx .maxnreg; 0: none, ptxas takes up to 255): at 8 warps 128 leaves
    # room for two programs per SM, at 4 warps 168 for three, so that one program's loads overlap another's epilogue
    # (one chunk's local terms and stores), at the price of spills
    "dqk_maxnreg": (0, 128, 168),
    # grouped value heads (HV = G·H): dq and dk per value head, summed over each group by the group sum, kept in float32
    # ("float32": summed exactly, rounded once) or in the inputs' dtype ("input": each partial rounded, as fla does;
    # half the bytes written by the dq/dk stage and read back by the group sum, at HV = 32, K = 128 and 32768 tokens
    # 1.07 GB less); no effect at HV = H, where the stage writes dq, dk in the inputs' dtype
    "dqk_GROUP": ("float32", "input"),
    "F32_DOT": ("ieee", "tf32"),
    # the forward's state pass under autograd and in the re-run (at the backward's BT): its value tile, warps and
    # pipeline stages, 0 = the forward config's
    "fh_BV": (0, 16, 32, 64, 128),
    "fh_num_warps": (0, 2, 4, 8),
    "fh_num_stages": (0, 1, 2, 3),
    # ... and its loads: by pointers (False), or its tiles by TMA tensor descriptors (True: the forward's STATE_TMA, on
    # shapes that allow it, else pointers)
    "fh_TMA": (False, True),
    # ... and its stores of each chunk's state and V_new (read by the backward): by pointers (False), or through TMA
    # descriptors (True: the forward's STATES_TMA, where K is a power of two and the value tile divides V): one store
    # per state tile with no layout change through shared memory on the pass's chain (the transposed "vk" tiles)
    "fh_STORE_TMA": (False, True),
    # stage 1 under autograd (and in the re-run of SAVE "none"), at the backward's BT: its key and value tiles, warps
    # and pipeline stages, 0 = the forward config's (tuned for the forward's own chunk, often smaller)
    "fi_BK": (0, 16, 32, 64, 128),
    "fi_BV": (0, 16, 32, 64, 128),
    "fi_num_warps": (0, 1, 2, 4, 8),
    "fi_num_stages": (0, 1, 2, 3),
    # ... and its diagonal sub-chunks' inverse: forward substitution ("subst", two cross-thread reductions per row), or
    # repeated squaring ("squaring", six float32 dots per 16-row block: BC = 16 only), as the forward's SOLVE
    "fi_SOLVE": ("subst", "squaring"),
}


_SCALAR: dict[str, tuple[Any, ...]] = {
    # DeltaNet, Gated DeltaNet: U = T (β ⊙ V) stored by stage 1 for the forward's state pass under autograd
    # ("stored"), or not stored, the state pass forming V_new = T (β ⊙ (V − e^γ ⊙ K S)) from T and v as the
    # forward's WU = "recomputed" does ("recomputed": stage 1 writes W and T only; the backward reads W, never U)
    "fh_U": ("stored", "recomputed"),
    # ... and W = T (β e^γ ⊙ K): stored by stage 1 for the reverse pass ("stored"), or not (stage 1 then writes T
    # alone, as the forward's WU = "recomputed"; needs fh_U = "recomputed" and REVERSE_DV): the reverse pass forms
    # Wᵀ dV_new as (β e^γ ⊙ K)ᵀ dVβ from the dVβ = Tᵀ dV_new it computes anyway, one more product on its chain
    # ("recomputed"), or forms W = T (β e^γ ⊙ K) per chunk off its chain, one more product there ("rebuilt")
    "fh_W": ("stored", "recomputed", "rebuilt"),
    # ... and A_qk: stored by stage 1 ("stored"), or formed per chunk from q and k by the state pass's fused output
    # (the forward's AQK = "recomputed") and by the reverse pass ("recomputed", off both chains: one [BT, K] x [K, BT]
    # product and BT² exponentials per chunk instead of a [tokens, BT] store and two loads)
    "fh_AQK": ("stored", "recomputed"),
    # Gated DeltaNet's dq/dk stage (fused): the decay D_ij = exp(γ_i − γ_j) applied to both dA by its pairwise terms,
    # from their bf16 copies ("pairwise"), or by the value side in float32 before their rounding ("value": one
    # rounding less, no float32 round trip there; sm_90a, the H100's B8 and B1 entries: spills 128 -> 66 and 188 -> 102
    # bytes with Triton 3.6, the GPU machines', 156 -> 118 at B8 with 3.9)
    "dqk_DECAY": ("pairwise", "value"),
    # the chunk-parallel stages (dq/dk, finish) apart (False), or their work done per chunk inside the reverse state
    # pass on the whole state (True, needs REVERSE_DV; :mod:`.bwd_reverse_dqk`): the adjoints X_{c+1} and dVβ never
    # stored or read back, the dq/dk stage's loads of the chunk states, V_new and dO gone with its launch, more work
    # on the pass's sequential programs
    "REVERSE_DQK": (False, True),
    # the forward's state pass under autograd in Gluon, warp-specialised (the forward's STATE_LOOP = "gluon",
    # kernels/chunk/state_ws.py; needs fh_U = "recomputed": its chunk states and V_new stored by TMA off the chain),
    # or Triton's loop ("range"); and its register cap (the forward's h_maxnreg: 128 runs the Gluon pass two programs
    # per SM)
    "fh_LOOP": ("range", "gluon"),
    "fh_maxnreg": (0, 128, 168),
    # the reverse state pass in Gluon, warp-specialised (kernels/chunk/bwd_state_ws.py: a TMA loader warp beside the
    # compute warps, every product a wgmma from registers; needs REVERSE_DV and fh_U = "recomputed"), or Triton's
    # ("range"); and its register cap (128 at dh_BV = 64: two programs per SM)
    "dh_LOOP": ("range", "gluon"),
    "dh_maxnreg": (0, 128, 168),
    # the dq/dk stage in Gluon, persistent and warp-specialised (kernels/chunk/bwd_dqk_ws.py: a TMA loader warp running
    # into the next chunk while 8 compute warps finish this one; needs FUSE_DV, REVERSE_DV, BT = 64 and dqk_BK = K), or
    # Triton's ("range")
    "dqk_LOOP": ("range", "gluon"),
}


_GATED_SCALAR: dict[str, tuple[Any, ...]] = {
    # Gated DeltaNet's sequence-parallel reverse pass, phase 1: every segment's P_seg computed (False), or, where a bound
    # of its norm from the segment's gates, β and key norms shows it negligible (kernels.config.SEG_SKIP_LOG: the
    # result equal to rounding), stored as zeros without walking the segment (True; the forward's SEG_DECAY)
    "dh_SEG_DECAY": (False, True),
    # the training forward's sequence-parallel state pass, the same skip in its phase 1 (the forward's SEG_DECAY, which
    # the training forward does not inherit: it is this parameter)
    "fh_SEG_DECAY": (False, True),
    # ... and how each segment gets its end adjoint: phases 1 and 2 ("transitions", exact), or by burn-in ("burnin":
    # phase 3 alone, each segment walking forward past its end until the bound shows the adjoint's transition from
    # there negligible, then walking back from a zero adjoint; or from the sequence's end and the final state's gradient
    # where no chunk qualifies: exact); the forward's SEG_START, opt-in, not in the search spaces
    "dh_SEG_START": ("transitions", "burnin"),
}


_CHANNEL: dict[str, tuple[Any, ...]] = {
    "dqk_BC": (16, 32, 64),  # KDA: rows per block of the dq/dk stage's per-channel pairwise terms
    # KDA: the training forward's stage 1 (under autograd, and its re-run with SAVE "none"): "blocks" (by
    # substitution), or "onepass" (:mod:`.intra_kda`, every gate factor from two exponentials per element; BT / BC
    # in {1, 2}); both store T for the backward
    "fh_INTRA": ("blocks", "onepass"),
}


def legal_params(gate: str) -> dict[str, tuple[Any, ...]]:
    """Every tunable parameter of the backward and all values the templates can be built with."""
    if gate not in GATE_CODES:
        raise ValueError(f"unknown gate mode {gate!r}")
    params = dict(_COMMON) | (dict(_CHANNEL) if gate == "channel" else dict(_SCALAR))
    return params | (dict(_GATED_SCALAR) if gate == "scalar" else {})


def default_config(K: int, V: int, gate: str) -> Config:
    """Correct for every supported shape (K, V <= 256) and gate (the KDA diagonal blocks are guarded)."""
    small = next_power_of_2(K) <= 128
    # sm_90 compiles (Triton 3.9, bf16, K = V = 128; tests/kernels/test_chunk_bwd_compile.py --stats): at BT = 32 every
    # stage is free of spills (reverse state pass 212-224 registers and 45-51 KB of shared memory at 4 warps and 2
    # stages: two programs per SM; fused dq/dk 246-255 registers at 8 warps). At BT = 64 the reverse pass takes
    # 115-135 KB (one program per SM) and KDA's fused dq/dk spills (668 bytes at dqk_BK = 64); BT = 32 is also the
    # forward's tuned chunk (the forward under autograd runs at the backward's BT).
    cfg: Config = {
        "BT": 32,
        "BC": 16,
        "SAVE": "intra",
        "FUSE_DV": True,  # one chunk-parallel stage (dA, dv, KDA's pairwise terms, dq, dk, the gate): no dA round trip
        "REVERSE_DV": False,
        "dh_BV": 32 if small else 16,
        "dh_num_warps": 4 if small else 8,
        "dh_num_stages": 2 if small else 1,
        "dh_LAYOUT": "kv",
        "dh_SEG_CHUNKS": 0,  # the plain reverse pass (sequence-parallel: 8..256 chunks per segment)
        "dh_TMA": False,
        "dh_STORE_TMA": False,
        # (H100, the shipped configs' training step at B8 T4096 / B1 T32768, medians of 5 interleaved rounds: Gated
        # DeltaNet 2.619 -> 2.601 and 3.622 -> 3.402 ms with it, DeltaNet 2.095 -> 2.142 and 2.969 -> 2.944, KDA
        # 4.545 -> 4.542 and 5.558 -> 5.572: on for Gated DeltaNet)
        "dh_ACC": gate == "scalar",
        "dv_BV": 64,
        "dv_num_warps": 4,
        "dv_num_stages": 2,
        "dqk_BK": 64,
        "dqk_BV": 64,
        "dqk_num_warps": 8,  # 4 warps spill at BT = 32 (4-312 bytes)
        "dqk_num_stages": 2,
        "dqk_KLOOP": False,
        "dqk_TMA": False,
        "dqk_maxnreg": 0,
        "dqk_GROUP": "float32",
        "F32_DOT": "ieee",
        "fh_BV": 0,
        "fh_num_warps": 0,
        "fh_num_stages": 0,
        "fh_TMA": False,
        "fh_STORE_TMA": False,
        "fi_BK": 0,
        "fi_BV": 0,
        "fi_num_warps": 0,
        "fi_num_stages": 0,
        "fi_SOLVE": "subst",
    }
    if gate == "channel":
        cfg["dqk_BC"] = 16
        cfg["fh_INTRA"] = "blocks"
    else:
        cfg["fh_U"] = "stored"
        cfg["fh_W"] = "stored"
        cfg["fh_AQK"] = "stored"
        cfg["dqk_DECAY"] = "pairwise"
        cfg["REVERSE_DQK"] = False
        cfg["fh_LOOP"] = "range"
        cfg["fh_maxnreg"] = 0
        cfg["dh_LOOP"] = "range"
        cfg["dh_maxnreg"] = 0
        cfg["dqk_LOOP"] = "range"
    if gate == "scalar":
        # Both skips off: on the gates of fla's layers at initialisation (make_inputs' "model" decays) they cost the
        # step, on the strong decays the search times they gain under 0.5% (H100, the shipped B1 T32768 entry, medians
        # of 3 interleaved rounds, two runs; reports/h100/training/decays/): model 3.391 / 3.350 ms with both, 3.333
        # with the reverse pass's off, 3.235 / 3.244 with both off; strong 3.216 with both, 3.228 with both off
        cfg["dh_SEG_DECAY"] = False
        cfg["fh_SEG_DECAY"] = False
        # (burn-in: strong decays 2.851 ms for both passes, model 6.528: opt-in only)
        cfg["dh_SEG_START"] = "transitions"
    return cfg


def check_config(K: int, V: int, gate: str, config: dict[str, Any] | None, name: str = "chunk backward") -> Config:
    """The full backward config: ``config`` over the default, every key and value checked (ValueError/TypeError)."""
    full = _check(name, legal_params(gate), default_config(K, V, gate), config)
    if full["REVERSE_DV"] and not full["FUSE_DV"]:
        raise ValueError(f"config for {name}: REVERSE_DV needs FUSE_DV (the dv stage does that work otherwise)")
    if full.get("REVERSE_DQK") and not full["REVERSE_DV"]:
        raise ValueError(
            f"config for {name}: REVERSE_DQK needs REVERSE_DV (the reverse pass's dVβ, dv and dβ's v part)"
        )
    for bc in ("BC", "dqk_BC"):
        if bc in full and not full[bc] <= full["BT"] <= 4 * full[bc]:
            raise ValueError(f"config for {name}: needs {bc} <= BT <= 4 * {bc}, got BT={full['BT']}, {bc}={full[bc]}")
    if full.get("fh_W", "stored") != "stored" and (full["fh_U"] != "recomputed" or not full["REVERSE_DV"]):
        raise ValueError(
            f"config for {name}: fh_W={full['fh_W']!r} needs fh_U='recomputed' (stage 1 then stores T alone) and "
            f"REVERSE_DV=True (the reverse pass reads T), got fh_U={full['fh_U']!r}, REVERSE_DV={full['REVERSE_DV']}"
        )
    if full.get("fh_INTRA") == "onepass" and full["BT"] // full["BC"] not in (1, 2):
        raise ValueError(
            f"config for {name}: fh_INTRA='onepass' holds 1 or 2 sub-chunks, needs BT <= 2 * BC, got BT={full['BT']}, "
            f"BC={full['BC']}"
        )
    if full.get("dh_SEG_START") == "burnin" and full["REVERSE_DQK"]:
        raise ValueError(
            f"config for {name}: dh_SEG_START='burnin' runs without REVERSE_DQK (its stores are the pass's)"
        )
    if full.get("dqk_DECAY") == "value" and (gate != "scalar" or not full["FUSE_DV"] or full["REVERSE_DQK"]):
        raise ValueError(
            f"config for {name}: dqk_DECAY='value' decays Gated DeltaNet's dA in its fused dq/dk stage (gate "
            f"'scalar', FUSE_DV, no REVERSE_DQK), got gate={gate!r}, FUSE_DV={full['FUSE_DV']}, "
            f"REVERSE_DQK={full['REVERSE_DQK']}"
        )
    if full["fi_SOLVE"] == "squaring" and full["BC"] != 16:
        raise ValueError(f"config for {name}: fi_SOLVE='squaring' inverts 16-row sub-chunks only, got BC={full['BC']}")
    return full


@dataclass
class Intermediates:
    """What the forward computes on the way and the backward needs (``None`` where a stage did not run)."""

    w: Tensor | None = None  # W = T Kβ [tokens, HV, K]
    aqk: Tensor | None = None  # A_qk [tokens, HV, BT] (scale folded in)
    ai: Tensor | None = None  # T = (I + A_kk)^-1 [tokens, HV, BT] (lower blocks)
    u: Tensor | None = None  # U = T Vβ [tokens, HV, V] (only the forward's state pass reads it)
    qg: Tensor | None = None  # KDA: q̃ [tokens, HV, K]
    kg: Tensor | None = None  # KDA: k̃ [tokens, HV, K]
    gout: Tensor | None = None  # KDA: e^{γ_C} [chunks, HV, K]; Gated DeltaNet: γ [tokens, HV] (float32)
    hbuf: Tensor | None = None  # chunk-start states [chunks, HV, K, V]
    vnew: Tensor | None = None  # V_new [tokens, HV, V]
    starts: Tensor | None = None  # sequence-parallel forward: the state entering each segment [NS, HV, K, V] float32

    def tensors(self) -> dict[str, Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Tables:
    """Chunk tables of one call: ``chunk_info`` [NC, 2] and ``chunk_offsets`` [N + 1] (varlen only), ``NC``."""

    chunk_info: Tensor | None
    chunk_offsets: Tensor | None
    NC: int


def chunk_tables(B: int, T: int, BT: int, cu_seqlens: Tensor | None, device: torch.device) -> Tables:
    if cu_seqlens is None:
        return Tables(None, None, B * triton.cdiv(T, BT))
    t = build_tables(host_offsets(cu_seqlens), B, T, BT, 0, device)
    return Tables(t.chunk_info, t.chunk_offsets, t.NC)


def forward_intermediates(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    tables: Tables,
    config: Config,
    inter: Intermediates | None = None,
    states: str = "keep",
    output: bool = False,
    final_state: bool = False,
    store_w: bool = True,
) -> tuple[Intermediates, Tensor | None, Tensor | None]:
    """The forward's stages with their intermediates kept: stage 1 (``INTRA = "blocks"``, or KDA's ``"onepass"``,
    storing ``T`` too) unless ``inter`` already holds its outputs, then the state pass (``states``: ``"keep"``:
    chunk-start states and ``V_new`` kept, and with ``output`` the output too: inside the pass where the config fuses
    it, else by the output stage; ``"fused"``: the output inside the state pass, nothing kept; ``"skip"``: no state
    pass). ``config`` is a full forward config (``BT``, ``BC`` as the backward's). Returns ``(intermediates, o or None,
    final state or None)``. Stage 1 stores W unless ``store_w`` is False (a config with ``WU = "recomputed"``: T
    alone, the backward's ``fh_W``), A_qk unless the config's ``AQK`` is ``"recomputed"``.

    Stage 1 is launched here (the forward's own launcher does not store ``T``); the state pass (its segment phases
    too) and the output stage through the forward's launchers."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BC, GATE, NC = config["BT"], config["BC"], GATE_CODES[gate], tables.NC
    dev, tokens = q.device, B * T
    dt = torch.promote_types(q.dtype, v.dtype)
    dot_prec = config["F32_DOT"] if dt == torch.float32 else "tf32"
    varlen = cu_seqlens is not None
    u_out = config.get("WU", "stored") != "recomputed"  # (fh_U: without U the state pass forms V_new from T)
    w_out = store_w or u_out  # (fh_W: T alone; W is stored whenever U is)
    qk_out = config.get("AQK", "stored") != "recomputed"  # (fh_AQK: the state pass and the reverse pass form A_qk)
    if inter is None:
        inter = Intermediates(
            w=new_output(tokens, HV, K, dtype=dt, device=dev) if w_out else None,
            u=new_output(tokens, HV, V, dtype=dt, device=dev) if u_out else None,
            aqk=new_output(tokens, HV, BT, dtype=dt, device=dev) if qk_out else None,
            ai=new_output(tokens, HV, BT, dtype=dt, device=dev),
        )
        if GATE == 2:
            inter.qg = new_output(tokens, HV, K, dtype=dt, device=dev)
            inter.kg = new_output(tokens, HV, K, dtype=dt, device=dev)
            inter.gout = new_output(max(NC, 1), HV, K, dtype=torch.float32, device=dev)
        elif GATE == 1:
            inter.gout = new_output(tokens, HV, dtype=torch.float32, device=dev)
        if NC > 0:
            two_pass = GATE == 2
            flags = torch.empty(NC * HV, dtype=torch.int32, device=dev) if two_pass else None
            i_BK, i_BV = _tile(config["intra_BK"], K), _tile(config["intra_BV"], V)
            # (what is not stored is never written: T's buffer stands in for it)
            w_buf, u_buf, a_buf = (t if t is not None else inter.ai for t in (inter.w, inter.u, inter.aqk))
            args = (q, k, v, g, beta, w_buf, u_buf, a_buf, inter.qg, inter.kg, inter.gout)
            kw: dict[str, Any] = dict(
                H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=i_BK, BV=i_BV, GATE=GATE, NB=BT // BC,
                NK=triton.cdiv(K, i_BK), NV=triton.cdiv(V, i_BV), VARLEN=varlen, DOT_PREC=dot_prec,
                ai=inter.ai, STORE_AI=True, SOLVE=int(config["SOLVE"] == "squaring"),
                num_warps=config["intra_num_warps"], num_stages=config["intra_num_stages"],
            )  # fmt: skip
            grid = (NC, HV)
            if config["INTRA"] == "onepass":  # KDA's one-pass stage 1, T stored as well; flagged chunks as below
                okw = {n: v for n, v in kw.items() if n != "GATE"}
                chunk_intra_onepass_kernel[grid](
                    *args, tables.chunk_info, flags, scale, T, DIAG=1, DIAG_LOWP=False, **okw,
                )  # fmt: skip
            else:
                chunk_intra_blocks_kernel[grid](
                    *args, tables.chunk_info, flags, scale, T, DIAG=1 if two_pass else 0, WU_OUT=w_out,
                    U_OUT=u_out or not w_out, QK_OUT=qk_out, **kw,
                )  # fmt: skip
            if two_pass:  # the chunks whose diagonal blocks are too steep for the middle-row dot, exactly
                chunk_intra_blocks_kernel[grid](*args, tables.chunk_info, flags, scale, T, DIAG=2, **kw)
    if states == "skip":
        return inter, None, None
    # the state pass through the forward's own launchers: per sequence, or sequence-parallel where the forward config
    # has segments (SEG_CHUNKS), then the output stage unless fused
    keep = states == "keep"
    fuse = states == "fused" or (keep and output and bool(config["FUSE_OUTPUT"]))  # keep: the fused pass stores too
    offsets = None if cu_seqlens is None else host_offsets(cu_seqlens)
    # (A_qk recomputed only by a pass that forms the output; one that does not never reads it)
    aqk_mode = config.get("AQK", "stored") if fuse else "stored"
    call = prepare_call(
        q, k, v, None, beta, gate, scale, initial_state, final_state, cu_seqlens,
        dict(config, FUSE_OUTPUT=fuse, AQK=aqk_mode), offsets,
    )  # fmt: skip
    if not qk_out and output and not fuse:
        raise ValueError("the output stage reads A_qk, which this config does not store (AQK = 'recomputed')")
    assert inter.ai is not None and (inter.u is not None or not u_out), "stage 1's outputs"
    fi = FwdIntermediates(
        w=inter.w, u=inter.u, aqk=inter.aqk, qg=inter.qg, kg=inter.kg, gout=inter.gout, flags=None, ai=inter.ai,
        h=new_output(max(NC, 1), HV, K, V, dtype=dt, device=dev) if keep else None,
        v_new=new_output(tokens, HV, V, dtype=dt, device=dev) if keep else None,
    )  # fmt: skip
    o = new_output(B, T, HV, V, dtype=v.dtype, device=dev) if fuse or output else None
    ht = new_output(call.N, HV, K, V, dtype=torch.float32, device=dev) if final_state else None
    out = Outputs(o, ht)  # type: ignore[arg-type]  # (o None: the pass stores no output)
    scratch: SegmentScratch | None = None
    if call.tables.segments is not None and not burns_in(call.config):  # (burn-in: phase 3 alone, no scratch)
        if inter.starts is not None:  # the segments' entering states, kept from the forward under autograd
            scratch = SegmentScratch(torch.empty(0, device=dev), inter.starts)
        else:
            scratch = allocate_segments(call)
            assert scratch is not None
            launch_transitions(call, fi, scratch)
            launch_segment_starts(call, out, scratch)
        inter.starts = scratch.starts
    launch_state(call, fi, out, scratch)
    if output and not fuse:
        launch_output(call, fi, out)
    inter.hbuf, inter.vnew = fi.h, fi.v_new
    return inter, o, ht


def training_forward_config(fwd_config: Config, bwd_config: Config, gate: str) -> Config:
    """The forward config for intermediates the backward can use: the backward's chunk sizes, stage 1 as ``"blocks"``
    (the variant that stores ``T``, its diagonal blocks inverted as ``fi_SOLVE`` says; KDA with ``fh_INTRA = "onepass"`` the one-pass kernel, storing it
    too) with its diagonal guard, the forward's segments (``SEG_CHUNKS``) as long in tokens as the forward config's, the
    state pass's tiles from the backward config's ``fh_*`` (Gated DeltaNet's phase-1 skip too, ``fh_SEG_DECAY``, not the
    forward's ``SEG_DECAY``) and stage 1's from ``fi_*`` where set (tuned at the
    backward's BT), W, U and A_qk stored (the backward reads them: a forward config that recomputes them in the state
    pass, ``WU`` / ``AQK = "recomputed"``, stores them here; with ``fh_U = "recomputed"`` U is not, the state pass
    forming V_new from T as ``WU = "recomputed"`` does; with ``fh_W`` W neither, with ``fh_AQK`` no A_qk, formed by
    the state pass with the output fused), the state pass's tiles by TMA descriptors where ``fh_TMA``
    says so, else by pointer loads, its chunk states and V_new stored through them where ``fh_STORE_TMA`` does, in
    its plain loop, or in Gluon (``fh_LOOP = "gluon"``: tiles and stores by TMA) under ``fh_maxnreg`` (the forward's
    ``STATE_TMA``, ``STATE_LOOP`` and, for its Gluon pass, ``h_maxnreg`` are timed in the forward, not in the step),
    everything else the forward's."""
    BT = bwd_config["BT"]
    seg = int(fwd_config.get("SEG_CHUNKS", 0))
    if seg > 0:
        seg = max(1, seg * int(fwd_config["BT"]) // BT)
    intra = "onepass" if bwd_config.get("fh_INTRA") == "onepass" else "blocks"
    solve = bwd_config.get("fi_SOLVE", "subst")
    cfg = dict(fwd_config, BT=BT, BC=bwd_config["BC"], INTRA=intra, SOLVE=solve, SEG_CHUNKS=seg)
    # (WU = "recomputed" here: W and T stored, U not: the state pass forms V_new from T, fh_U)
    wu = "recomputed" if bwd_config.get("fh_U") == "recomputed" else "stored"
    # (AQK = "recomputed" here: A_qk not stored, formed by the state pass's fused output and by the reverse pass, fh_AQK)
    aqk = "recomputed" if bwd_config.get("fh_AQK") == "recomputed" else "stored"
    loop = bwd_config.get("fh_LOOP", "range")  # (Gluon: the state pass with the output, its states stored by TMA)
    cfg.update(WU=wu, AQK=aqk, STATE_TMA=bool(bwd_config.get("fh_TMA", False)) or loop == "gluon", STATE_LOOP=loop)
    if bwd_config.get("fh_maxnreg", 0):
        cfg["h_maxnreg"] = bwd_config["fh_maxnreg"]
    elif fwd_config.get("STATE_LOOP") == "gluon":  # (the forward's cap was the Gluon pass's, not the Triton one's)
        cfg["h_maxnreg"] = 0
    cfg["STATES_TMA"] = bool(bwd_config.get("fh_STORE_TMA", False))
    if aqk == "recomputed":
        cfg["FUSE_OUTPUT"] = True  # (the output is formed in the state pass, which forms A_qk)
    for name in ("BV", "num_warps", "num_stages"):
        if bwd_config.get(f"fh_{name}", 0):
            cfg[f"h_{name}"] = bwd_config[f"fh_{name}"]
    for name in ("BK", "BV", "num_warps", "num_stages"):
        if bwd_config.get(f"fi_{name}", 0):
            cfg[f"intra_{name}"] = bwd_config[f"fi_{name}"]
    if gate == "channel":
        cfg["SAFE_DIAG"] = True
        cfg["DIAG_BF16"] = False  # (onepass) the diagonal blocks' dots in float32: the accuracy of "blocks"
    if gate == "scalar":
        cfg["SEG_DECAY"] = bool(bwd_config.get("fh_SEG_DECAY", False))
    return cfg


def forward_for_training(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    fwd_config: Config,
    bwd_config: Config,
) -> tuple[Tensor, Tensor | None, Intermediates]:
    """The forward under autograd: ``(o, final state or None, what to save for the backward)`` by ``SAVE``."""
    fwd = TrainingForward(
        q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, fwd_config, bwd_config
    )
    for _, launch in fwd.stages():
        launch()
    return fwd.result()


class TrainingForward:
    """The forward under autograd as named stages, run in order (:meth:`stages`): ``fwd-intra`` (stage 1, storing
    ``T``) then ``fwd-state`` (the state pass, with its segment phases and the output), or with ``SAVE = "none"``
    the plain forward as one stage ``forward``. Each stage allocates what it writes, so that once all ran in order any
    one can run again alone (a plan's stage, timed by itself); :meth:`result` is what the backward gets."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor | None,
        beta: Tensor,
        gate: str,
        scale: float,
        initial_state: Tensor | None,
        output_final_state: bool,
        cu_seqlens: Tensor | None,
        fwd_config: Config,
        bwd_config: Config,
    ) -> None:
        self.q, self.k, self.v, self.beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        self.g = None if g is None else g.contiguous()  # the forward's kernels clamp it at load (GATE_FLOOR)
        self.gate, self.scale, self.h0, self.final = gate, scale, initial_state, output_final_state
        self.cu_seqlens, self.fwd_config, self.save = cu_seqlens, fwd_config, bwd_config["SAVE"]
        self.store_w = bwd_config.get("fh_W", "stored") == "stored"
        self.cfg = training_forward_config(fwd_config, bwd_config, gate)
        B, T = q.shape[:2]
        self.tables = chunk_tables(B, T, self.cfg["BT"], cu_seqlens, q.device) if self.save != "none" else None
        # "intra" runs the state pass as the forward config says (fused output, or states kept for the output stage)
        self.states = "keep" if self.save == "all" or not self.cfg["FUSE_OUTPUT"] else "fused"
        self.inter = Intermediates()
        self.o: Tensor | None = None
        self.ht: Tensor | None = None

    def stages(self) -> list[tuple[str, Callable[[], None]]]:
        if self.save == "none":
            return [("forward", self.forward)]
        return [("fwd-intra", self.intra), ("fwd-state", self.state)]

    def forward(self) -> None:
        self.o, self.ht = chunk_forward(
            self.q, self.k, self.v, self.g, self.beta, self.gate, self.scale, self.h0, self.final, self.cu_seqlens,
            self.fwd_config,
        )  # fmt: skip

    def intra(self) -> None:
        assert self.tables is not None
        self.inter, _, _ = forward_intermediates(
            self.q, self.k, self.v, self.g, self.beta, self.gate, self.scale, self.h0, self.cu_seqlens, self.tables,
            self.cfg, states="skip", store_w=self.store_w,
        )  # fmt: skip

    def state(self) -> None:
        assert self.tables is not None
        self.inter.starts = None  # (the forward computes the segments' entering states: phases 1 and 2 too)
        _, self.o, self.ht = forward_intermediates(
            self.q, self.k, self.v, self.g, self.beta, self.gate, self.scale, self.h0, self.cu_seqlens, self.tables,
            self.cfg, inter=self.inter, states=self.states, output=True, final_state=self.final,
            store_w=self.store_w,
        )  # fmt: skip

    def result(self) -> tuple[Tensor, Tensor | None, Intermediates]:
        """``(o, final state or None, what to save)``: a copy of the intermediates without what the backward never
        reads (U; with the states kept the segment starts, else the states, re-run in the backward)."""
        assert self.o is not None
        saved = replace(self.inter)
        if self.save == "all":
            saved.u = saved.starts = None
        else:
            saved.hbuf = saved.vnew = None
        return self.o, self.ht, saved


class BackwardPass:
    """The backward's launches on one call as named stages, run in order (:meth:`stages`): ``re-intra`` (``SAVE =
    "none"``) and ``re-state`` (``"none"``, ``"intra"``): the forward's intermediates again; ``reverse`` (the reverse
    state pass, its segment phases too); ``dv`` (without ``FUSE_DV``); ``dqk``; ``finish``; ``group-sum``
    (grouped value heads: dq, dk summed over each group); with ``REVERSE_DQK`` the reverse pass writes the gradients and
    neither ``dqk`` nor ``finish`` runs. Without ``keep`` each buffer is allocated by the stage that
    writes it first and dropped after its last reader (a lower peak). With ``keep`` (a plan: once all ran in order,
    any one runs again alone, timed by itself) nothing is released and the buffers are allocated once (with
    ``dqk_KLOOP`` not split off by ``REVERSE_DV`` the dq/dk stage writes dVβ over the dV_new it reads: a second run
    alone computes other numbers, in the same time). :meth:`grads` returns the gradients."""

    def __init__(
        self,
        do: Tensor,
        dht: Tensor | None,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor | None,
        beta: Tensor,
        gate: str,
        scale: float,
        initial_state: Tensor | None,
        cu_seqlens: Tensor | None,
        fwd_config: Config,
        bwd_config: Config,
        saved: Intermediates,
        keep: bool = False,
    ) -> None:
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        self.B, self.T, self.H, self.HV, self.K, self.V = B, T, H, HV, K, V
        self.cfg = cfg = training_forward_config(fwd_config, bwd_config, gate)
        self.bwd_config, self.gate, self.scale, self.keep = bwd_config, gate, scale, keep
        self.BT, self.GATE, self.save = cfg["BT"], GATE_CODES[gate], bwd_config["SAVE"]
        self.dev, self.tokens = q.device, B * T
        self.N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        self.dt = torch.promote_types(q.dtype, v.dtype)
        self.dot_prec = bwd_config["F32_DOT"] if self.dt == torch.float32 else "tf32"
        self.varlen = cu_seqlens is not None
        self.q, self.k, self.v, self.beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
        self.do = do.contiguous()
        self.dht = None if dht is None else dht.contiguous()
        self.g = None if g is None else g.contiguous()
        self.h0, self.cu_seqlens = initial_state, cu_seqlens
        self.tables = chunk_tables(B, T, self.BT, cu_seqlens, self.dev)
        self.offsets = None if cu_seqlens is None else host_offsets(cu_seqlens)
        self.inter = saved
        self.store_w = bwd_config.get("fh_W", "stored") == "stored"
        self.fused = bool(bwd_config["FUSE_DV"])
        self.rev_dv = bool(bwd_config["REVERSE_DV"]) and self.fused
        # (REVERSE_DQK: the chunk-parallel stages' work inside the reverse pass, no dq/dk or finish stage)
        self.rev_dqk = bool(bwd_config.get("REVERSE_DQK", False)) and self.rev_dv
        self.dqk_BK, self.dqk_BV = _tile(bwd_config["dqk_BK"], K), _tile(bwd_config["dqk_BV"], V)
        self.NK = triton.cdiv(K, self.dqk_BK)
        self.kloop = bool(bwd_config["dqk_KLOOP"]) and self.NK > 1  # the key tiles in one program (dVβ over dV_new)
        n_v = triton.cdiv(V, _tile(bwd_config["dh_BV"], V)) if self.rev_dv else 1  # dβ's v-part slots
        self.n_v, self.nslot, self.ss = n_v, n_v + self.NK, self.tokens * HV
        # what the stages write (allocated by the stage that writes it first)
        self.dbeta_part: Tensor | None = None
        self.dv: Tensor | None = None
        self.dh: Tensor | None = None
        self.dvn: Tensor | None = None  # dV_new (REVERSE_DV: dVβ)
        self.dh0: Tensor | None = None
        # unfused: the dv stage's dVβ and both dA; KDA fused: the dA scratch copies
        self.dvb: Tensor | None = None
        self.daq: Tensor | None = None
        self.dak: Tensor | None = None
        self.dq: Tensor | None = None
        self.dk: Tensor | None = None
        self.dbeta: Tensor | None = None
        self.dg: Tensor | None = None
        self.dg_part: Tensor | None = None
        self.dq_sum: Tensor | None = None  # grouped value heads: dq, dk summed over each group
        self.dk_sum: Tensor | None = None

    def stages(self) -> list[tuple[str, Callable[[], None]]]:
        out: list[tuple[str, Any]] = []
        if self.save == "none":
            out.append(("re-intra", self.rerun_intra))
        if self.save != "all":
            out.append(("re-state", self.rerun_state))
        out.append(("reverse", self.reverse))
        if self.tables.NC > 0 and not self.rev_dqk:
            if not self.fused:
                out.append(("dv", self.dv_stage))
            out += [("dqk", self.dqk), ("finish", self.finish)]
        if self.HV != self.H:
            out.append(("group-sum", self.group_sum))
        return out

    def _new(self, have: Tensor | None, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        """A new output buffer (the intermediates' dtype unless ``dtype``); with ``keep``, ``have`` once allocated."""
        if self.keep and have is not None:
            return have
        return new_output(*shape, dtype=self.dt if dtype is None else dtype, device=self.dev)

    # ---- the forward's intermediates again (SAVE "intra": the state pass; "none": stage 1 too) ------------------
    def rerun_intra(self) -> None:
        self.inter, _, _ = forward_intermediates(
            self.q, self.k, self.v, self.g, self.beta, self.gate, self.scale, self.h0, self.cu_seqlens, self.tables,
            self.cfg, states="skip", store_w=self.store_w,
        )  # fmt: skip

    def rerun_state(self) -> None:
        if self.save == "none":
            self.inter.starts = None  # (no forward kept them: phases 1 and 2 too)
        forward_intermediates(
            self.q, self.k, self.v, None, self.beta, self.gate, self.scale, self.h0, self.cu_seqlens, self.tables,
            self.cfg, inter=self.inter, store_w=self.store_w,
        )  # fmt: skip
        if not self.keep:
            self.inter.u = None

    # ---- 1. reverse state pass (sequence-parallel with dh_SEG_CHUNKS; REVERSE_DV: dVβ, dv and dβ's v part too) ----
    def reverse(self) -> None:
        inter, HV, K, V = self.inter, self.HV, self.K, self.V
        self.dv = self._new(self.dv, self.B, self.T, HV, V, dtype=self.v.dtype)
        self.dh0 = self._new(self.dh0, self.N, HV, K, V, dtype=torch.float32) if self.h0 is not None else None
        dqk_work = None
        if self.rev_dqk:  # the gradients written by the pass: no adjoints, dV_new or dβ partials stored
            self._grad_outputs()
            assert inter.hbuf is not None and inter.vnew is not None and self.dq is not None and self.dk is not None
            assert self.dbeta is not None
            dqk_work = (inter.hbuf, inter.vnew, self.g, self.dq, self.dk, self.dg, self.dbeta)
            self.dbeta_part = self.dv.new_empty(1, 0, HV, dtype=torch.float32)  # (unused by the pass)
            self.dh = self.dvn = self.dv  # (unused by the pass)
        else:
            self.dbeta_part = self._new(self.dbeta_part, self.nslot, self.tokens, HV, dtype=torch.float32)
            self.dh = self._new(self.dh, max(self.tables.NC, 1), HV, K, V)
            self.dvn = self._new(self.dvn, self.tokens, HV, V)
        dv_work = None
        if self.rev_dv:
            assert inter.ai is not None
            dv_work = (inter.ai, self.v, self.beta, self.dv, self.dbeta_part)
        # (fh_W, fh_AQK: not stored, formed by the pass: W's product from K and dVβ, or W itself; A_qk from q and k)
        no_w, qk_re = inter.w is None, inter.aqk is None
        w_rebuild = no_w and self.bwd_config.get("fh_W") == "rebuilt"
        assert inter.ai is not None or not (no_w or qk_re)
        launch_reverse(
            self.q, self.k, inter.ai if no_w else inter.w, inter.ai if qk_re else inter.aqk, inter.qg, inter.kg,
            inter.gout, self.do, self.dht, self.dh0, self.dh, self.dvn, self.cu_seqlens, self.tables.chunk_offsets,
            self.offsets, self.scale, self.B, self.T, self.H, HV, K, V, self.N, self.BT, self.GATE, self.dot_prec,
            self.bwd_config, dv_work, w_from_k=no_w and not w_rebuild, qk_re=qk_re, w_rebuild=w_rebuild,
            dqk_work=dqk_work, beta=self.beta,
        )  # fmt: skip
        if not self.keep:
            inter.w = inter.qg = inter.kg = None
            if self.rev_dqk:
                inter.hbuf = inter.vnew = inter.ai = None
                self.dh = self.dvn = None

    # ---- 2. (unfused) dA_qk, dVβ (dv), dA_kk ------------------------------------------------------------------------
    def dv_stage(self) -> None:
        inter, cfg, V = self.inter, self.bwd_config, self.V
        dv_BV = _tile(cfg["dv_BV"], V)
        self.dvb = self._new(self.dvb, self.tokens, self.HV, V)
        self.daq = self._new(self.daq, self.tokens, self.HV, self.BT)
        self.dak = self._new(self.dak, self.tokens, self.HV, self.BT)
        chunk_bwd_dv_kernel[(self.tables.NC, self.HV)](
            self.v, self.beta, inter.ai, inter.vnew, self.dvn, self.do, self.dv, self.dvb, self.daq, self.dak,
            self.dbeta_part, self.tables.chunk_info, self.scale, self.T,
            HV=self.HV, V=V, BT=self.BT, BV=dv_BV, NV=triton.cdiv(V, dv_BV), VARLEN=self.varlen,
            DOT_PREC=self.dot_prec, num_warps=cfg["dv_num_warps"], num_stages=cfg["dv_num_stages"],
        )  # fmt: skip
        if not self.keep:  # (buffers are dropped after their last reader: a lower peak, the allocator reuses them)
            inter.ai = None
            self.dvn = None

    # ---- 3. dq, dk, the gate (fused: with stage 2's work, dA in registers) -----------------------------------------
    def _grad_outputs(self) -> None:
        B, T, HV, K = self.B, self.T, self.HV, self.K
        g, f32 = self.g, HV != self.H and self.bwd_config["dqk_GROUP"] == "float32"  # per value head partials
        self.dbeta = self._new(self.dbeta, B, T, HV, dtype=self.beta.dtype)
        self.dg = None if g is None else self._new(self.dg, *g.shape, dtype=g.dtype)
        self.dq = self._new(self.dq, self.tokens, HV, K, dtype=torch.float32 if f32 else self.q.dtype)
        self.dk = self._new(self.dk, self.tokens, HV, K, dtype=torch.float32 if f32 else self.k.dtype)

    def dqk(self) -> None:
        inter, cfg, HV, K, V, BT, GATE = self.inter, self.bwd_config, self.HV, self.K, self.V, self.BT, self.GATE
        self._grad_outputs()
        fused, rev_dv, kloop, NK = self.fused, self.rev_dv, self.kloop, self.NK
        if fused and GATE == 2:  # KDA's pairwise terms read dA by blocks: each key tile's program keeps a copy
            self.daq = self._new(self.daq, 1 if kloop else NK, self.tokens, HV, BT)
            self.dak = self._new(self.dak, 1 if kloop else NK, self.tokens, HV, BT)
        self.dg_part = self._new(self.dg_part, NK, self.tokens, HV, dtype=torch.float32) if GATE == 1 else None
        plain = fused and not rev_dv  # the dq/dk stage does dVβ, dv and the v part itself
        v = self.v if plain else None
        if cfg.get("dqk_LOOP", "range") == "gluon" and self.tables.NC > 0:
            from .bwd_dqk_ws import launch_dqk_ws, why_not  # (Gluon imported only where a config asks for it)

            assert inter.hbuf is not None and inter.vnew is not None and self.dvn is not None and self.dh is not None
            assert self.dq is not None and self.dk is not None and self.dbeta_part is not None
            reads = (self.q, self.k, self.do, inter.vnew, self.dvn, inter.hbuf, self.dh)
            why = why_not(
                device=self.dev, gate=GATE, dtype=self.dt, inputs=reads, K=K, V=V, BT=BT, BK=self.dqk_BK,
                BV=self.dqk_BV, config=cfg, fused=fused, dvb_given=rev_dv, kloop=kloop,
            )  # fmt: skip
            if why is None:
                launch_dqk_ws(
                    q=self.q, k=self.k, g=self.g, beta=self.beta, hbuf=inter.hbuf, dh=self.dh, do=self.do,
                    vnew=inter.vnew, dvb=self.dvn, dq=self.dq, dk=self.dk, dg=self.dg_part,
                    dbeta_part=self.dbeta_part, chunk_info=self.tables.chunk_info, scale=self.scale, T=self.T,
                    NC=self.tables.NC, H=self.H, HV=HV, K=K, V=V, BV=self.dqk_BV, GATE=GATE, slot=self.n_v,
                    ss=self.ss, varlen=self.varlen, floor=GATE_FLOOR, config=cfg,
                )  # fmt: skip
                self._release_dqk_inputs()
                return
        # dqk_TMA: its value-side and state tiles by TMA descriptors (fused; not where the key loop reads back the dVβ
        # it stores by pointers: TMA's async loads would need a proxy fence after those stores)
        tds: dict[str, Any] = {}
        if cfg["dqk_TMA"] and fused and not (kloop and not rev_dv):
            assert inter.hbuf is not None and inter.vnew is not None and self.dvn is not None and self.dh is not None
            tds = dqk_descriptors(
                self.do, inter.vnew, self.dvn, v, inter.hbuf, self.dh, HV, K, V, BT, self.dqk_BK, self.dqk_BV, True
            )  # fmt: skip
        chunk_bwd_dqk_kernel[(self.tables.NC, 1 if kloop else NK, HV)](
            self.q, self.k, self.g, self.beta, inter.hbuf, self.dh, self.do, inter.vnew,
            self.dvn if fused else self.dvb, self.daq, self.dak, inter.ai if plain else None, v,
            self.dv if plain else None, self.dq, self.dk, self.dg if GATE == 2 else self.dg_part, self.dbeta_part,
            self.tables.chunk_info, self.scale, self.T, self.n_v, self.ss,
            H=self.H, HV=HV, K=K, V=V, BT=BT, BC=cfg.get("dqk_BC", self.cfg["BC"]), BK=self.dqk_BK, BV=self.dqk_BV,
            NV=triton.cdiv(V, self.dqk_BV), GATE=GATE, FUSED=fused, VARLEN=self.varlen, DOT_PREC=self.dot_prec,
            FLOOR=GATE_FLOOR, DVB_GIVEN=rev_dv, KLOOP=kloop, NK=NK, DA_DECAYED=cfg.get("dqk_DECAY") == "value",
            num_warps=cfg["dqk_num_warps"],
            num_stages=cfg["dqk_num_stages"], **tds, **register_cap(cfg, "dqk"),
        )  # fmt: skip
        self._release_dqk_inputs()

    def _release_dqk_inputs(self) -> None:
        if not self.keep:
            inter = self.inter
            inter.hbuf = inter.vnew = inter.ai = None
            self.dh = self.dvn = self.dvb = self.daq = self.dak = None

    # ---- 4. dβ, Gated DeltaNet's dg ----------------------------------------------------------------------------
    def finish(self) -> None:
        chunk_bwd_finish_kernel[(self.tables.NC, self.HV)](
            self.g, self.dbeta_part, self.dg_part, self.dbeta, self.dg, self.tables.chunk_info, self.T, self.ss,
            HV=self.HV, BT=self.BT, NSLOT=self.nslot, NKG=self.NK, GATE=self.GATE, VARLEN=self.varlen,
            FLOOR=GATE_FLOOR,
        )  # fmt: skip

    def group_sum(self) -> None:
        """Grouped value heads: dq, dk per value head (float32, or the inputs' dtypes with ``dqk_GROUP = "input"``)
        summed over each group in float32, written in the inputs' dtypes."""
        if self.dq is None:  # (no chunk: nothing launched)
            self._grad_outputs()
        assert self.dq is not None and self.dk is not None
        B, T, H, K = self.B, self.T, self.H, self.K
        self.dq_sum = self._new(self.dq_sum, B, T, H, K, dtype=self.q.dtype)
        self.dk_sum = self._new(self.dk_sum, B, T, H, K, dtype=self.k.dtype)
        launch_group_sum(self.dq, self.dk, self.dq_sum, self.dk_sum, H, self.HV, K)

    def grads(self) -> dict[str, Tensor | None]:
        """Gradients ``{"q", "k", "v", "g", "beta", "initial_state"}`` after every stage ran."""
        if self.dq is None:  # (no chunk: nothing launched)
            self._grad_outputs()
        dq, dk = (self.dq_sum, self.dk_sum) if self.HV != self.H else (self.dq, self.dk)
        assert dq is not None and dk is not None
        B, T, H, K = self.B, self.T, self.H, self.K
        return {
            "initial_state": self.dh0, "q": dq.view(B, T, H, K), "k": dk.view(B, T, H, K), "v": self.dv,
            "beta": self.dbeta, "g": self.dg,
        }  # fmt: skip


def backward(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    fwd_config: Config,
    bwd_config: Config,
    saved: Intermediates,
) -> dict[str, Tensor | None]:
    """Gradients ``{"q", "k", "v", "g", "beta", "initial_state"}`` (inputs' dtypes; the initial state's float32,
    ``None`` without one; ``g`` ``None`` for DeltaNet) of ``<o, do> + <final_state, dht>``."""
    bp = BackwardPass(do, dht, q, k, v, g, beta, gate, scale, initial_state, cu_seqlens, fwd_config, bwd_config, saved)
    for _, launch in bp.stages():
        launch()
    return bp.grads()


def plan_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    fwd_config: Config,
    bwd_config: Config,
    do: Tensor,
    dht: Tensor | None,
) -> tuple[list[Stage], Callable[[], tuple[Tensor, Tensor | None, dict[str, Tensor | None]]]]:
    """The training step's launches as named stages (:class:`~.pipeline.Stage`; floors zero: the step's floors are
    :func:`dtune.measure.work.backward_stages`'), :class:`TrainingForward`'s then :class:`BackwardPass`'s, nothing
    released, and a call returning what the last runs computed: ``(o, final state or None, gradients)``.

    Run the stages in order once (each allocates its outputs; the backward's first stage takes what the forward's
    stages saved, once); then any one runs again alone, on the buffers of the last run of the stages it reads from
    (the backward keeps the forward's first intermediates). Full, checked configs; ``dht`` unused without
    ``output_final_state``."""
    fwd = TrainingForward(
        q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, fwd_config, bwd_config
    )
    bp = BackwardPass(
        do, dht if output_final_state else None, q, k, v, g, beta, gate, scale, initial_state, cu_seqlens, fwd_config,
        bwd_config, Intermediates(), keep=True,
    )  # fmt: skip
    handed: list[bool] = []

    def backward_stage(launch: Callable[[], None]) -> None:
        if not handed:  # what the forward's stages saved, as the autograd Function hands it over
            _, _, bp.inter = fwd.result()
            handed.append(True)
        launch()

    def outputs() -> tuple[Tensor, Tensor | None, dict[str, Tensor | None]]:
        o, ht, _ = fwd.result()
        return o, ht, bp.grads()

    stages = [Stage(name, launch, 0.0, 0.0) for name, launch in fwd.stages()]
    stages += [Stage(name, partial(backward_stage, launch), 0.0, 0.0) for name, launch in bp.stages()]
    return stages, outputs


__all__ = [
    "GATE_FLOOR",
    "Intermediates",
    "backward",
    "check_config",
    "default_config",
    "forward_for_training",
    "forward_intermediates",
    "legal_params",
    "plan_step",
]
