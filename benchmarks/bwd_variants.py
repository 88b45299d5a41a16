"""The chunk backward's variants side by side on one GPU: training step times, gradient errors, peak memory, launches.

Each variant's training step against the shipped config and fla, its gradients' errors, its peak memory and where its
time goes launch by launch. Budget-aware; tables printed last.

Usage (one CUDA GPU, from the checkout's root):
    python benchmarks/bwd_variants.py [--gates none,scalar,channel] [--shapes b8,b1] [--budget-s 450] [-j 14]
    python benchmarks/bwd_variants.py --interpret      (CPU, Triton's interpreter, tiny shapes: a dry run of every step)

Shapes: bf16, H = 16, K = V = 128, initial and final state, gates log-uniform down to -5 (``--decays model``: fla's
layers' gates at initialisation, far weaker, ``dtune.measure.inputs.make_inputs``): ``b8`` = B 8, T 4096 and
``b1`` = B 1, T 32768 (few long sequences); ``g2`` = ``b8`` with grouped value heads, HV = 32 (Qwen3-Next's training
step at TP 1; Gated DeltaNet's shipped lookup and fla). The step is what a backward kernel's trial times
(:func:`dtune.measure.grad.op_step`): the op's forward under autograd (the forward's tuned config for the shape),
then ``torch.autograd.grad`` of the output and the final state; the variants are backward configs
(:data:`VARIANTS`): the shipped lookup, then changes on and around it (the reverse pass's and the dq/dk stage's
tiles by TMA, their pipeline depth, what stage 1 stores under autograd, W rebuilt in the reverse pass); a variant
equal to the shipped config cross-checks the lookup. Variants timed before and found slower leave the list (git
history keeps them, and the CSVs of reports/h200/training/ their times). fla runs its own ``chunk_*`` ops; fla's Gated
DeltaNet backward refuses Triton < 3.7.1 on Hopper (its issue 640): for timing, this script sets
``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` and says so in the row (its gradients may then be wrong: their
errors are in the row too).

Steps, each writing under $OUT (default ./out) before the next starts:

0. compile (child processes, ``-j`` at a time, while the parent draws inputs and float64 references): each variant's
   step is built without launching (Triton's on-disk cache then serves the timing); one child runs fla's steps once
   (its compiles and autotuning land in the same cache).
1. errors -> bwd_variants_errors.csv: every gradient and the output of each variant's step against float64 autograd
   through the chunked reference, at a shape small enough for the reference (b8: B = 2, T = 4096; b1: B = 1,
   T = 8192, where the segmented variants still have two segments per sequence), and fla's on the same inputs.
2. timing -> bwd_variants.csv: medians (CUDA events, L2 flushed) of ``--rounds`` interleaved rounds per shape, the
   spread (min-max of the rounds' medians), peak memory above the inputs, ratios to fla and to the shipped config.
3. launches -> bwd_variants_launches.csv: CUDA time per Triton kernel (torch.profiler, mean of 5 steps) of every
   variant, against its floor (dtune.measure.work.backward_stages: bytes at the measured copy bandwidth, FLOPs at
   the bf16 matmul rate).

Printed last: the per-launch tables, then one short table per shape (variant, ms, × fla, × shipped, peak MiB, worst
gradient error and the ratio to fla's worst).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from dtune.kernels import get_kernel  # noqa: E402

from dtune.measure.baselines import fla_forward, fla_function  # noqa: E402
from dtune.measure.bench import peak_mb  # noqa: E402
from dtune.measure.error import rel_rms_error  # noqa: E402
from dtune.measure.grad import StepResult, op_step, reference_step, step_call, with_output_grads  # noqa: E402
from dtune.measure.inputs import DECAYS, make_inputs  # noqa: E402
from dtune.shape import Gate, Shape  # noqa: E402

OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
FLA_LIFT = "fla's Triton < 3.7.1 refusal lifted (timing only; issue 640)"

# The chunk of 64 (wgmma in every chunk-parallel dot, half the chunk states and chain steps of 32), the forward's
# state pass at 2 pipeline stages (3, tuned at BT 32, spill at 64), the reverse pass by value tiles of 32 ("kv").
BT64 = {"BT": 64, "BC": 16, "fh_num_stages": 2, "dh_BV": 32, "dh_num_warps": 4, "dh_num_stages": 2}
# ... and the reverse pass transposed, on the whole value width per program (one wave of N·HV programs at B = 8).
VK = {**BT64, "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "dh_num_stages": 1}
BK128 = {"dqk_BK": 128, "dqk_BV": 32}  # the dq/dk stage by one key tile
# KDA at the chunk of 32 (its shipped chunk), SAVE none, the reverse pass transposed on the whole value width
VK32 = {"BT": 32, "BC": 16, "SAVE": "none", "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "dh_num_stages": 1}
ONEPASS = {"fh_INTRA": "onepass"}
# The shipped backward configs (dtune/configs/h200.json), as full configs over the template's default
_REV64 = {"REVERSE_DV": True, "dqk_BV": 64}
_T_ONLY = {"fh_U": "recomputed", "fh_W": "recomputed", "fh_AQK": "recomputed"}  # stage 1 under autograd stores T alone
_NO_W = {"fh_U": "recomputed", "fh_W": "recomputed"}  # ... T and A_qk
_DH_TMA2 = {"dh_TMA": True, "dh_num_stages": 2}  # the reverse pass's tiles by TMA, double buffered
SHIP_DN_B8 = {**VK, **BK128, "SAVE": "all", "BC": 32, "fh_TMA": True, **_REV64, **_T_ONLY, **_DH_TMA2}
SHIP_GDN_B8 = {**VK, **BK128, "SAVE": "all", "fh_TMA": True, "fh_BV": 32, **_REV64, **_NO_W}
SHIP_B1 = {**VK, **BK128, "SAVE": "all", "dh_SEG_CHUNKS": 64, "fh_TMA": True, **_REV64, **_DH_TMA2}
_KDA = {**VK32, "dqk_BC": 32, "SAVE": "intra", **ONEPASS, "fh_TMA": True, "dqk_BK": 64, "dqk_num_warps": 4}
SHIP_KDA_B8 = {**_KDA, "REVERSE_DV": True, "dqk_BV": 128, **_DH_TMA2}
SHIP_KDA_B1 = {**_KDA, "REVERSE_DV": True, "dqk_BV": 128, "dh_SEG_CHUNKS": 128}


class OnShipped(dict[str, Any]):
    """A variant given as parameters changed on the shipped lookup of its shape (the GPU's own entry, else its kin's;
    the template's default where there is none); ``fwd``: parameters changed on the forward config the step runs
    under autograd (the op's tuned lookup) as well."""

    def __init__(self, changes: dict[str, Any], fwd: dict[str, Any] | None = None) -> None:
        super().__init__(changes)
        self.fwd = dict(fwd or {})


class KinEntry(dict[str, Any]):
    """The variant the kin GPU's shipped file gives at the shape (:func:`dtune.store.kin_gpu`: the H100's on an H200,
    the H200's on an H100; its lookup, borrowed where it has no entry of that bucket): whether one GPU's tuning beats
    the other's own on this GPU. Skipped where there is no kin file or it gives nothing."""


# (name, backward config or None for the shipped lookup, the shapes it runs on, the gates it applies to)
Variant = tuple[str, dict[str, Any] | None, tuple[str, ...], tuple[Gate, ...]]
ALL = (Gate.NONE, Gate.SCALAR, Gate.CHANNEL)
DN_GDN = (Gate.NONE, Gate.SCALAR)
# Timed at commit bf1f65d and slower than what ships (reports/h200/training/bwd_variants.csv, the rows of each name):
# the dq/dk stage by value tiles of 128 (DeltaNet, Gated DeltaNet), the reverse pass by value tiles of 64, Gated
# DeltaNet's dq/dk stage at 4 warps, KDA's dq/dk pipeline 3 deep, no U alone, no A_qk alone, stage 1 storing T alone
# at B1 and for Gated DeltaNet, W rebuilt in the reverse pass, the reverse pass by TMA single buffered, and the dq/dk
# stage by TMA on top of it. Shipped from that run: the reverse pass by TMA double buffered (DeltaNet B8 and B1, Gated
# DeltaNet B1, KDA B8) and KDA's B1 dq/dk stage by value tiles of 128. Timed on an H100 at commit 7825555 and slower
# (reports/h100/training/bwd_variants*.csv): the B8 reverse pass by value tiles of 64 at 8 warps, which compiles
# without spills for Gated DeltaNet but runs two waves of programs (its launch 0.922 ms, 0.796 by TMA double
# buffered, against the shipped 0.723; DeltaNet's step 2.422 ms against 2.069).
# The variants this list held before (the reverse pass double buffered, the dq/dk stage by TMA, no W at B1, W rebuilt,
# dh_ACC in both forms; then REVERSE_DQK whole, by pointers, by TMA, at BT 32 and by value tiles, the dq/dk stage at 4
# warps and with its key loop: all slower on the H100 at commit 5550107, reports/h100/training/bwd_variants*.csv; then
# the dq/dk stage under a register cap (dqk_maxnreg 128, two programs per SM) by key tiles of 64 and 64 x 32, and by
# key tiles of 32 at 4 warps: all slower on the H100 at commit 7b29413, reports/h100/training/dqk_caps/; then the
# dq/dk stage at 16 warps by key tiles of 64 and 32 and by DeltaNet's key loop: Gated DeltaNet's step 3.144 and 4.399
# ms against the shipped 2.433, DeltaNet's 2.455, 3.377, 2.406 against 1.962, on the H100 at commit 4a398b4,
# reports/h100/training/dqk16w/; one bf16 GPU case at 16 warps hit an illegal memory access); then, on the H100 at
# commit 2d7cbf2 (reports/h100/training/states_tma_squaring/): the adjoint by one TMA store (dh_STORE_TMA; DeltaNet's
# entries ship it; Gated DeltaNet 2.312 / 3.321 ms against 2.319 / 3.329 at B8 / B1), with DeltaNet's B8 loads by TMA
# too (1.886 against 1.856), the training forward's states by TMA store (fh_STORE_TMA: shipped for Gated DeltaNet and
# DeltaNet's B1; DeltaNet's B8 2.049 against 1.856, KDA 4.399 / 5.545 against 4.383 / 5.495) and stage 1 by repeated
# squaring (fi_SOLVE: DeltaNet 1.906 / 3.251 against 1.856 / 2.937, Gated DeltaNet 2.630 / 3.714 against 2.319 /
# 3.329, KDA 4.394 / 5.542), with their measured times in the comments, are in this file's history; then, on the H100
# at commit fd89bc4 (reports/h100/training/dqk_decay_stage1/): Gated DeltaNet's dA decayed by the dq/dk stage's value
# side (dqk_DECAY = "value": 2.267 / 3.239 ms against 2.293 / 3.304 at B8 / B1, its dq/dk launch 0.865 against 0.893
# at B8; shipped for both), A_qk formed in the training forward's state pass at value tiles of 64 (2.895 against
# 2.293), and at B1 W and U recomputed in the state passes (DeltaNet 2.887 against 2.916, peak 1415 MiB against 1543;
# Gated DeltaNet 3.421 against 3.304) and stage 1 under autograd at 4 warps (3.144 / 3.621, slower).
VARIANTS: list[Variant] = [
    ("shipped", None, ("b8", "b1"), ALL),
    # Qwen3-Next's training step (B8 T4096, H 16, HV 32): how the step and its launches scale with grouped value heads
    ("shipped", None, ("g2",), (Gate.SCALAR,)),
    # (its dq/dk partials in bf16, dqk_GROUP = "input": shipped, 5.226 ms against 5.601 on the H100 at 378e658)
    # the kin GPU's tuning of the same bucket (the H100's backward grid on an H200), where its file gives one
    ("kin GPU's entry", KinEntry(), ("b8", "b1"), ALL),
    # Stage 1 under autograd at 2 warps instead of the forward config's 1 (fi_num_warps 0 inherits it; the forward
    # runs it at chunks of 32, the backward's entries at 64, where 1 warp spills 436-868 bytes on sm_90a with Triton
    # 3.6 and 2 warps 4-20): DeltaNet's B1 entry ships it (2.828 ms against 2.916, commit fd89bc4), Gated DeltaNet's B1
    # too (3.201 against 3.242, commit 378e658); B8 untimed
    ("stage 1 at 2 warps", OnShipped({"fi_num_warps": 2}), ("b8",), DN_GDN),
    # the training forward's segments started by burn-in (SEG_START, not in the search spaces): phase 3 alone
    ("forward segments by burn-in", OnShipped({}, fwd={"SEG_START": "burnin"}), ("b1",), (Gate.SCALAR,)),
    # ... and the reverse pass's too (dh_SEG_START): neither pass runs its phases 1 and 2
    (
        "both passes' segments by burn-in",
        OnShipped({"dh_SEG_START": "burnin"}, fwd={"SEG_START": "burnin"}),
        ("b1",),
        (Gate.SCALAR,),
    ),
    # both passes' decay-driven skip off (SEG_DECAY, dh_SEG_DECAY: on by default, measured on strong decays; --decays
    # model times them on a model's gates)
    ("no decay skip", OnShipped({"dh_SEG_DECAY": False}, fwd={"SEG_DECAY": False}), ("b1",), (Gate.SCALAR,)),
    ("no reverse decay skip", OnShipped({"dh_SEG_DECAY": False}), ("b1",), (Gate.SCALAR,)),
    # the training forward's state pass in Gluon, warp-specialised, its states stored by TMA (fh_LOOP; V_new recomputed
    # from T there, value tiles of 64), at two programs per SM and at one
    (
        "fwd state in Gluon",
        OnShipped({"fh_LOOP": "gluon", "fh_maxnreg": 128, "fh_BV": 64, "fh_num_warps": 0, "fh_U": "recomputed"}),
        ("b8",),
        DN_GDN,
    ),
    (
        "fwd state in Gluon, no cap",
        OnShipped({"fh_LOOP": "gluon", "fh_maxnreg": 0, "fh_BV": 64, "fh_num_warps": 0, "fh_U": "recomputed"}),
        ("b8",),
        DN_GDN,
    ),
    # the reverse state pass in Gluon, warp-specialised (dh_LOOP: a TMA loader warp, the products wgmma from registers,
    # the adjoint stored by TMA; T read zero above its diagonal, fh_U): on the whole value width (one program per
    # sequence and head; at B1 the sequence-parallel pass's third phase), by value tiles of 64 (two waves at B8), and
    # those under a register cap with one buffer (two programs per SM); then both state passes in Gluon
    ("reverse in Gluon", OnShipped({"dh_LOOP": "gluon", "dh_BV": 128, "fh_U": "recomputed"}), ("b8", "b1"), DN_GDN),
    (
        "reverse in Gluon, tiles of 64",
        OnShipped({"dh_LOOP": "gluon", "dh_BV": 64, "fh_U": "recomputed"}),
        ("b8",),
        DN_GDN,
    ),
    (
        "reverse in Gluon, 64, cap",
        OnShipped({"dh_LOOP": "gluon", "dh_BV": 64, "dh_maxnreg": 128, "dh_num_stages": 1, "fh_U": "recomputed"}),
        ("b8",),
        DN_GDN,
    ),
    # the dq/dk stage in Gluon, persistent and warp-specialised (dqk_LOOP: one key tile, value tiles of 64, two
    # buffers),
    # alone and with both state passes in Gluon
    (
        "dq/dk in Gluon",
        OnShipped({"dqk_LOOP": "gluon", "dqk_BK": 128, "dqk_BV": 64, "dqk_num_stages": 2}),
        ("b8", "b1"),
        DN_GDN,
    ),
    (
        "all three in Gluon",
        OnShipped(
            {
                "dqk_LOOP": "gluon",
                "dqk_BK": 128,
                "dqk_BV": 64,
                "dqk_num_stages": 2,
                "dh_LOOP": "gluon",
                "dh_BV": 128,
                "fh_LOOP": "gluon",
                "fh_maxnreg": 128,
                "fh_BV": 64,
                "fh_num_warps": 0,
                "fh_U": "recomputed",
            }
        ),
        ("b8",),
        DN_GDN,
    ),
    (
        "both state passes in Gluon",
        OnShipped(
            {
                "dh_LOOP": "gluon",
                "dh_BV": 128,
                "fh_LOOP": "gluon",
                "fh_maxnreg": 128,
                "fh_BV": 64,
                "fh_num_warps": 0,
                "fh_U": "recomputed",
            }
        ),
        ("b8",),
        DN_GDN,
    ),
]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(name: str, rows: list[dict[str, Any]]) -> None:
    """All rows so far (rewritten after each measurement: a run cut short keeps what it measured)."""
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with (out_dir() / name).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def shape(gate: Gate, name: str, interpret: bool, errors: bool = False) -> Shape:
    """``b8`` / ``b1`` / ``g2`` (timed), or the smaller shape of their error check (``errors``)."""
    if interpret:  # b1: one sequence of 9 chunks of 16 (segments of 2 chunks below)
        return Shape(1, 144, 2, 4, 16, 32, 1, gate) if name == "b1" else Shape(2, 40, 2, 4, 16, 16, 2, gate)
    if name in ("b8", "g2"):  # g2: Qwen3-Next's grouped value heads, HV = 2H
        HV = 32 if name == "g2" else 16
        return Shape(2 if errors else 8, 4096, 16, HV, 128, 128, 2 if errors else 8, gate)
    return Shape(1, 8192 if errors else 32768, 16, 16, 128, 128, 1, gate)


def forward_config(
    cfg: dict[str, Any] | None, op: str, p: Shape, dtype: torch.dtype, dev: str | torch.device
) -> dict[str, Any] | None:
    """The forward config the variant's step runs under autograd: None (the op's tuned lookup) unless the variant
    changes it (:class:`OnShipped`'s ``fwd``)."""
    if not isinstance(cfg, OnShipped) or not cfg.fwd:
        return None
    from dtune.store import tuned_config

    return {**(tuned_config(op, p, dtype, torch.device(dev)) or {}), **cfg.fwd}


def variant_config(
    cfg: dict[str, Any] | None, interpret: bool, op: str, p: Shape, dtype: torch.dtype, dev: str | torch.device
) -> dict[str, Any] | None:
    """The variant's backward config for ``op`` at ``p``; under the interpreter scaled to its tiny shapes (chunks of
    16, segments of 2)."""
    if isinstance(cfg, OnShipped):
        from dtune.store import tuned_config

        cfg = {**(tuned_config(op + "_bwd", p, dtype, torch.device(dev)) or {}), **cfg}
    elif isinstance(cfg, KinEntry):
        from dtune.store import gpu_key

        cfg = kin_lookup(op + "_bwd", p, dtype, gpu_key(torch.device(dev))) or {}  # {}: the default (no kin entry)
    if cfg is None or not interpret:
        return cfg
    small = {**cfg, "BT": 16, "BC": 16}
    for name in ("dh_BV", "dqk_BK", "dqk_BC"):
        if name in small:
            small[name] = 16
    if small.get("dh_SEG_CHUNKS"):
        small["dh_SEG_CHUNKS"] = 2
    return small


def kin_lookup(kernel: str, p: Shape, dtype: torch.dtype, gpu: str | None) -> dict[str, Any] | None:
    """The lookup of ``kernel`` at ``p`` in the shipped file of GPU ``gpu``'s kin alone (see :class:`KinEntry`);
    None without a kin file or an entry of that kernel."""
    from importlib import resources

    from dtune.store import dtype_name, kin_gpu, read_configs

    kin = kin_gpu(gpu) if gpu is not None else None
    if kin is None:
        return None
    ref = resources.files("dtune.configs").joinpath(f"{kin}.json")
    return read_configs(str(ref), kin).lookup(kernel, dtype_name(dtype), p)


DECAYS_ENV = "BWD_VARIANTS_DECAYS"  # --decays, for this process and its compile children


def step_inputs(p: Shape, dtype: torch.dtype, device: str) -> dict[str, Any]:
    decays = os.environ.get(DECAYS_ENV, "strong")
    x = make_inputs(p, dtype=dtype, device=device, seed=1, gate_min=-5.0, decays=decays)
    return with_output_grads({**x, "scale": p.K**-0.5, "output_final_state": True}, seed=2)


def variants_of(gate: Gate, shape_name: str) -> list[Variant]:
    """The variants run at this gate and shape (the kin GPU's entry only on a CUDA GPU whose kin has a file)."""
    kin = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ and _has_kin()
    return [v for v in VARIANTS if shape_name in v[2] and gate in v[3] and (kin or not isinstance(v[1], KinEntry))]


def pairs(gates: list[Gate], shapes: list[str]) -> list[tuple[Gate, str]]:
    """The (gate, shape) pairs with a variant to run, shapes first (b8's first: b1's variants share most of their
    kernels, T being no constexpr, not all)."""
    return [(gate, name) for name in shapes for gate in gates if variants_of(gate, name)]


def _has_kin() -> bool:
    from dtune.store import gpu_key, kin_gpu

    gpu = gpu_key(torch.device("cuda"))
    return gpu is not None and kin_gpu(gpu) is not None


def fla_step(gate: Gate, x: dict[str, Any]) -> tuple[Callable[[], StepResult] | None, str]:
    """fla's training step on ``x``, or ``(None, why not)``; the note says when its version check was lifted."""
    fn, why = fla_function(OPS[gate])
    if fn is None:
        return None, why
    note = ""
    if gate is Gate.SCALAR:
        try:
            import fla.ops.common.chunk_o as fla_chunk_o

            if not fla_chunk_o.TRITON_ABOVE_3_7_1:
                fla_chunk_o.TRITON_ABOVE_3_7_1 = True
                note = FLA_LIFT
        except Exception as exc:  # an fla without that flag: run it as it is
            note = f"flag not found ({first_line(exc)})"
    return step_call(fla_forward(fn, gate is not Gate.NONE), x), note


# ---- 0. compile in parallel ------------------------------------------------------------------------------------------


def warm(what: str, interpret: bool) -> None:
    """(Child process.) ``dtune:GATE:SHAPE:INDEX``: build, without launching, variant INDEX's training step; ``fla``:
    run fla's steps once per gate and shape (compiles and autotuning into the on-disk cache)."""
    from dtune.tune.trials import compile_without_launch

    t0 = time.monotonic()
    dev, dtype = ("cpu", torch.float32) if interpret else ("cuda", torch.bfloat16)
    parts = what.split(":")
    if parts[0] == "fla":
        for pair in parts[1].split(","):
            g, name = pair.split("/")
            gate = Gate(g)
            x = step_inputs(shape(gate, name, interpret), dtype, dev)
            step, why = fla_step(gate, x)
            try:
                if step is not None:
                    step()
                    torch.cuda.synchronize()
            except Exception as exc:  # reported again, with its row, by the errors step
                why = first_line(exc)
            print(f"warm fla {OPS[gate]} {name}: {time.monotonic() - t0:.0f} s {why}", flush=True)
            del x
            torch.cuda.empty_cache()
        return
    gate, name, index = Gate(parts[1]), parts[2], int(parts[3])
    label, cfg, _, _ = variants_of(gate, name)[index]
    x = step_inputs(shape(gate, name, interpret), dtype, dev)
    with compile_without_launch():
        p = shape(gate, name, interpret)
        fcfg = forward_config(cfg, OPS[gate], p, dtype, dev)
        op_step(OPS[gate], x, variant_config(cfg, interpret, OPS[gate], p, dtype, dev), fcfg)()
    print(f"warm {OPS[gate]} {name} {label}: {time.monotonic() - t0:.0f} s", flush=True)


def start_warm(gates: list[Gate], shapes: list[str], interpret: bool, jobs: int) -> list[list[str]]:
    """The warm-up commands (fla's first: its autotuning is the longest), to run ``jobs`` at a time."""
    extra = ["--interpret"] if interpret else []
    base = [sys.executable, __file__, *extra, "--warm"]
    todo = pairs(gates, shapes)
    cmds = [[*base, "fla:" + ",".join(f"{g.value}/{n}" for g, n in todo)]] if not interpret and todo else []
    for gate, name in todo:
        cmds += [[*base, f"dtune:{gate.value}:{name}:{i}"] for i in range(len(variants_of(gate, name)))]
    return cmds


class Pool:
    """At most ``jobs`` child processes at a time; :meth:`wait` ends by the deadline (what built stays cached)."""

    def __init__(self, cmds: list[list[str]], jobs: int) -> None:
        self.todo, self.jobs = list(cmds), max(1, jobs)
        self.running: list[subprocess.Popen[bytes]] = []
        self.poll()

    def poll(self) -> None:
        self.running = [p for p in self.running if p.poll() is None]
        while self.todo and len(self.running) < self.jobs:
            self.running.append(subprocess.Popen(self.todo.pop(0), cwd=ROOT))

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + max(0.0, seconds)
        while (self.todo or self.running) and time.monotonic() < end:
            self.poll()
            time.sleep(0.5)
        for proc in self.running:
            if proc.poll() is None:
                job = str(list(proc.args)[-1])  # type: ignore[arg-type]
                print(f"warm-up {job} still running: stopped (its compiles so far stay cached)", flush=True)
                proc.kill()
                proc.wait()
        if self.todo:
            print(f"warm-up: {len(self.todo)} variant(s) not built ahead (they compile when timed)", flush=True)
        self.todo, self.running = [], []


# ---- 1. errors -------------------------------------------------------------------------------------------------------


def _errors_of(got: StepResult, ref: StepResult) -> dict[str, Any]:
    row: dict[str, Any] = {"err_o": rel_rms_error(got.o, ref.o)}
    worst = 0.0
    for name, label in GRADS.items():
        a, b = got.grads.get(name), ref.grads.get(name)
        if a is not None and b is not None:
            row[f"err_{label}"] = e = rel_rms_error(a, b)
            worst = max(worst, e)
    row["err_worst"] = worst
    return row


def errors(gates: list[Gate], shapes: list[str], interpret: bool, budget: Budget, pool: Pool) -> list[dict[str, Any]]:
    """The float64 references first (while the pool compiles), then every variant's step and fla's against them."""
    dev = "cpu" if interpret else "cuda"
    dtype = torch.float32 if interpret else torch.bfloat16  # bf16 dots are garbage under the interpreter
    refs: list[tuple[Gate, str, Shape, dict[str, Any], StepResult | None]] = []
    for gate, name in pairs(gates, shapes):
        p = shape(gate, name, interpret, errors=True)
        x = step_inputs(p, dtype, dev)
        t0 = time.monotonic()
        try:
            ref: StepResult | None = reference_step(x)
        except Exception as exc:
            print(f"reference {OPS[gate]} {name}: {first_line(exc)}", flush=True)
            ref = None
        refs.append((gate, name, p, x, ref))
        print(f"reference {OPS[gate]} {name} (float64 autograd): {time.monotonic() - t0:.1f} s", flush=True)
    pool.wait(budget.left() - 150.0)  # timing and launches keep 150 s
    rows: list[dict[str, Any]] = []
    for gate, name, p, x, ref in refs:
        op = OPS[gate]
        if ref is None:
            rows.append({"op": op, "shape": name, "impl": "reference", "note": "failed"})
            continue
        timed = shape(gate, name, interpret)  # (the configs of the timed shape)
        impls: list[tuple[str, Callable[[], StepResult] | None, str]] = [
            (
                label,
                op_step(
                    op,
                    x,
                    variant_config(cfg, interpret, op, timed, dtype, dev),
                    forward_config(cfg, op, timed, dtype, dev),
                ),
                "",
            )
            for label, cfg, _, _ in variants_of(gate, name)
        ]
        if not interpret:
            fla, note = fla_step(gate, x)
            impls.append(("fla", fla, note))
        for impl, step, note in impls:
            row: dict[str, Any] = {"op": op, "shape": name, "B": p.B, "T": p.T, "impl": impl, "note": note}
            if step is None:
                rows.append(row)
                continue
            try:
                row |= _errors_of(step(), ref)
            except Exception as exc:
                row["note"] = (note + "; " if note else "") + first_line(exc)
                traceback.print_exc()
            rows.append(row)
            write_csv("bwd_variants_errors.csv", rows)
        del x, ref
    refs.clear()
    if not interpret:
        torch.cuda.empty_cache()
    return rows


# ---- 2. timing -------------------------------------------------------------------------------------------------------


def timing(gates: list[Gate], shapes: list[str], interpret: bool, budget: Budget, rounds: int) -> list[dict[str, Any]]:
    from dtune.measure.timing import time_call

    dev = "cpu" if interpret else "cuda"
    dtype = torch.float32 if interpret else torch.bfloat16
    rows: list[dict[str, Any]] = []
    for gate, name in pairs(gates, shapes):
        if budget.left() < 60:
            print(f"budget: skipping the timing of {OPS[gate]} {name}", flush=True)
            continue
        op = OPS[gate]
        p = shape(gate, name, interpret)
        x = step_inputs(p, dtype, dev)
        impls: list[tuple[str, Callable[[], StepResult], str]] = []
        configs = {"fla": ""}
        for label, cfg, _, _ in variants_of(gate, name):
            bcfg = variant_config(cfg, interpret, op, p, dtype, dev)
            fcfg = forward_config(cfg, op, p, dtype, dev)
            impls.append((label, op_step(op, x, bcfg, fcfg), ""))
            shown = "(shipped lookup)" if cfg is None else json.dumps(cfg, sort_keys=True)
            if isinstance(cfg, OnShipped) and cfg.fwd:
                shown += f", forward + {json.dumps(cfg.fwd, sort_keys=True)}"
            if isinstance(cfg, KinEntry):
                shown = f"(the kin GPU's lookup) {json.dumps(bcfg, sort_keys=True)}"
            configs[label] = f"(shipped lookup) + {shown}" if isinstance(cfg, OnShipped) else shown
        if not interpret:
            fla, note = fla_step(gate, x)
            if fla is not None:
                impls.append(("fla", fla, note))
        times: dict[str, list[float]] = {impl: [] for impl, _, _ in impls}
        notes = {impl: note for impl, _, note in impls}
        peaks: dict[str, float] = {}
        for _ in range(rounds):  # interleaved: every contestant once per round
            for impl, step, _ in impls:
                if notes[impl].startswith("failed"):
                    continue
                try:
                    t = time_call(step, dev, "events", *((1, 1) if interpret else (3, 30)), 10.0)
                    times[impl].append(t.median_ms)
                    if impl not in peaks:
                        peaks[impl] = peak_mb(step, torch.device(dev))
                except Exception as exc:
                    notes[impl] = f"failed: {first_line(exc)}"
                    traceback.print_exc()
        med = {impl: sorted(ts)[len(ts) // 2] for impl, ts in times.items() if ts}
        for impl, _, _ in impls:
            ts = times[impl]
            row: dict[str, Any] = {"op": op, "shape": name, "B": p.B, "T": p.T, "impl": impl}
            if ts:
                m = med[impl]
                row |= {"ms": m, "min_ms": min(ts), "max_ms": max(ts), "rounds": len(ts)}
                row["x_fla"] = med["fla"] / m if "fla" in med else math.nan
                row["x_shipped"] = med["shipped"] / m if "shipped" in med else math.nan
                row["peak_mib"] = peaks.get(impl, math.nan)
            row["note"] = notes[impl]
            row["config"] = configs.get(impl, "")
            rows.append(row)
        write_csv("bwd_variants.csv", rows)
        print(f"timed {op} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
        del x, impls
        if not interpret:
            torch.cuda.empty_cache()
    return rows


# ---- 3. launches -----------------------------------------------------------------------------------------------------


def launches(gates: list[Gate], shapes: list[str], interpret: bool, budget: Budget) -> list[dict[str, Any]]:
    """CUDA time per kernel of every variant's step (torch.profiler), against the floors of its stages."""
    from torch.profiler import ProfilerActivity, profile

    from dtune.measure.timing import ceilings
    from dtune.measure.work import Roofs, backward_stages
    from dtune.store import tuned_config

    dev = torch.device("cpu" if interpret else "cuda")
    dtype = torch.float32 if interpret else torch.bfloat16
    roofs = Roofs(4250.0, 660.0, "assumed") if interpret else Roofs.from_ceilings(ceilings(dev))
    activity = ProfilerActivity.CPU if interpret else ProfilerActivity.CUDA
    rows: list[dict[str, Any]] = []
    for gate, name in pairs(gates, shapes):
        op = OPS[gate]
        p = shape(gate, name, interpret)
        x = step_inputs(p, dtype, str(dev))
        for label, cfg, _, _ in variants_of(gate, name):
            if budget.left() < 10:
                print(f"budget: skipping the launches of {op} {name} {label}", flush=True)
                continue
            fcfg = forward_config(cfg, op, p, dtype, dev)
            fwd = get_kernel(op).check_config(p.K, p.V, fcfg or tuned_config(op, p, dtype, dev))
            bcfg = variant_config(cfg, interpret, op, p, dtype, dev)
            if bcfg is None:
                bcfg = tuned_config(op + "_bwd", p, dtype, dev)
            try:
                bwd = get_kernel(op + "_bwd").check_config(p.K, p.V, bcfg)
            except (TypeError, ValueError) as exc:
                rows.append({"op": op, "shape": name, "impl": label, "kernel": "(config)", "note": first_line(exc)})
                continue
            floors: dict[str, list[Any]] = {}
            for st in backward_stages(p, dtype, fwd, bwd):
                floors.setdefault(st.kernel, []).append(st)
            step = op_step(op, x, bwd, fcfg)
            calls = 1 if interpret else 5
            try:
                step()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                with profile(activities=[activity]) as prof:
                    for _ in range(calls):
                        step()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
            except Exception as exc:
                rows.append({"op": op, "shape": name, "impl": label, "kernel": "(step)", "note": first_line(exc)})
                continue
            total = floor_total = 0.0
            for ev in sorted(prof.key_averages(), key=lambda e: -_dev_time(e, interpret)):
                us = _dev_time(ev, interpret)
                if us <= 0 or (interpret and "_kernel" not in ev.key):
                    continue
                ms = us / 1e3 / calls
                total += ms
                mine = floors.get(ev.key, [])
                floor = sum(roofs.floor_ms(s.work) for s in mine) if mine else math.nan
                floor_total += 0.0 if math.isnan(floor) else floor
                rows.append({
                    "op": op, "shape": name, "impl": label, "kernel": ev.key[:48], "launches": ev.count // calls,
                    "ms": ms, "floor_ms": floor, "x_floor": ms / floor if floor > 0 else math.nan,
                    "stages": "; ".join(s.name for s in mine),
                })  # fmt: skip
            rows.append({
                "op": op, "shape": name, "impl": label, "kernel": "(all kernels)", "ms": total,
                "floor_ms": floor_total, "x_floor": total / floor_total if floor_total else math.nan,
            })  # fmt: skip
            write_csv("bwd_variants_launches.csv", rows)
        del x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _dev_time(ev: Any, interpret: bool) -> float:
    """An event's total time in µs: CUDA time on the GPU, CPU time under the interpreter (the dry run's)."""
    if interpret:
        return float(ev.cpu_time_total)
    return float(getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)))


# ---- tables ----------------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else (f"{v:.2e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}")
    return "" if v is None else str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gates", default="none,scalar,channel", help="none (DeltaNet), scalar (Gated DeltaNet), channel")
    ap.add_argument("--shapes", default="b8,b1", help="b8 (B 8, T 4096), b1 (B 1, T 32768), g2 (b8 at HV = 2H)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape")
    ap.add_argument("-j", "--jobs", type=int, default=14, help="compile processes at a time")
    ap.add_argument("--skip", default="", help="steps to leave out: errors, timing, launches")
    ap.add_argument(
        "--decays", default="strong", choices=DECAYS,
        help="the log gates timed: strong (the tuned configs' inputs) or model (fla's layers at initialisation)",
    )  # fmt: skip
    ap.add_argument("--interpret", action="store_true", help="CPU dry run under Triton's interpreter, tiny shapes")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # (internal) one warm-up child's job
    a = ap.parse_args()
    os.environ[DECAYS_ENV] = a.decays
    if a.warm:
        warm(a.warm, a.interpret)
        return
    budget = Budget(a.budget_s)
    gates = [Gate(g) for g in a.gates.split(",") if g]
    shapes = [s for s in a.shapes.split(",") if s]
    skip = set(a.skip.split(","))
    if a.interpret:
        from dtune.kernels import config as kernel_config

        kernel_config.POISON_OUTPUTS = True  # an unwritten element shows as NaN in the dry run
    pool = Pool(start_warm(gates, shapes, a.interpret, a.jobs), a.jobs)
    err_rows = errors(gates, shapes, a.interpret, budget, pool) if "errors" not in skip else []
    pool.wait(budget.left() - 150.0)
    rounds = 1 if a.interpret else a.rounds  # the dry run times once: the interpreter's steps take seconds
    time_rows = timing(gates, shapes, a.interpret, budget, rounds) if "timing" not in skip else []
    launch_rows = launches(gates, shapes, a.interpret, budget) if "launches" not in skip else []
    summary = {"time_s": a.budget_s - budget.left(), "errors": err_rows, "timing": time_rows, "launches": launch_rows}
    (out_dir() / "bwd_variants.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    if launch_rows:
        print("\n== per-launch CUDA time (mean of 5 steps) against the floor ==")
        print(table(launch_rows, ["op", "shape", "impl", "kernel", "launches", "ms", "floor_ms", "x_floor"]))
    worst_fla = {(r["op"], r["shape"]): r.get("err_worst") for r in err_rows if r.get("impl") == "fla"}
    err_of = {(r["op"], r["shape"], r["impl"]): r.get("err_worst") for r in err_rows}
    for name in shapes:
        rows = []
        for r in time_rows:
            if r["shape"] != name:
                continue
            e = err_of.get((r["op"], name, r["impl"]))
            f = worst_fla.get((r["op"], name))
            ratio = e / f if isinstance(e, float) and isinstance(f, float) and f > 0 else math.nan
            rows.append({**r, "err_worst": e, "err_x_fla": ratio, "note": str(r.get("note", ""))[:40]})
        if rows:
            heads = "H 16, HV 32" if name == "g2" else "H 16"
            print(f"\n== training step, {name} (bf16, {heads}, D 128, initial + final state) ==")
            cols = ["op", "impl", "ms", "min_ms", "max_ms", "x_fla", "x_shipped", "peak_mib", "err_worst", "err_x_fla"]
            print(table(rows, [*cols, "note"]))
    print(f"\ndone in {a.budget_s - budget.left():.0f} s; results in {out_dir()}", flush=True)


if __name__ == "__main__":
    main()
