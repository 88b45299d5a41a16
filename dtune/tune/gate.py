"""The correctness gate (docs/DESIGN.md §3): a config is only as good as the outputs it computes.

Fresh random inputs with strong decays (log gates down to -5) and a random initial state; the op's outputs
are NaN-poisoned before launch (``dtune.kernels.config.POISON_OUTPUTS``) so elements a kernel fails to write
surface as NaN; output and final state are compared with the float64 chunked reference on the same device
by relative RMS error over every element, at the tuned shape and on a small packed variable-length edge case
(1-token, shorter-than-a-chunk and chunk-spanning sequences). NaN/Inf anywhere fails. With ``determinism``
a second run on the same inputs must be bitwise identical (catches races). Exceptions raised by the kernel
propagate: the caller classifies them (compile, resources, runtime).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dtune.kernels.config as kernel_config
import torch
from dtune.kernels import KernelSpec, get_kernel
from dtune.kernels.reference import chunk_reference

from dtune.inputs import dtype_name
from dtune.measure.error import rel_rms_error
from dtune.measure.inputs import GATE_MIN, make_inputs
from dtune.shape import Gate, Shape

__all__ = ["EDGE_SEQ_LENS", "GATE_MIN", "GateResult", "edge_inputs", "gate", "gate_inputs", "poisoned_outputs"]
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
    spec: KernelSpec, problem: Shape, dtype: torch.dtype, device: torch.device | str, seed: int
) -> dict[str, Any]:
    """The gate's inputs: strong decays, a random initial state, ``dtype`` activations."""
    problem = dataclasses.replace(problem, gate=Gate(spec.gate))
    return make_inputs(problem, dtype=dtype, device=device, seed=seed, gate_min=GATE_MIN, initial_state=True)


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


def _edge_errors(
    spec: KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    config: dict[str, Any] | None,
    seed: int,
) -> tuple[float, float]:
    """Relative errors of ``config`` on the edge case."""
    from dtune.ops import run_kernel

    x = edge_inputs(spec, problem, dtype, device, seed)
    with poisoned_outputs():
        o, s = run_kernel(spec.name, **x, output_final_state=True, config=dict(config or {}))
    ref_o, ref_s = chunk_reference(**x, output_final_state=True)
    return rel_rms_error(o, ref_o), (rel_rms_error(s, ref_s) if s is not None else math.inf)


def gate(
    kernel: str | KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    config: dict[str, Any] | None,
    tolerance: float,
    *,
    seed: int = 0,
    determinism: bool = False,
) -> GateResult:
    """Run ``kernel`` with ``config`` on fresh inputs and check it against the float64 reference."""
    from dtune.ops import run_kernel  # ops imports the store; keep the gate importable on its own

    spec = get_kernel(kernel) if isinstance(kernel, str) else kernel
    x = gate_inputs(spec, problem, dtype, device, seed)

    def launch() -> tuple[torch.Tensor, torch.Tensor | None]:
        with poisoned_outputs():
            return run_kernel(spec.name, **x, output_final_state=True, config=dict(config or {}))

    o, s = launch()
    ref_o, ref_s = chunk_reference(**x, output_final_state=True)
    err_o = rel_rms_error(o, ref_o)
    err_s = rel_rms_error(s, ref_s) if s is not None else math.inf
    name = dtype_name(dtype)
    reason: str | None = None
    if s is None:
        reason = "no final state returned although output_final_state=True"
    elif tuple(o.shape) != tuple(ref_o.shape) or tuple(s.shape) != tuple(ref_s.shape):
        reason = f"wrong output shape: o {tuple(o.shape)} (want {tuple(ref_o.shape)}), state {tuple(s.shape)}"
    elif not math.isfinite(err_o) or not math.isfinite(err_s):
        where = "output" if not math.isfinite(err_o) else "final state"
        reason = f"NaN/Inf in the {where} (unwritten elements or overflow)"
    elif err_o > tolerance or err_s > tolerance:
        reason = f"relative RMS error o={err_o:.2e}, state={err_s:.2e} exceeds the {name} tolerance {tolerance:.1e}"
    else:
        edge_o, edge_s = _edge_errors(spec, problem, dtype, device, config, seed)
        err_o, err_s = max(err_o, edge_o), max(err_s, edge_s)
        if not (edge_o <= tolerance and edge_s <= tolerance):  # NaN compares False: fails too
            reason = (
                f"edge case (packed sequences of {', '.join(map(str, EDGE_SEQ_LENS))} tokens): relative RMS error "
                f"o={edge_o:.2e}, state={edge_s:.2e} exceeds the {name} tolerance {tolerance:.1e}"
            )
    if reason is None and determinism and s is not None:
        o2, s2 = launch()
        if not (torch.equal(o, o2) and s2 is not None and torch.equal(s, s2)):
            reason = "two runs on the same inputs differ (not deterministic: a race?)"
    return GateResult(reason is None, err_o, err_s, reason)
