"""What the forward gate (:mod:`dtune.tune.gate`) and the backward gate (:mod:`dtune.tune.gate_bwd`) share: their
inputs (the tuned shape's, with strong decays and a random initial state, and the packed variable-length edge case),
NaN-poisoned outputs, the result type, and the accuracy criterion against the template's default config."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dtune.kernels.config as kernel_config
import torch
from dtune.kernels import KernelSpec

from dtune.measure.inputs import GATE_MIN, make_inputs
from dtune.shape import Gate, Shape

__all__ = [
    "EDGE_SEQ_LENS",
    "GATE_MIN",
    "GateResult",
    "edge_inputs",
    "gate_inputs",
    "less_accurate",
    "poisoned_outputs",
]

# The edge case every config must also pass, whatever shape it is tuned for: a packed variable-length batch
# with a 1-token sequence, one shorter than any chunk and one that spans chunks without filling the last
# (a config tuned at T = 4096 is dispatched to odd lengths too).
EDGE_SEQ_LENS = (1, 17, 150)


@dataclass(frozen=True)
class GateResult:
    passed: bool
    error_o: float  # relative RMS error of the output (inf with NaN/Inf)
    error_s: float  # relative RMS error of the final state
    reason: str | None  # why it failed; None when passed

    @property
    def error(self) -> float:
        return max(self.error_o, self.error_s)


@contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Launchers NaN-fill their output buffers while inside this block."""
    before = kernel_config.POISON_OUTPUTS
    kernel_config.POISON_OUTPUTS = True
    try:
        yield
    finally:
        kernel_config.POISON_OUTPUTS = before


def gate_inputs(
    spec: KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    seq_lens: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The gate's inputs: strong decays, a random initial state, ``dtype`` activations; with ``seq_lens`` the packed
    variable-length batch a search tunes (``--packed-seqs``)."""
    problem = dataclasses.replace(problem, gate=Gate(spec.gate))
    return make_inputs(
        problem, dtype=dtype, device=device, seed=seed, gate_min=GATE_MIN, initial_state=True, seq_lens=seq_lens
    )


def edge_inputs(
    spec: KernelSpec, problem: Shape, dtype: torch.dtype, device: torch.device | str, seed: int
) -> dict[str, Any]:
    """Inputs of the edge case (EDGE_SEQ_LENS packed, the problem's head dims and head grouping)."""
    H = min(problem.H, 2)
    edge = Shape(1, sum(EDGE_SEQ_LENS), H, H * (problem.HV // problem.H), problem.K, problem.V, len(EDGE_SEQ_LENS))
    return make_inputs(
        dataclasses.replace(edge, gate=Gate(spec.gate), varlen=True),
        dtype=dtype,
        device=device,
        seed=seed + 1,
        gate_min=GATE_MIN,
        seq_lens=list(EDGE_SEQ_LENS),
    )


def is_default(spec: KernelSpec, problem: Shape, config: Mapping[str, Any] | None) -> bool:
    """Whether ``config`` is the template's default at ``problem``'s head dims (nothing to compare it with)."""
    return spec.check_config(problem.K, problem.V, dict(config or {})) == spec.default_config(problem.K, problem.V)


def less_accurate(errors: Mapping[str, float], default: Mapping[str, float], max_ratio: float) -> str | None:
    """Why a config fails the accuracy criterion, or None: the first of ``errors`` (relative RMS errors by output
    name) above ``max_ratio`` times the default config's error of that output on the same inputs (``default``).

    A default that is not finite (it failed too) bounds nothing."""
    for name, err in errors.items():
        base = default.get(name)
        if base is None or not math.isfinite(base):
            continue
        if not err <= max_ratio * base:  # NaN compares False: fails
            ratio = f"{err / base:.2f}x" if base > 0 else "above"
            listed = ", ".join(f"{n}={e:.2e}" for n, e in errors.items())
            ref = ", ".join(f"{n}={default[n]:.2e}" for n in errors if n in default)
            return (
                f"relative RMS error of {name} {err:.2e} is {ratio} the default config's {base:.2e} on the "
                f"same inputs, more than the space allows ({max_ratio:g}x; this config: {listed}; default: {ref})"
            )
    return None
