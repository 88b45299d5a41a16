"""Test plugin (loaded through DTUNE_PLUGINS, in the test process and in every worker): a planted kernel.

``fake_recurrent`` is the fused-recurrent template (scalar gate) plus a ``MODE`` parameter that plants one
failure per value: a Triton compile error, a wrong result (5% off), one just past the space's fp32 tolerance
(``inexact``: 1.5x it), one far inside it but much less accurate than the default config (``lossy``: 5e-6, ~50x the
real kernel's fp32 error), NaN left in the output, a crash of the process (``os._exit``), a hang (sleep). ``ok`` is the
real kernel.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from dtune.kernels import KERNELS, KernelSpec, fused_recurrent

NAME = "fake_recurrent"
MODES = ("ok", "compile", "wrong", "inexact", "lossy", "unwritten", "crash", "hang")


def legal_params(gate: str) -> dict[str, tuple[Any, ...]]:
    return {"MODE": MODES, **fused_recurrent.legal_params(gate)}


def default_config(K: int, V: int, gate: str) -> dict[str, Any]:
    return {"MODE": "ok", **fused_recurrent.default_config(K, V, gate)}


@triton.jit
def _not_a_power_of_two(x, N: tl.constexpr):
    offs = tl.arange(0, N)  # N = 3: Triton refuses to build it
    tl.store(x + offs, offs)


def off_by(o: torch.Tensor, fraction: float) -> torch.Tensor:
    """``o`` moved by ``fraction`` of its norm (relative RMS) in a fixed random direction."""
    noise = torch.randn(o.shape, generator=torch.Generator().manual_seed(o.numel()), dtype=torch.float64)
    return (o.double() + fraction * o.double().norm() / noise.norm() * noise.to(o.device)).to(o.dtype)


def forward(q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, config):  # type: ignore[no-untyped-def]
    mode = config["MODE"]
    real = {name: value for name, value in config.items() if name != "MODE"}
    if mode == "crash":
        os._exit(3)
    if mode == "hang":
        time.sleep(3600)
    if mode == "compile":
        _not_a_power_of_two[(1,)](torch.zeros(8, device=q.device), N=3)
    o, s = fused_recurrent.forward(q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, real)
    if mode == "wrong":
        o = o * 1.05
    if mode == "inexact":
        o = off_by(o, 1.5e-4)
    if mode == "lossy":
        o = off_by(o, 5e-6)
    if mode == "unwritten":
        o[..., -1] = float("nan")
    return o, s


@dataclass(frozen=True)
class FakeSpec(KernelSpec):
    @property
    def module(self) -> ModuleType:
        return sys.modules[__name__]


KERNELS[NAME] = FakeSpec(NAME, "fake", "scalar")

PLANTED_SEEDS = [
    {"MODE": "compile", "BV": 8},
    {"MODE": "wrong", "BV": 8},
    {"MODE": "inexact", "BV": 8},
    {"MODE": "lossy", "BV": 8},
    {"MODE": "unwritten", "BV": 8},
    {"MODE": "crash", "BV": 8},
    {"MODE": "hang", "BV": 8},
    {"MODE": "ok", "BV": 32},  # breaks the constraint: pruned before any compile
]


def space_toml(seeds: list[dict[str, Any]] = PLANTED_SEEDS) -> str:
    """A search space for the fake kernel; the seeds run in order right after the default config."""
    rows = ", ".join("{ " + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in s.items()) + " }" for s in seeds)
    return f"""
kernel = "{NAME}"
description = "planted failures"

[params]
MODE = {list(MODES)!r}
BV = [8, 16, 32]

[constraints]
small_tiles = "BV <= 16"

[seeds]
configs = [{rows}]

[tolerance]
fp32 = 1e-4
fp16 = 5e-3
bf16 = 2e-2

[accuracy]
fp32 = 1.15

[shapes]
seq_lens = [2]
head_dims = [16]
heads = [1]
batch = [1]
""".replace("'", '"')
