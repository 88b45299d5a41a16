"""The chunk backward (Triton, under the interpreter) against float64 autograd through the token-by-token loop.

Every gradient (q, k, v, g, beta, initial state) is compared by relative RMS error, from a random output gradient
and a random final-state gradient. Buffers are NaN-poisoned (tests/conftest.py): an element a stage fails to
write fails the test. Gates are strong (per-step log decay down to −5) unless a case says otherwise. Most cases have
grouped value heads with more than one key head (H = 2, HV = 4): with H = 1 a wrong mapping of value heads to key
heads (``hv % H`` for ``hv // (HV // H)``, or the group sum over the wrong axis) computes the right gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.language as tl
from dtune.kernels.chunk import backward as chunk_bwd
from dtune.kernels.interpreter import reversed_programs
from dtune.kernels.reference import naive_recurrent
from dtune.kernels.reference_bwd import GATE_FLOOR, chunk_backward_reference

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

CHUNK = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


class _Spy:
    """Stands in for a Triton kernel: records each launch's constexprs, then launches the real one."""

    def __init__(self, kernel: Any, seen: list[dict[str, Any]]) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kw: Any) -> Any:
            self.seen.append({"grid": grid, **kw})
            return self.kernel[grid](*args, **kw)

        return launch


def with_inf_gates(x: dict[str, Any], every: int = 7) -> dict[str, Any]:
    """Every ``every``-th gate entry set to −inf (a full forget)."""
    if x["g"] is not None:
        x["g"] = x["g"].clone()
        x["g"].view(-1)[3::every] = float("-inf")
    return x


