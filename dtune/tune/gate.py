"""The correctness gate (docs/DESIGN.md §3): a config is only as good as the outputs it computes.

Fresh random inputs with strong decays (log gates down to -5) and a random initial state; the op's outputs
are NaN-poisoned before launch (``dtune.kernels.config.POISON_OUTPUTS``) so elements a kernel fails to write
surface as NaN; output and final state are compared with the float64 chunked reference on the same device
by relative RMS error over every element, at the tuned shape and on a small packed variable-length edge case
(1-token, shorter-than-a-chunk and chunk-spanning sequences). NaN/Inf anywhere fails. With ``determinism``
a second run on the same inputs must be bitwise identical (catches races). Exceptions raised by the kernel
propagate: the caller classifies them (compile, resources, runtime).

With ``reuse`` (the search's trials) the inputs and their float64 reference are kept per (gate mode, shape, dtype,
device, seed) in this process (:func:`case`), so a worker computes the reference of an input set once, not once per
trial; every config is still checked against it. With ``edge=False`` the variable-length edge case is skipped (its
kernels are other specialisations, a second compile): the search gates stage-local moves so and re-gates every
config it may export with the edge case.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
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

__all__ = [
    "EDGE_SEQ_LENS",
    "GATE_MIN",
    "GateCase",
    "GateResult",
    "case",
    "edge_inputs",
    "gate",
    "gate_inputs",
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


@dataclass(frozen=True)
class GateCase:
    """One input set of the gate and its float64 reference outputs."""

    inputs: dict[str, Any]
    ref_o: torch.Tensor
    ref_s: torch.Tensor | None


_CASES: OrderedDict[tuple[Any, ...], GateCase] = OrderedDict()
CACHED_CASES = 4  # input sets kept per process (the search uses two per shape: stage-local and whole trials)


def _build_case(
    spec: KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    edge: bool,
    seq_lens: tuple[int, ...] | None,
) -> GateCase:
    if edge:
        x = edge_inputs(spec, problem, dtype, device, seed)
    else:
        x = gate_inputs(spec, problem, dtype, device, seed, seq_lens)
    ref_o, ref_s = chunk_reference(**x, output_final_state=True)
    return GateCase(x, ref_o, ref_s)


def case(
    spec: KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    edge: bool = False,
    reuse: bool = True,
    seq_lens: tuple[int, ...] | None = None,
) -> GateCase:
    """The gate's inputs at ``problem`` (or its edge case) and their reference; with ``reuse`` from this process's
    cache of the last :data:`CACHED_CASES` sets (the reference is computed once per input set)."""
    if not reuse:
        return _build_case(spec, problem, dtype, device, seed, edge, seq_lens)
    key = (spec.gate, dataclasses.replace(problem, gate=Gate(spec.gate)), dtype, str(device), seed, edge, seq_lens)
    if key in _CASES:
        _CASES.move_to_end(key)
        return _CASES[key]
    found = _build_case(spec, problem, dtype, device, seed, edge, seq_lens)
    _CASES[key] = found
    while len(_CASES) > CACHED_CASES:
        _CASES.popitem(last=False)
    return found


def _errors(
    spec: KernelSpec, c: GateCase, config: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor | None, float, float]:
    """Run ``config`` on the case's inputs with poisoned outputs: (o, state, error of o, error of the state)."""
    from dtune.ops import run_kernel

    with poisoned_outputs():
        o, s = run_kernel(spec.name, **c.inputs, output_final_state=True, config=dict(config or {}))
    err_o = rel_rms_error(o, c.ref_o) if tuple(o.shape) == tuple(c.ref_o.shape) else math.inf
    ok_s = s is not None and c.ref_s is not None and tuple(s.shape) == tuple(c.ref_s.shape)
    err_s = rel_rms_error(s, c.ref_s) if ok_s else math.inf  # type: ignore[arg-type]
    return o, s, err_o, err_s


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
    edge: bool = True,
    reuse: bool = False,
    seq_lens: tuple[int, ...] | None = None,
) -> GateResult:
    """Run ``kernel`` with ``config`` on the gate's inputs and check it against the float64 reference.

    ``edge``: also the packed variable-length edge case (:data:`EDGE_SEQ_LENS`). ``reuse``: take the inputs and
    their reference from this process's cache (:func:`case`) instead of drawing and computing them afresh.
    ``seq_lens``: gate that packed batch of ``problem``'s heads and dims instead of ``problem``'s rows.
    """
    spec = get_kernel(kernel) if isinstance(kernel, str) else kernel
    if spec.backward:  # a backward family's configs are checked on every gradient of the op's training step
        from dtune.tune.gate_bwd import gate_backward

        return gate_backward(spec, problem, dtype, device, config, tolerance, seed=seed, determinism=determinism)
    main = case(spec, problem, dtype, device, seed, edge=False, reuse=reuse, seq_lens=seq_lens)
    o, s, err_o, err_s = _errors(spec, main, config)
    name = dtype_name(dtype)
    reason: str | None = None
    if s is None:
        reason = "no final state returned although output_final_state=True"
    elif tuple(o.shape) != tuple(main.ref_o.shape) or main.ref_s is None or tuple(s.shape) != tuple(main.ref_s.shape):
        want_s = None if main.ref_s is None else tuple(main.ref_s.shape)
        reason = f"wrong output shape: o {tuple(o.shape)} (want {tuple(main.ref_o.shape)}), state {tuple(s.shape)}"
        reason += f" (want {want_s})"
    elif not math.isfinite(err_o) or not math.isfinite(err_s):
        where = "output" if not math.isfinite(err_o) else "final state"
        reason = f"NaN/Inf in the {where} (unwritten elements or overflow)"
    elif err_o > tolerance or err_s > tolerance:
        reason = f"relative RMS error o={err_o:.2e}, state={err_s:.2e} exceeds the {name} tolerance {tolerance:.1e}"
    elif edge:
        _, _, edge_o, edge_s = _errors(spec, case(spec, problem, dtype, device, seed, True, reuse), config)
        err_o, err_s = max(err_o, edge_o), max(err_s, edge_s)
        if not (edge_o <= tolerance and edge_s <= tolerance):  # NaN compares False: fails too
            reason = (
                f"edge case (packed sequences of {', '.join(map(str, EDGE_SEQ_LENS))} tokens): relative RMS error "
                f"o={edge_o:.2e}, state={edge_s:.2e} exceeds the {name} tolerance {tolerance:.1e}"
            )
    if reason is None and determinism and s is not None:
        o2, s2, _, _ = _errors(spec, main, config)
        if not (torch.equal(o, o2) and s2 is not None and torch.equal(s, s2)):
            reason = "two runs on the same inputs differ (not deterministic: a race?)"
    return GateResult(reason is None, err_o, err_s, reason)