def gradients_vs_loop(
    problem: Shape,
    x: dict[str, Any],
    bwd_config: dict[str, Any] | None,
    scale: float | None = None,
    final: bool = True,
    fwd_config: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Relative RMS error of the output and of every gradient, chunk op (through dtune.ops) vs float64 autograd."""
    leaves = {n: (x[n].clone().requires_grad_() if x[n] is not None else None) for n in NAMES}
    ref = {n: (x[n].double().requires_grad_() if x[n] is not None else None) for n in NAMES}
    kw = {"scale": scale, "output_final_state": final, "cu_seqlens": x["cu_seqlens"]}
    o, s = ops.run_kernel(
        CHUNK[problem.gate],
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")),
        initial_state=leaves["initial_state"],
        config=fwd_config,
        bwd_config=bwd_config,
        **kw,
    )
    args = (ref[n] for n in ("q", "k", "v", "g", "beta"))
    o_ref, s_ref = naive_recurrent(*args, initial_state=ref["initial_state"], **kw)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(o.shape, generator=gen)
    loss, loss_ref = (o * do).sum(), (o_ref * do.double()).sum()
    if final:
        assert s is not None and s_ref is not None
        dht = torch.randn(s.shape, generator=gen)
        loss, loss_ref = loss + (s * dht).sum(), loss_ref + (s_ref * dht.double()).sum()
    else:
        assert s is None
    loss.backward()
    loss_ref.backward()
    errs = {"o": rel_err(o, o_ref)}
    for n in NAMES:
        if leaves[n] is None:
            continue
        grad, grad_ref = leaves[n].grad, ref[n].grad
        assert grad is not None and grad_ref is not None, n
        assert grad.dtype == x[n].dtype and grad.shape == x[n].shape, n
        errs[n] = rel_err(grad, grad_ref)
    return errs


def assert_close(errs: dict[str, float], tol: float, h0_tol: float | None = None) -> None:
    limit = {"initial_state": h0_tol or tol}
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e < limit.get(n, tol)}
    assert not bad, f"relative RMS errors over {tol:g}: {bad} (all: { {n: f'{e:.1e}' for n, e in errs.items()} })"


# (problem, seq_lens, initial_state, backward config, extra: scale / inf / gate_min / final)
CASES: dict[str, tuple[Shape, list[int] | None, bool, dict[str, Any], dict[str, Any]]] = {}


def add(
    tag: str, p: Shape, cfg: dict[str, Any], seq_lens: list[int] | None = None, h0: bool = True, **extra: Any
) -> None:
    op = {"none": "dn", "scalar": "gdn", "channel": "kda"}[p.gate.value]
    head = f"varlen{'-'.join(map(str, seq_lens))}" if seq_lens else f"B{p.B}-T{p.T}"
    CASES[f"{op}-{tag}-{head}-H{p.H}-HV{p.HV}-K{p.K}-V{p.V}"] = (p, seq_lens, h0, cfg, extra)


BT16 = {"BT": 16, "BC": 16}
BT32 = {"BT": 32, "BC": 16}
for gate in Gate:
    add("T1", Shape(2, 1, 2, 4, 16, 32, 2, gate), BT16)  # T = 1, K != V
    add("odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), BT32, scale=0.3)  # T not a multiple of BT, two row blocks
    add("varlen", Shape(1, 0, 2, 4, 16, 16, 4, gate, True), BT16, seq_lens=[1, 17, 0, 5])  # an empty sequence
    # four row blocks; KDA's with gates down to -8: some diagonal blocks exact, some not
    gmin = {"gate_min": -8.0} if gate is Gate.CHANNEL else {}
    add("BT64-all", Shape(1, 70, 2, 4, 16, 16, 1, gate), {"BT": 64, "BC": 16, "SAVE": "all"}, **gmin)
    tiles = {"BT": 32, "BC": 16, "SAVE": "none", "dh_BV": 16, "dv_BV": 16, "dqk_BK": 16, "dqk_BV": 16}
    add("tiles-noh0", Shape(1, 40, 2, 4, 24, 20, 1, gate), tiles, h0=False, final=False)  # K, V tiles; padded dims
    # FUSE_DV = False: the dv stage, KDA's per-row-block pairwise stage and the dq/dk stage apart (odd T, padded dims,
    # packed sequences, a scale)
    split = {"FUSE_DV": False}
    add("tiles-split", Shape(1, 20, 2, 4, 24, 20, 1, gate), {**tiles, **split}, h0=False, final=False)  # one chunk
    varlen = Shape(1, 0, 2, 4, 16, 16, 4, gate, True)
    add("varlen-split", varlen, {**BT16, **split}, seq_lens=[1, 17, 0, 5], scale=0.3)
    if gate is not Gate.NONE:
        add("inf", Shape(1, 50, 2, 4, 16, 16, 1, gate), BT32, inf=True)  # −inf gates: a full forget
        # KDA: the exact diagonal blocks. dh0's tolerance: gates below GATE_FLOOR (-20) are clamped to it, which moves a
        # gradient that decayed through them by up to e^-20 ~ 2e-9 (absolute; below float32's rounding of any term of
        # the outputs); here every head's dh0 has decayed to 4e-6 or less (one head's to 1e-22), so that is 8e-4 of it
        h0_tol = {"h0_tol": 2e-3} if gate is Gate.SCALAR else {}
        add("g60", Shape(1, 37, 2, 4, 16, 16, 1, gate), BT32, gate_min=-60.0, **h0_tol)
# KDA's exact diagonal blocks of 32 rows in one chunk of 64 (its last row block partial), with the split stages (g60:
# the fused ones, blocks of 16)
add("BC32-split", Shape(1, 40, 2, 4, 16, 16, 1, Gate.CHANNEL), {"BT": 64, "BC": 32, "FUSE_DV": False}, gate_min=-60.0)
add("BC32", Shape(1, 70, 1, 1, 16, 16, 1, Gate.CHANNEL), {"BT": 64, "BC": 32}, gate_min=-60.0)
add("g60-split", Shape(1, 50, 1, 1, 16, 16, 1, Gate.CHANNEL), {**BT32, "FUSE_DV": False}, gate_min=-60.0)
add("g8-BT64", Shape(1, 70, 1, 1, 16, 16, 1, Gate.CHANNEL), {"BT": 64, "BC": 16}, gate_min=-8.0)  # some blocks exact
# KDA's pairwise block rows apart from stage 1's sub-chunks
add("dqkBC32", Shape(1, 70, 1, 1, 16, 16, 1, Gate.CHANNEL), {"BT": 64, "BC": 16, "dqk_BC": 32}, gate_min=-60.0)
add("dqkBC16", Shape(2, 37, 1, 2, 16, 32, 2, Gate.CHANNEL), {"BT": 32, "BC": 32, "dqk_BC": 16})
# The dq/dk stage's key tiles in a loop inside one program per chunk (dqk_KLOOP: the value side once, dVβ written over
# dV_new and read back by every key tile, KDA's one dA scratch copy): several key tiles (the last one partial at K =
# 40), strong decays, odd T, varlen with an empty sequence, K != V, with the reverse pass's dVβ and with the dv stage
KLOOP = {"dqk_KLOOP": True, "dqk_BK": 16}
add("kloop-g60-odd", Shape(1, 37, 2, 4, 32, 16, 1, Gate.CHANNEL), {**BT32, **KLOOP}, gate_min=-60.0, scale=0.3)
add("kloop-varlen", Shape(1, 0, 2, 4, 40, 24, 4, Gate.CHANNEL, True), {**BT16, **KLOOP}, seq_lens=[1, 17, 0, 5])
add("kloop-BT64-revdv", Shape(1, 70, 2, 4, 32, 16, 1, Gate.CHANNEL), {"BT": 64, "BC": 16, **KLOOP, "REVERSE_DV": True},
    gate_min=-60.0)  # fmt: skip
add("kloop-split", Shape(1, 40, 2, 4, 32, 16, 1, Gate.CHANNEL), {**BT32, **KLOOP, "FUSE_DV": False}, gate_min=-60.0)
# one pairwise block of 32 rows per chunk of 32: its exact element-wise diagonal (gates to -60) inside the key loop
add("kloop-dqkBC32", Shape(2, 37, 2, 4, 48, 32, 2, Gate.CHANNEL), {**BT32, **KLOOP, "dqk_BC": 32}, gate_min=-60.0)
# KDA's training forward by its one-pass stage 1 (fh_INTRA, T stored too): odd T with K != V and HV = 2H, strong
# decays (flagged chunks: the exact pass stores their T), varlen with an empty sequence at one sub-chunk per chunk,
# stage 1 re-run in the backward (SAVE "none") through the segmented reverse pass, everything saved
ONEPASS = {"fh_INTRA": "onepass"}
add("onepass-odd", Shape(2, 37, 2, 4, 16, 32, 2, Gate.CHANNEL), {**BT32, **ONEPASS}, scale=0.3)
add("onepass-g60", Shape(1, 50, 1, 2, 32, 16, 1, Gate.CHANNEL), {**BT32, **ONEPASS}, gate_min=-60.0)
add("onepass-varlen", Shape(1, 0, 2, 4, 16, 16, 4, Gate.CHANNEL, True), {**BT16, **ONEPASS}, seq_lens=[1, 17, 0, 5])
add("onepass-none-seg", Shape(1, 70, 1, 1, 16, 32, 1, Gate.CHANNEL),
    {**BT16, **ONEPASS, "SAVE": "none", "dh_SEG_CHUNKS": 2}, gate_min=-8.0)  # fmt: skip
add("onepass-all", Shape(1, 40, 1, 1, 16, 16, 1, Gate.CHANNEL), {**BT32, **ONEPASS, "SAVE": "all"}, h0=False)
# stage 1 under autograd by its own tiles (fi_*): several key and value tiles, K != V, grouped heads
FI = {"fi_BK": 16, "fi_BV": 16, "fi_num_warps": 2, "fi_num_stages": 1}
for gate in Gate:
    add("fi-tiles", Shape(1, 37, 1, 2, 32, 48, 1, gate), {**BT32, **FI}, scale=0.3)
add("fi-onepass", Shape(2, 20, 1, 2, 32, 16, 2, Gate.CHANNEL), {**BT32, **FI, **ONEPASS}, gate_min=-60.0)
# ... and its diagonal blocks inverted by repeated squaring (fi_SOLVE): 2 and 4 sub-chunks, odd T with strong decays,
# K != V and grouped heads, varlen with an empty sequence re-running stage 1 (SAVE "none"), KDA's one-pass stage 1
SQ = {"fi_SOLVE": "squaring"}
for gate in Gate:
    add("fiSQ-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **SQ}, scale=0.3, gate_min=-60.0)
    add("fiSQ-BT64-all", Shape(1, 70, 1, 2, 32, 16, 1, gate), {"BT": 64, "BC": 16, **SQ, "SAVE": "all"})
    add("fiSQ-varlen-none", Shape(1, 0, 2, 4, 16, 16, 4, gate, True), {**BT16, **SQ, "SAVE": "none"},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
add("fiSQ-onepass", Shape(2, 37, 1, 2, 32, 16, 2, Gate.CHANNEL), {**BT32, **SQ, **ONEPASS}, gate_min=-60.0)
for gate in (Gate.NONE, Gate.SCALAR):  # dA in registers over the key loop; Gated DeltaNet's dγ partial per key tile
    add("kloop-odd", Shape(2, 37, 2, 4, 40, 16, 2, gate), {**BT32, **KLOOP}, scale=0.3)
# Gated DeltaNet's dq/dk stage with both dA decayed by its value side before their rounding (dqk_DECAY = "value"):
# odd T with strong decays and K != V, several key tiles, the key loop (its dA from the kernel's value side), the
# reverse pass's dVβ, varlen with an empty sequence, grouped heads, -inf gates, chunks of 64
DGR = {"dqk_DECAY": "value"}
add("dgrows-odd", Shape(2, 37, 2, 4, 16, 32, 2, Gate.SCALAR), {**BT32, **DGR}, scale=0.3, gate_min=-60.0)
add("dgrows-ktiles", Shape(1, 40, 2, 4, 40, 24, 1, Gate.SCALAR), {**BT16, **DGR, "dqk_BK": 16})
add("dgrows-kloop", Shape(2, 37, 2, 4, 40, 16, 2, Gate.SCALAR), {**BT32, **KLOOP, **DGR}, scale=0.3)
add("dgrows-revdv-varlen", Shape(1, 0, 2, 4, 16, 16, 4, Gate.SCALAR, True), {**BT16, **DGR, "REVERSE_DV": True},
    seq_lens=[1, 17, 0, 5])  # fmt: skip
add("dgrows-inf", Shape(1, 50, 2, 4, 16, 16, 1, Gate.SCALAR), {**BT32, **DGR}, inf=True)
add("dgrows-BT64-all", Shape(1, 70, 1, 2, 32, 16, 1, Gate.SCALAR), {"BT": 64, "BC": 16, **DGR, "SAVE": "all"})

# The reverse pass: transposed adjoint (dh_LAYOUT = "vk") and sequence-parallel (dh_SEG_CHUNKS: segments of 1-2 chunks
# so that every sequence has several), with grouped heads (H = 2, HV = 4), K != V, varlen with an empty sequence
VK = {"dh_LAYOUT": "vk"}
for gate in Gate:
    add("vk-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **VK}, scale=0.3)
    add("vk-tiles-noh0", Shape(1, 40, 1, 1, 24, 40, 1, gate), {**tiles, **VK, "SAVE": "intra"}, h0=False, final=False)
    seg = {"dh_SEG_CHUNKS": 1}
    add("seg-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **seg, "dh_BV": 16}, scale=0.3)
    add("seg-varlen", Shape(1, 0, 2, 4, 16, 16, 5, gate, True), {**BT16, **seg}, seq_lens=[1, 17, 0, 40, 2])
    add("seg-vk-KneV", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **VK, "dh_SEG_CHUNKS": 2, "dh_BV": 16})
    add("seg-noh0", Shape(1, 50, 1, 1, 16, 32, 1, gate), {**BT16, **seg, "SAVE": "none"}, h0=False, final=False)
    add("seg-T1", Shape(2, 1, 2, 4, 16, 32, 2, gate), {**BT16, **seg})  # one chunk: the plain pass
    # dVβ, dv and dβ's v part in the reverse pass (REVERSE_DV): by value tiles (two slots of dβ's v part), transposed,
    # sequence-parallel
    rdv = {"REVERSE_DV": True}
    add("revdv-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **rdv, "dh_BV": 16}, scale=0.3)
    add("revdv-vk-seg-varlen", Shape(1, 0, 2, 4, 16, 16, 5, gate, True), {**BT16, **rdv, **VK, **seg},
        seq_lens=[1, 17, 0, 40, 2])  # fmt: skip
    add("revdv-tiles-noh0", Shape(1, 40, 1, 1, 24, 40, 1, gate), {**tiles, **rdv}, h0=False, final=False)
    # the forward state pass's tiles under autograd and in the re-run (fh_*: here two value tiles of 16)
    add("fh", Shape(1, 37, 1, 2, 16, 32, 1, gate), {**BT32, "fh_BV": 16, "fh_num_stages": 1})
    # ... and its tiles by TMA descriptors (fh_TMA): two value tiles, grouped heads, every intermediate kept, the
    # re-run of "intra", varlen with an empty sequence
    tma = {"fh_TMA": True, "fh_BV": 16}
    add("fh-tma-all", Shape(1, 37, 1, 2, 16, 32, 1, gate), {**BT32, **tma, "SAVE": "all"}, scale=0.3)
    add("fh-tma-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **tma}, seq_lens=[1, 17, 0, 20])
    # ... and its chunk states and V_new stored through TMA descriptors (fh_STORE_TMA): two value tiles, odd T (a
    # partial last chunk by pointers) with every intermediate kept, grouped heads, varlen with an empty sequence
    # re-running the state pass with its loads by TMA too (the transposed forward pass: the test of its launches below)
    fst = {"fh_STORE_TMA": True, "fh_BV": 16}
    add("fhSTORE-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **fst, "SAVE": "all"}, scale=0.3, gate_min=-60.0)
    add("fhSTORE-vk-tma-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **fst, **tma, **VK},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
# The reverse pass's loads by TMA descriptors (dh_TMA): rows past a sequence's end are the next sequence's tokens,
# zeroed after the load: odd T, varlen with an empty sequence and partial chunks, transposed with REVERSE_DV (T and v
# by descriptors too), the segmented pass (phase 3 by descriptors, phase 1 by pointers), grouped heads, K != V
TMA_DH = {"dh_TMA": True}
for gate in Gate:
    add("dhTMA-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **TMA_DH}, scale=0.3, gate_min=-60.0)
    add("dhTMA-vk-revdv-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **TMA_DH, **VK, **rdv},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
    add("dhTMA-seg", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **TMA_DH, **rdv, "dh_SEG_CHUNKS": 2, "dh_BV": 16})
# ... and its store of each chunk's adjoint by TMA (dh_STORE_TMA): kv and transposed ("vk"), several value tiles,
# with and without the loads by TMA, varlen with an empty sequence and partial chunks, the segmented pass's phase 3
STORE_DH = {"dh_STORE_TMA": True}
for gate in Gate:
    add("dhSTORE-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **STORE_DH, "dh_BV": 16}, gate_min=-60.0)
    add("dhSTORE-vk-tma-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **STORE_DH, **TMA_DH, **VK, **rdv},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
    add(
        "dhSTORE-seg", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **STORE_DH, **rdv, "dh_SEG_CHUNKS": 2, "dh_BV": 16}
    )
# ... and the dq/dk stage's value-side and state tiles by TMA descriptors (dqk_TMA): fused with its own value side
# (dV_new and v by descriptors), with the reverse pass's dVβ, several key and value tiles, the key loop with dVβ given,
# varlen with partial chunks and an empty sequence
TMA_DQK = {"dqk_TMA": True}
for gate in Gate:
    add("dqkTMA-odd", Shape(2, 37, 2, 4, 32, 32, 2, gate), {**BT16, **TMA_DQK, "dqk_BK": 16, "dqk_BV": 16},
        scale=0.3, gate_min=-60.0)  # fmt: skip
    add("dqkTMA-revdv-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT32, **TMA_DQK, **rdv, "dqk_BV": 16},
        seq_lens=[1, 40, 0, 20])  # fmt: skip
    add("dqkTMA-kloop-revdv", Shape(1, 37, 1, 2, 32, 16, 1, gate),
        {**BT16, **TMA_DQK, **rdv, "dqk_KLOOP": True, "dqk_BK": 16}, gate_min=-60.0)  # fmt: skip
for gate in (Gate.NONE, Gate.SCALAR):
    # no U stored: the training forward's state pass (and the re-run) forms V_new from T (fh_U), with several
    # sub-chunks (BT 32 = 2 x 16, at 64 four), by TMA (the zero blocks of T above its diagonal loaded), K != V,
    # grouped heads, strong decays, varlen with an empty sequence, every intermediate kept, stage 1 re-run too
    ur = {"fh_U": "recomputed"}
    add("fhU-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **ur}, scale=0.3, gate_min=-60.0)
    add("fhU-BT64-tma-all", Shape(1, 70, 1, 2, 16, 32, 1, gate), {"BT": 64, "BC": 16, **ur, **tma, "SAVE": "all"})
    add("fhU-varlen-none", Shape(1, 0, 2, 4, 16, 16, 4, gate, True), {**BT16, **ur, "SAVE": "none"},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
    add("fhU-seg-revdv", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **ur, **rdv, "dh_SEG_CHUNKS": 2})
    # stage 1 storing T alone (fh_W: the reverse pass forms Wᵀ dV_new from K and its dVβ, on its chain) and no A_qk
    # (fh_AQK: formed by the state pass's fused output and by the reverse pass): odd T with strong decays, K != V and
    # grouped heads, by value tiles of 16 (two dβ slots) and transposed; BT 64 by TMA with everything kept; varlen with
    # an empty sequence re-running stage 1 (SAVE "none"); the segmented reverse pass (phase 1 forms dVβ too)
    wr = {**ur, **rdv, "fh_W": "recomputed"}
    qr = {"fh_AQK": "recomputed"}
    add("fhW-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **wr, "dh_BV": 16}, scale=0.3, gate_min=-60.0)
    add("fhW-AQK-vk-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **wr, **qr, **VK}, gate_min=-60.0)
    add("fhAQK-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **qr}, scale=0.3, gate_min=-60.0)
    # ... by TMA, the backward's re-run of the state pass too (SAVE "intra": a pass without the output reads no A_qk)
    add("fhAQK-tma-intra", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **qr, **tma}, gate_min=-60.0)
    add("fhW-AQK-BT64-tma-all", Shape(1, 70, 1, 2, 16, 32, 1, gate),
        {"BT": 64, "BC": 16, **wr, **qr, **tma, "SAVE": "all"})  # fmt: skip
    add("fhW-AQK-varlen-none", Shape(1, 0, 2, 4, 16, 16, 4, gate, True), {**BT16, **wr, **qr, "SAVE": "none"},
        seq_lens=[1, 17, 0, 20])  # fmt: skip
    add("fhW-AQK-seg", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **wr, **qr, "dh_SEG_CHUNKS": 2}, gate_min=-60.0)
    # W formed per chunk in the reverse pass, off its chain (fh_W = "rebuilt"): odd T with strong decays, vk with no
    # A_qk, the segmented pass (phase 1 forms W too), varlen by TMA
    rb = {**wr, "fh_W": "rebuilt"}
    add("fhWrb-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **rb, "dh_BV": 16}, scale=0.3, gate_min=-60.0)
    add("fhWrb-AQK-vk-seg", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **rb, **qr, **VK, "dh_SEG_CHUNKS": 2},
        gate_min=-60.0)  # fmt: skip
    add("fhWrb-dhTMA-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT32, **rb, **TMA_DH, "SAVE": "all"},
        seq_lens=[1, 40, 0, 20])  # fmt: skip
    add("fhW-dhTMA-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT32, **wr, **TMA_DH, "SAVE": "all"},
        seq_lens=[1, 40, 0, 20])  # fmt: skip

# The reverse pass's last chain product accumulated by the dot, an operand negated (dh_ACC), in the form that is not the
# gate's default (on for Gated DeltaNet, whose other cases run it): W read, kv and vk, odd T with strong decays, K != V,
# grouped heads, the segmented pass (phase 1's transitions too) with REVERSE_DV; W formed from K (fh_W) transposed
for gate in Gate:
    flip = {"dh_ACC": gate != Gate.SCALAR}
    add("dhACC-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **flip}, scale=0.3, gate_min=-60.0)
    add("dhACC-vk-revdv-seg", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **flip, **VK, **rdv, "dh_SEG_CHUNKS": 2})
    if gate != Gate.CHANNEL:
        add("dhACC-fhW-vk-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT32, **wr, **VK, **flip}, gate_min=-60.0)

# The chunk-parallel stages' work inside the reverse pass (REVERSE_DQK; DeltaNet, Gated DeltaNet): odd T with strong
# decays, K != V and grouped heads, kv and vk; −inf gates; varlen with an empty sequence and partial chunks re-running
# the state pass (SAVE "intra") by TMA; the segmented pass (phase 3 forms the gradients) with no W or A_qk stored and
# no initial or final state; T = 1; no grouped heads (dq, dk stored directly); padded dims (K = 24, V = 20) at BT 64
DQK = {**rdv, "REVERSE_DQK": True}
for gate in (Gate.NONE, Gate.SCALAR):
    add("dqk-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **DQK}, scale=0.3, gate_min=-60.0)
    add("dqk-vk-odd", Shape(2, 37, 2, 4, 32, 16, 2, gate), {**BT32, **DQK, **VK, "SAVE": "all"}, gate_min=-60.0)
    add("dqk-tma-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **DQK, **TMA_DH, "SAVE": "intra"},
        seq_lens=[1, 17, 0, 40])  # fmt: skip
    add("dqk-seg-fhW-noh0", Shape(1, 50, 1, 2, 32, 16, 1, gate), {**BT16, **DQK, **wr, **qr, "dh_SEG_CHUNKS": 2},
        h0=False, final=False)  # fmt: skip
    add("dqk-T1", Shape(2, 1, 2, 4, 16, 32, 2, gate), {**BT16, **DQK, "SAVE": "none"})
    add("dqk-HVeqH", Shape(2, 37, 2, 2, 32, 32, 2, gate), {**BT32, **DQK, **VK})  # dq, dk stored in q's dtype
    add("dqk-BT64-pad", Shape(1, 70, 2, 4, 24, 20, 1, gate), {"BT": 64, "BC": 16, **DQK, **VK, "SAVE": "all"})
add("dqk-inf", Shape(1, 50, 2, 4, 16, 16, 1, Gate.SCALAR), {**BT32, **DQK}, inf=True)
# ... by value tiles (dh_BV < V: the adjoint in a float32 scratch, the contractions summed over the tiles): odd T with
# strong decays and two tiles, three tiles with a partial one (V = 40), varlen with an empty sequence, the segmented
# pass without W or A_qk stored and no initial or final state, W rebuilt, no grouped heads
TILED = {**DQK, "dh_BV": 16}
for gate in (Gate.NONE, Gate.SCALAR):
    add("dqkt-odd", Shape(2, 37, 2, 4, 16, 32, 2, gate), {**BT16, **TILED}, scale=0.3, gate_min=-60.0)
    add("dqkt-V40", Shape(1, 40, 2, 4, 24, 40, 1, gate), {**BT32, **TILED, "SAVE": "all"})
    add("dqkt-varlen", Shape(1, 0, 2, 4, 16, 32, 4, gate, True), {**BT16, **TILED}, seq_lens=[1, 17, 0, 40])
    add("dqkt-seg-fhW-noh0", Shape(1, 50, 1, 2, 32, 32, 1, gate), {**BT16, **TILED, **wr, **qr, "dh_SEG_CHUNKS": 2},
        h0=False, final=False)  # fmt: skip
    add("dqkt-rebuilt-HVeqH", Shape(2, 37, 2, 2, 32, 32, 2, gate), {**BT32, **TILED, **rb, "SAVE": "none"})


@pytest.mark.parametrize(("problem", "seq_lens", "h0", "cfg", "extra"), list(CASES.values()), ids=list(CASES))
def test_gradients_match_loop(
    problem: Shape, seq_lens: list[int] | None, h0: bool, cfg: dict[str, Any], extra: dict[str, Any]
) -> None:
    x = make_inputs(problem, seed=5, seq_lens=seq_lens, initial_state=h0, gate_min=extra.get("gate_min", -5.0))
    if extra.get("inf"):
        x = with_inf_gates(x)
    errs = gradients_vs_loop(problem, x, cfg, scale=extra.get("scale"), final=extra.get("final", True))
    assert_close(errs, TOL[torch.float32], extra.get("h0_tol"))


# The forward under autograd through the forward's sequence-parallel state pass (its config's SEG_CHUNKS): SAVE =
# "intra" keeps the segments' entering states for the backward's re-run, "none" computes them again, "all" keeps the
# chunk states; with the sequence-parallel reverse pass too.
SEG_FWD = {"BT": 16, "BC": 16, "SEG_CHUNKS": 1, "FUSE_OUTPUT": True}
SEG_FWD_CASES = {
    f"{g.value}-{save}": (Shape(1, 0, 2, 4, 16, 32, 4, g, True), save)
    for g in Gate
    for save in ("intra", "none", "all")
}


@pytest.mark.parametrize(("problem", "save"), list(SEG_FWD_CASES.values()), ids=list(SEG_FWD_CASES))
def test_gradients_with_the_segmented_forward(problem: Shape, save: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtune.kernels.chunk import state

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(state, "chunk_state_kernel", _Spy(state.chunk_state_kernel, launched))
    x = make_inputs(problem, seed=8, seq_lens=[33, 0, 20, 50])
    cfg = {**BT16, "SAVE": save, "dh_SEG_CHUNKS": 2 if save == "intra" else 0}
    errs = gradients_vs_loop(problem, x, cfg, fwd_config=SEG_FWD)
    assert_close(errs, TOL[torch.float32])
    # phases 1 (transitions) and 3 of the forward under autograd; the re-run: phase 3 alone from the kept segment
    # starts ("intra"), all again ("none": the plain forward, then stage 1 and the state pass in the backward)
    want = {"intra": [1, 2, 2], "none": [1, 2, 1, 2], "all": [1, 2]}[save]
    assert [r["SEG"] for r in launched] == want


@pytest.mark.parametrize("save", ["intra", "none", "all"])
@pytest.mark.parametrize("gate_min", [-5.0, -0.1], ids=["strong", "mild"])
def test_gradients_with_the_burn_in_forward(save: str, gate_min: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward under autograd with segments started by burn-in (``SEG_START = "burnin"``): phase 3 alone, no
    transitions, in the forward and in the backward's re-run; its chunk states (``SAVE = "all"``, read by the backward)
    stored only by the segment that owns them. Strong gates (a short burn-in) and mild ones (back to each sequence's
    start), varlen with an empty sequence."""
    from dtune.kernels.chunk import state

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(state, "chunk_state_kernel", _Spy(state.chunk_state_kernel, launched))
    p = Shape(1, 0, 2, 4, 16, 32, 4, Gate.SCALAR, True)
    x = make_inputs(p, seed=8, seq_lens=[33, 0, 20, 50], gate_min=gate_min)
    cfg = {**BT16, "SAVE": save}
    errs = gradients_vs_loop(p, x, cfg, fwd_config={**SEG_FWD, "SEG_START": "burnin"})
    assert_close(errs, TOL[torch.float32])
    assert launched and all(r["SEG"] == 2 and r["BURNIN"] for r in launched)


BURN_CASES = {
    "kv": {"dh_LAYOUT": "kv"},
    "vk-revdv": {"dh_LAYOUT": "vk", "REVERSE_DV": True},
    "kv-revdv-fhW": {"REVERSE_DV": True, "fh_U": "recomputed", "fh_W": "recomputed", "SAVE": "all"},
    "vk-tma-store": {"dh_LAYOUT": "vk", "dh_TMA": True, "dh_STORE_TMA": True, "REVERSE_DV": True, "dh_BV": 32},
}


@pytest.mark.parametrize("case", list(BURN_CASES), ids=list(BURN_CASES))
@pytest.mark.parametrize("gate_min", [-5.0, -0.1], ids=["strong", "mild"])
def test_gradients_with_the_burn_in_reverse_pass(case: str, gate_min: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reverse pass's segments ended by burn-in (``dh_SEG_START = "burnin"``): phase 3 alone, each segment walking
    back from a zero adjoint past its end (or from the final state's gradient at its sequence's end), nothing past its
    end stored; with the training forward's burn-in too. Strong gates (a chunk or two) and mild ones (to each
    sequence's end), varlen with an empty sequence (its initial state's gradient is its final state's), segments of
    one chunk; the programs run last first (the interpreter's order would hide a store past a segment's end)."""
    from dtune.kernels.chunk import bwd_state

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(bwd_state, "chunk_bwd_state_kernel", _Spy(bwd_state.chunk_bwd_state_kernel, launched))
    p = Shape(1, 0, 2, 4, 16, 32, 4, Gate.SCALAR, True)
    x = make_inputs(p, seed=9, seq_lens=[33, 0, 20, 90], gate_min=gate_min)
    if gate_min < -1 and x["g"] is not None:  # every gate at or below −3: a segment's burn-in ends within the sequence
        x["g"] = torch.minimum(x["g"], torch.full_like(x["g"], -3.0))
    cfg = {**BT16, "dh_SEG_CHUNKS": 1, "dh_SEG_START": "burnin", **BURN_CASES[case]}
    fwd = {**SEG_FWD, "SEG_START": "burnin"} if case.startswith("vk") else None
    with reversed_programs():  # (a segment's stores past its end would land after its owner's)
        errs = gradients_vs_loop(p, x, cfg, fwd_config=fwd)
    assert_close(errs, TOL[torch.float32])
    assert [(r["SEG"], r.get("BURNIN")) for r in launched] == [(2, True)]


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_float16(gate: Gate) -> None:
    p = Shape(1, 40, 2, 4, 16, 16, 1, gate)
    x = make_inputs(p, dtype=torch.float16, seed=4)
    assert_close(gradients_vs_loop(p, x, BT32), TOL[torch.float16])


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_grouped_partials_in_the_inputs_dtype(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """dqk_GROUP: with grouped value heads the dq/dk stage's per-value-head partials reach the group sum in float32
    (the default) or in the inputs' dtype ("input"); the gradients match float64 either way (float16 here: bf16 dots
    are wrong under the interpreter)."""
    seen: list[torch.dtype] = []
    real = chunk_bwd.launch_group_sum

    def spy(dq: torch.Tensor, *args: Any) -> None:
        seen.append(dq.dtype)
        real(dq, *args)

    monkeypatch.setattr(chunk_bwd, "launch_group_sum", spy)
    p = Shape(1, 40, 2, 4, 16, 16, 1, gate)
    x = make_inputs(p, dtype=torch.float16, seed=4)
    for group, dtype in (("input", torch.float16), ("float32", torch.float32)):
        assert_close(gradients_vs_loop(p, x, {**BT32, "dqk_GROUP": group}), TOL[torch.float16])
        assert seen.pop() == dtype and not seen
    with pytest.raises(ValueError, match="dqk_GROUP"):
        chunk_bwd.check_config(16, 16, gate.value, {"dqk_GROUP": "bf16"})


@pytest.mark.parametrize("gate", [Gate.CHANNEL, Gate.SCALAR], ids=["kda", "gdn"])
def test_inf_gates_give_zero_gate_gradient(gate: Gate) -> None:
    """A −inf gate is a full forget: its gradient is exactly 0 (the clamp's), and nothing is NaN (Gated DeltaNet's
    gradient is a reverse sum over the chunk, which passes through the clamped rows: the finish stage zeroes them)."""
    p = Shape(1, 30, 2, 4, 16, 16, 1, gate)
    x = with_inf_gates(make_inputs(p, seed=2), every=5)
    g = x["g"].clone().requires_grad_()
    op = ops.chunk_kda if gate is Gate.CHANNEL else ops.chunk_gated_delta_rule
    o, _ = op(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["initial_state"], bwd_config=BT16)
    o.sum().backward()
    assert g.grad is not None and torch.isfinite(g.grad).all()
    assert (g.grad[torch.isinf(x["g"])] == 0).all()
    assert (g.grad[~torch.isinf(x["g"])] != 0).any()


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_second_reference_matches_autograd(gate: Gate) -> None:
    """The float64 chunk-backward formulas (reference_bwd) equal autograd through the loop, −inf gates included."""
    p = Shape(1, 0, 2, 4, 8, 12, 3, gate, True)
    x = make_inputs(p, seed=7, seq_lens=[9, 0, 20])
    x = with_inf_gates(x, every=11)
    ref = {n: (x[n].double().requires_grad_() if x[n] is not None else None) for n in NAMES}
    o, s = naive_recurrent(
        *(ref[n] for n in ("q", "k", "v", "g", "beta")),
        scale=0.4,
        initial_state=ref["initial_state"],
        output_final_state=True,
        cu_seqlens=x["cu_seqlens"],
    )
    assert s is not None
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(s.shape, generator=gen).double()
    ((o * do).sum() + (s * dht).sum()).backward()
    mine = chunk_backward_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht, scale=0.4, initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"], chunk_size=8,
    )  # fmt: skip
    for n in NAMES:
        if ref[n] is not None:
            got = mine[n]
            assert got is not None
            # 1e-8, not float64 rounding: a −inf gate is clamped to GATE_FLOOR = −20, whose decay e^-20 ≈ 2e-9 is
            # the difference from the exact full forget (a formula error shows as 1e-2 or more)
            assert rel_err(got, ref[n].grad) < 1e-8, n


def test_config_is_checked() -> None:
    assert chunk_bwd.check_config(64, 64, "channel", None) == chunk_bwd.default_config(64, 64, "channel")
    with pytest.raises(ValueError, match="unknown parameter"):
        chunk_bwd.check_config(64, 64, "none", {"intra_BK": 32})  # a forward parameter
    with pytest.raises(ValueError, match="BC <= BT <= 4"):
        chunk_bwd.check_config(64, 64, "none", {"BT": 16, "BC": 32})
    with pytest.raises(ValueError, match="BC <= BT <= 4"):
        chunk_bwd.check_config(64, 64, "none", {"BT": 128, "BC": 16})
    with pytest.raises(ValueError, match="SAVE"):
        chunk_bwd.check_config(64, 64, "scalar", {"SAVE": "some"})
    with pytest.raises(ValueError, match="dqk_BC <= BT <= 4"):
        chunk_bwd.check_config(64, 64, "channel", {"BT": 16, "BC": 16, "dqk_BC": 32})
    with pytest.raises(ValueError, match="unknown parameter"):
        chunk_bwd.check_config(64, 64, "scalar", {"dqk_BC": 16})  # KDA's only
    with pytest.raises(ValueError, match="REVERSE_DV needs FUSE_DV"):
        chunk_bwd.check_config(64, 64, "none", {"REVERSE_DV": True, "FUSE_DV": False})
    for gate in ("none", "scalar", "channel"):
        legal = chunk_bwd.legal_params(gate)
        for K, V in ((16, 16), (128, 128), (256, 64)):
            cfg = chunk_bwd.default_config(K, V, gate)
            assert set(cfg) == set(legal) and all(cfg[n] in legal[n] for n in cfg)


def test_gate_floor_is_a_full_forget_in_float32() -> None:
    """What crosses a clamped step is below float32's relative rounding."""
    assert torch.exp(torch.tensor(GATE_FLOOR, dtype=torch.float32)) < torch.finfo(torch.float32).eps


@pytest.mark.parametrize("fused", [False, True])
def test_forward_config_is_honoured_under_autograd(fused: bool) -> None:
    """The forward's own parameters (here FUSE_OUTPUT, the state layout) apply to the forward under autograd."""
    p = Shape(1, 37, 2, 4, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=6)
    leaves = {n: (x[n].clone().requires_grad_() if x[n] is not None else None) for n in NAMES}
    fwd = {"FUSE_OUTPUT": fused, "STATE_LAYOUT": "vk", "h_BV": 16}
    o, _ = ops.chunk_gated_delta_rule(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves["initial_state"], config=fwd,
        bwd_config=BT32,
    )  # fmt: skip
    o_ref, _ = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
    assert rel_err(o, o_ref) < TOL[torch.float32]
    o.sum().backward()
    assert all(leaves[n].grad is not None and torch.isfinite(leaves[n].grad).all() for n in NAMES)


def test_backward_config_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters that change no result reach their launches: dh_LAYOUT (TRANS), dh_SEG_CHUNKS (the three
    phases), KDA's dqk_BC (the pairwise blocks' BC), fh_BV (the forward state pass's tile under autograd)."""
    from dtune.kernels.chunk import bwd_state, state

    rev: list[dict[str, Any]] = []
    fwd: list[dict[str, Any]] = []
    dqk: list[dict[str, Any]] = []
    monkeypatch.setattr(bwd_state, "chunk_bwd_state_kernel", _Spy(bwd_state.chunk_bwd_state_kernel, rev))
    monkeypatch.setattr(state, "chunk_state_kernel", _Spy(state.chunk_state_kernel, fwd))
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_dqk_kernel", _Spy(chunk_bwd.chunk_bwd_dqk_kernel, dqk))
    p = Shape(1, 50, 1, 1, 16, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=9)
    cfg = {"BT": 16, "BC": 16, "dh_LAYOUT": "vk", "dh_SEG_CHUNKS": 2, "dqk_BC": 16, "fh_BV": 16}
    errs = gradients_vs_loop(p, x, cfg)
    assert_close(errs, TOL[torch.float32])
    assert [r["SEG"] for r in rev if "SEG" in r] == [1, 2] and all(r["TRANS"] for r in rev)
    assert len(rev) == 2  # phase 1 and phase 3 (phase 2 is its own kernel)
    assert {r["BV"] for r in fwd} == {16} and len(fwd) == 2  # the forward under autograd and the re-run
    assert [r["BC"] for r in dqk] == [16]
    rev.clear()
    dqk.clear()
    gradients_vs_loop(p, x, {**cfg, "BT": 32, "dqk_BC": 32})
    assert [r["BC"] for r in dqk] == [32]


@pytest.mark.parametrize("save", ["intra", "none"])
def test_training_forward_stage_1_follows_fh_intra(save: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KDA's ``fh_INTRA = "onepass"``: the forward under autograd (with SAVE "none": the backward's re-run) runs
    the one-pass stage 1 storing T, the blocks kernel only as its exact pass of flagged chunks; "blocks" never runs
    the one-pass kernel there. An illegal sub-chunk count is refused."""
    one: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] = []
    monkeypatch.setattr(chunk_bwd, "chunk_intra_onepass_kernel", _Spy(chunk_bwd.chunk_intra_onepass_kernel, one))
    monkeypatch.setattr(chunk_bwd, "chunk_intra_blocks_kernel", _Spy(chunk_bwd.chunk_intra_blocks_kernel, blocks))
    p = Shape(1, 40, 1, 1, 16, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=4)
    errs = gradients_vs_loop(p, x, {"BT": 32, "BC": 16, "SAVE": save, "fh_INTRA": "onepass"})
    assert_close(errs, TOL[torch.float32])
    # once: under autograd ("intra"), or in the backward's re-run ("none", whose forward is the forward config's)
    assert len(one) == 1 and one[0]["STORE_AI"] and one[0]["DIAG"] == 1
    assert len(blocks) == 1 and blocks[0]["DIAG"] == 2  # only the exact pass
    one.clear()
    blocks.clear()
    errs = gradients_vs_loop(p, x, {"BT": 32, "BC": 16, "SAVE": save})
    assert not one and [r["DIAG"] for r in blocks] == [1, 2]
    with pytest.raises(ValueError, match="fh_INTRA='onepass' holds 1 or 2 sub-chunks"):
        chunk_bwd.check_config(16, 16, "channel", {"BT": 64, "BC": 16, "fh_INTRA": "onepass"})


def test_stage_1_tiles_under_autograd_reach_their_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """fi_BK, fi_BV, fi_num_warps, fi_num_stages set stage 1's launch under autograd; 0 keeps the forward config's."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(chunk_bwd, "chunk_intra_blocks_kernel", _Spy(chunk_bwd.chunk_intra_blocks_kernel, seen))
    p = Shape(1, 40, 1, 1, 32, 32, 1, Gate.SCALAR)
    x = make_inputs(p, seed=5)
    fwd = {"intra_BK": 32, "intra_BV": 32, "intra_num_warps": 1, "intra_num_stages": 2}
    for bwd, want in (
        ({}, (32, 32, 1, 2)),
        ({"fi_BK": 16, "fi_BV": 16, "fi_num_warps": 4, "fi_num_stages": 1}, (16, 16, 4, 1)),
    ):
        seen.clear()
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if t is not None}
        o, _ = ops.chunk_gated_delta_rule(
            *(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves["initial_state"],
            config={"BT": 32, "BC": 16, **fwd}, bwd_config={**BT32, **bwd},
        )  # fmt: skip
        o.sum().backward()
        assert [(r["BK"], r["BV"], r["num_warps"], r["num_stages"]) for r in seen] == [want]


def test_state_pass_loads_under_autograd_follow_fh_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    """fh_TMA loads the training forward's state pass (and its re-run) by TMA descriptors, whatever the forward config
    says (here STATE_TMA on: off under autograd without fh_TMA); a shape whose tiles cannot be described falls back to
    pointer loads (K = 24, not a power of two)."""
    from dtune.kernels.chunk import state

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(state, "chunk_state_kernel", _Spy(state.chunk_state_kernel, seen))
    fwd = {"BT": 16, "BC": 16, "STATE_TMA": True, "h_BV": 16}
    for K, bwd, want in (
        (16, {"SAVE": "intra"}, [False, False]),
        (16, {"SAVE": "intra", "fh_TMA": True}, [True, True]),
        (16, {"SAVE": "all", "fh_TMA": True}, [True]),
        (24, {"SAVE": "all", "fh_TMA": True}, [False]),
    ):
        seen.clear()
        p = Shape(1, 37, 1, 2, K, 32, 1, Gate.SCALAR)
        x = make_inputs(p, seed=4)
        assert_close(gradients_vs_loop(p, x, {**BT16, **bwd}, fwd_config=fwd), TOL[torch.float32])
        assert [bool(r["TMA"]) for r in seen] == want, (K, bwd)


def test_state_pass_stores_under_autograd_follow_fh_store_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    """fh_STORE_TMA stores the training forward's chunk states and V_new (SAVE "all"; with "intra" the re-run's, the
    forward under autograd storing none) through TMA descriptors, the transposed state pass ("vk") too; a shape whose
    tiles cannot be described stores by pointers (K = 24, not a power of two); without it, pointers. The gradients are
    the loop's either way."""
    from dtune.kernels.chunk import state

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(state, "chunk_state_kernel", _Spy(state.chunk_state_kernel, seen))
    fwd = {"BT": 16, "BC": 16, "h_BV": 16, "STATE_LAYOUT": "vk"}
    for K, bwd, want in (
        (16, {"SAVE": "intra"}, [False, False]),
        (16, {"SAVE": "intra", "fh_STORE_TMA": True}, [False, True]),  # (the forward under autograd stores none)
        (16, {"SAVE": "all", "fh_STORE_TMA": True, "fh_TMA": True}, [True]),
        (24, {"SAVE": "all", "fh_STORE_TMA": True}, [False]),
    ):
        seen.clear()
        p = Shape(1, 37, 1, 2, K, 32, 1, Gate.SCALAR)
        x = make_inputs(p, seed=4, gate_min=-60.0)
        assert_close(gradients_vs_loop(p, x, {**BT16, **bwd}, fwd_config=fwd), TOL[torch.float32])
        assert [r.get("hs_td") is not None and r.get("vn_td") is not None for r in seen] == want, (K, bwd)


def test_stage_one_inverse_under_autograd_follows_fi_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """fi_SOLVE reaches stage 1 where the training step launches it, under autograd (SAVE "all") and in the re-run
    (SAVE "none", whose forward under autograd is the forward config's own, here "squaring"): without it that stage 1
    substitutes whatever the forward config says; a backward config that asks for squaring at sub-chunks of 32 rows
    is refused (the gradient cases above pass with either inverse)."""
    from dtune.kernels.chunk import intra_blocks

    seen: list[dict[str, Any]] = []  # the forward's own launcher and the training step's, in launch order
    monkeypatch.setattr(intra_blocks, "chunk_intra_blocks_kernel", _Spy(intra_blocks.chunk_intra_blocks_kernel, seen))
    monkeypatch.setattr(chunk_bwd, "chunk_intra_blocks_kernel", _Spy(chunk_bwd.chunk_intra_blocks_kernel, seen))
    fwd = {"BT": 32, "BC": 16, "SOLVE": "squaring"}
    p = Shape(1, 37, 1, 2, 16, 32, 1, Gate.SCALAR)
    x = make_inputs(p, seed=5, gate_min=-60.0)
    for bwd, want in (
        ({"SAVE": "all"}, [0]),
        ({"SAVE": "all", "fi_SOLVE": "squaring"}, [1]),
        ({"SAVE": "none"}, [1, 0]),  # (SAVE "none": the forward under autograd is the forward config's own)
        ({"SAVE": "none", "fi_SOLVE": "squaring"}, [1, 1]),
    ):
        seen.clear()
        assert_close(gradients_vs_loop(p, x, {**BT32, **bwd}, fwd_config=fwd), TOL[torch.float32])
        assert [r["SOLVE"] for r in seen] == want, bwd
    with pytest.raises(ValueError, match="fi_SOLVE='squaring' inverts 16-row sub-chunks only"):
        chunk_bwd.check_config(16, 16, "scalar", {"BT": 64, "BC": 32, "fi_SOLVE": "squaring"})


def test_key_loop_reaches_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """dqk_KLOOP launches one program per chunk and value head with the key tiles in its loop (the gradient cases above
    would also pass with one program per key tile); with one key tile there is nothing to loop over."""
    dqk: list[dict[str, Any]] = []
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_dqk_kernel", _Spy(chunk_bwd.chunk_bwd_dqk_kernel, dqk))
    p = Shape(1, 20, 1, 2, 32, 16, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=3)
    assert_close(gradients_vs_loop(p, x, {**BT16, "dqk_KLOOP": True, "dqk_BK": 16}), TOL[torch.float32])
    gradients_vs_loop(p, x, {**BT16, "dqk_BK": 16})
    gradients_vs_loop(p, x, {**BT16, "dqk_KLOOP": True, "dqk_BK": 32})
    assert [(d["grid"][1], d["KLOOP"], d["NK"]) for d in dqk] == [(1, True, 2), (2, False, 2), (1, False, 1)]


def test_dqk_gate_rows_reach_their_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """dqk_DECAY reaches the dq/dk stage's launch (the gradient cases above would pass in either order); it is
    refused where it has nothing to order: no scalar gate, the dv stage apart, or no dq/dk stage (REVERSE_DQK)."""
    dqk: list[dict[str, Any]] = []
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_dqk_kernel", _Spy(chunk_bwd.chunk_bwd_dqk_kernel, dqk))
    p = Shape(1, 37, 1, 2, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=4, gate_min=-8.0)
    assert_close(gradients_vs_loop(p, x, {**BT16, **DGR}), TOL[torch.float32])
    gradients_vs_loop(p, x, BT16)
    assert [d["DA_DECAYED"] for d in dqk] == [True, False]
    with pytest.raises(ValueError, match="dqk_DECAY='value' decays Gated DeltaNet's dA in its fused dq/dk stage"):
        chunk_bwd.check_config(16, 16, "none", DGR)
    with pytest.raises(ValueError, match="unknown parameter"):
        chunk_bwd.check_config(16, 16, "channel", DGR)
    with pytest.raises(ValueError, match="FUSE_DV=False"):
        chunk_bwd.check_config(16, 16, "scalar", {**DGR, "FUSE_DV": False})
    with pytest.raises(ValueError, match="REVERSE_DQK=True"):
        chunk_bwd.check_config(16, 16, "scalar", {**DGR, "REVERSE_DV": True, "REVERSE_DQK": True})


def test_dqk_register_cap_reaches_its_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """dqk_maxnreg reaches the dq/dk stage's launch as Triton's ``maxnreg`` (a GPU compile obeys it:
    test_chunk_bwd_compile.py), no other backward launch gets one, and without a cap the stage launches without one;
    the interpreter, which drops the option, computes the reference's gradients."""
    from dtune.kernels.chunk import bwd_state

    dqk: list[dict[str, Any]] = []
    rev: list[dict[str, Any]] = []
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_dqk_kernel", _Spy(chunk_bwd.chunk_bwd_dqk_kernel, dqk))
    monkeypatch.setattr(bwd_state, "chunk_bwd_state_kernel", _Spy(bwd_state.chunk_bwd_state_kernel, rev))
    p = Shape(1, 37, 1, 2, 32, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=6, gate_min=-60.0)
    assert_close(gradients_vs_loop(p, x, {**BT16, "dqk_maxnreg": 128, "dqk_BK": 16}), TOL[torch.float32])
    gradients_vs_loop(p, x, {**BT16, "dqk_BK": 16})
    assert [d.get("maxnreg") for d in dqk] == [128, None]
    assert rev and all("maxnreg" not in r for r in rev)
    with pytest.raises(ValueError, match="dqk_maxnreg"):
        chunk_bwd.check_config(16, 16, "scalar", {"dqk_maxnreg": 100})


# A forward config that recomputes W, U and A_qk in its state pass (and loads its tiles by TMA): the forward under
# autograd still gives the backward what it reads, whatever it saves
RECOMPUTING_FWD = {"BT": 16, "BC": 16, "WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True, "h_BV": 16}


@pytest.mark.parametrize("save", ["none", "intra", "all"])
@pytest.mark.parametrize("gate", [Gate.NONE, Gate.SCALAR], ids=["none", "scalar"])
def test_gradients_under_a_recomputing_forward_config(gate: Gate, save: str) -> None:
    problem = Shape(1, 0, 2, 4, 16, 32, 4, gate, True)  # HV = 2H, K != V
    x = make_inputs(problem, seed=8, seq_lens=[33, 0, 20, 50])
    errs = gradients_vs_loop(problem, x, {**BT16, "SAVE": save}, fwd_config=RECOMPUTING_FWD)
    assert_close(errs, TOL[torch.float32])


def test_reverse_pass_descriptors_only_where_tiles_fit() -> None:
    """dh_TMA builds the reverse pass's descriptors (the dhTMA cases above then load by TMA: without zeroing the rows
    past a sequence they fail) only where every tile lies inside one head, and loads by pointers elsewhere."""
    from dtune.kernels.chunk.bwd_state import descriptors

    def tds(K: int, V: int, BV: int, on: bool = True, dv: bool = True) -> dict[str, Any]:
        q = torch.zeros(1, 40, 2, K)
        w, a, t = torch.zeros(40, 4, K), torch.zeros(40, 4, 16), torch.zeros(40, 4, 16)
        do, v = torch.zeros(1, 40, 4, V), torch.zeros(1, 40, 4, V)
        work = (t, v, torch.zeros(1, 40, 4), torch.zeros_like(v), torch.zeros(2, 40, 4)) if dv else None
        BK = 1 << (K - 1).bit_length()
        return descriptors(q, q, w, a, None, None, do, work, False, False, 2, 4, K, V, 16, BK, BV, {"dh_TMA": on})

    got = tds(16, 32, 16)
    assert got["TMA"] and set(got) == {"TMA", "do_td", "q_td", "k_td", "w_td", "a_td", "t_td", "v_td"}
    assert set(tds(16, 32, 32, dv=False)) == {"TMA", "do_td", "q_td", "k_td", "w_td", "a_td"}
    assert tds(16, 32, 16, on=False) == {}  # dh_TMA off
    assert tds(24, 32, 16) == {}  # K not a power of two: a K tile would cross into the next head
    assert tds(16, 40, 16) == {}  # BV does not divide V


def test_reverse_pass_adjoint_store_descriptor_only_where_tiles_fit() -> None:
    """dh_STORE_TMA gives the reverse pass a store descriptor (the dhSTORE cases above store through it: with a
    wrong row or column they fail) of whole [K, dh_BV] state tiles, and none where a tile would not be one."""
    from dtune.kernels.chunk.bwd_state import store_descriptor

    dh = torch.zeros(6, 4, 16, 32)  # [chunks, HV, K, V]
    got = store_descriptor(dh, 16, 32, 16, 16, {"dh_STORE_TMA": True})
    assert set(got) == {"xs_td"} and list(got["xs_td"].shape) == [6 * 4 * 16, 32]
    assert list(got["xs_td"].block_shape) == [16, 16]
    assert store_descriptor(dh, 16, 32, 16, 16, {"dh_STORE_TMA": False}) == {}
    assert store_descriptor(dh, 16, 32, 8, 16, {"dh_STORE_TMA": True}) == {}  # key tiles: not one state's rows
    assert store_descriptor(torch.zeros(6, 4, 16, 40), 16, 40, 16, 16, {"dh_STORE_TMA": True}) == {}  # BV ∤ V


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_seg_decay_skips_only_negligible_transitions(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the skip's threshold at −40 (kernels.config.SEG_SKIP_LOG is −104): a skipped transition is still representable
    from dtune.kernels.chunk import common

    monkeypatch.setattr(common, "SEG_SKIP_LOG", tl.constexpr(-40.0))
    """``dh_SEG_DECAY`` (and the training forward's ``SEG_DECAY``): three heads, segments of 32 tokens. Head 0 decays by
    1.5 per token (its transitions' bound e^-48: skipped, P stored as zeros), head 1 by at most 0.1 (kept), head 2 by
    1.5 with keys of norm 3 (the bound's key factor keeps it). Every gradient equals the float64 loop's; phase 1's P
    columns show which transitions were skipped."""
    from dtune.kernels.chunk import bwd_state

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(bwd_state, "chunk_bwd_state_kernel", _Spy(bwd_state.chunk_bwd_state_kernel, launched))
    p = Shape(1, 96, 3, 3, 16, 32, 1, Gate.SCALAR)  # 6 chunks of 16: 3 segments, 2 of them with a transition
    x = make_inputs(p, seed=35, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][..., 0] = -1.5
    x["g"][..., 2] = -1.5
    x["k"][:, :, 2] *= 3.0
    seg = {**BT16, "dh_SEG_CHUNKS": 2, "dh_LAYOUT": layout, "REVERSE_DV": True, "dh_SEG_DECAY": False}
    fwd = {**BT16, "SEG_CHUNKS": 2, "SEG_DECAY": True, "FUSE_OUTPUT": True}
    errs = gradients_vs_loop(p, x, {**seg, "dh_SEG_DECAY": True, "fh_SEG_DECAY": True}, fwd_config=fwd)
    assert_close(errs, TOL[torch.float32])
    gradients_vs_loop(p, x, seg, fwd_config=fwd)
    on, off = (kw["ext"][1:, :, :, p.V :] for kw in launched if kw.get("SEG") == 1)  # [segments 1, 2; HV, K, K]
    assert torch.all(on[:, 0] == 0), "head 0's transitions are negligible: stored as zeros"
    assert 0 < off[:, 0].abs().max() < 1e-18, "computed without dh_SEG_DECAY: tiny, not zero"
    for h in (1, 2):
        assert torch.equal(on[:, h], off[:, h]), f"head {h}'s transitions are not negligible: computed"
        assert off[:, h].abs().max() > 0


def test_seg_decay_keeps_a_non_finite_adjoint() -> None:
    """A final-state gradient with a NaN (strong gates: every reverse transition skipped): the plain reverse pass
    carries it into every earlier adjoint, and so does the segmented pass, its phase 2's product with the zero
    transitions included (the same NaN pattern in every gradient)."""
    p = Shape(1, 96, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=40, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][..., 0] = -3.5
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
    grads = []
    for cfg in ({**BT16, "dh_SEG_CHUNKS": 2, "REVERSE_DV": True}, {**BT16, "dh_SEG_CHUNKS": 0}):
        o, s = ops.run_kernel(
            CHUNK[p.gate], *(leaves[n] for n in ("q", "k", "v", "g", "beta")),
            initial_state=leaves["initial_state"], output_final_state=True, bwd_config=cfg,
        )  # fmt: skip
        assert s is not None
        dht = torch.zeros_like(s)
        dht[0, 0, 2, 3] = float("nan")
        grads.append(torch.autograd.grad((o, s), list(leaves.values()), (torch.zeros_like(o), dht)))
    for name, seg, plain in zip(NAMES, *grads, strict=True):
        assert torch.equal(seg.isnan(), plain.isnan()), name
    assert grads[1][1][0, :16].isnan().any(), "dk of the first segment: NaN in the plain pass"


def test_the_training_forward_skips_transitions_only_where_the_backward_config_says() -> None:
    """The training forward's phase-1 skip is the backward config's ``fh_SEG_DECAY``, not the forward config's
    ``SEG_DECAY`` (on by default for inference, off by default in the training step: measured, backward.py)."""
    from dtune.kernels import chunk

    fwd = {**chunk.default_config(128, 128, "scalar"), "SEG_CHUNKS": 64, "SEG_DECAY": True}
    bwd = chunk_bwd.default_config(128, 128, "scalar")
    assert bwd["fh_SEG_DECAY"] is False and bwd["dh_SEG_DECAY"] is False
    assert chunk_bwd.training_forward_config(fwd, bwd, "scalar")["SEG_DECAY"] is False
    assert chunk_bwd.training_forward_config({**fwd, "SEG_DECAY": False}, {**bwd, "fh_SEG_DECAY": True}, "scalar")[
        "SEG_DECAY"
    ]
    assert "fh_SEG_DECAY" not in chunk_bwd.legal_params("none")  # Gated DeltaNet's only
