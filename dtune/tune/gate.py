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

The accuracy criterion (``max_vs_default``, from the space's ``[accuracy]`` table for the search's dtype; 16-bit
inputs): at the tuned shape the config's errors of o and of the final state must each be at most ``max_vs_default``
times the template default config's on the same inputs (the default is run once per input set; with ``reuse`` once
per process). The tolerance bounds what any config may cost in accuracy; this bounds what a config may trade for
speed: the default keeps its diagonal blocks in float32 (KDA's ``DIAG_BF16 = false``), expected at fla's error level
on the same inputs (``benchmarks/accuracy.py`` measures the default, both DIAG_BF16 settings and fla), so a faster
config that rounds more (bf16 diagonal blocks, fewer float32 intermediates) fails with its ratio in the reason, even
well inside the tolerance. Relative to the default, it needs no fla at search time. The edge case is not compared (168
tokens: too few elements for a stable ratio); fp32 searches list no ratio (``F32_DOT = "tf32"`` is a deliberate
trade there, bounded by the fp32 tolerance).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from dtune.kernels import KernelSpec, get_kernel
from dtune.kernels.reference import chunk_reference

from dtune.inputs import dtype_name
from dtune.measure.error import rel_rms_error
from dtune.shape import Gate, Shape
from dtune.tune.gate_bwd import gate_backward
from dtune.tune.gate_common import (
    EDGE_SEQ_LENS,
    GATE_MIN,
    GateResult,
    edge_inputs,
    gate_inputs,
    is_default,
    less_accurate,
    poisoned_outputs,
)

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


@dataclass(frozen=True)
class GateCase:
    """One input set of the gate and its float64 reference outputs."""

    inputs: dict[str, Any]
    ref_o: torch.Tensor
    ref_s: torch.Tensor | None
    # the template default's errors on these inputs (o, final state), by kernel: computed once per input set
    default_errors: dict[str, dict[str, float]] = field(default_factory=dict, compare=False, repr=False)


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


def _default_errors(spec: KernelSpec, problem: Shape, c: GateCase) -> dict[str, float]:
    """The template default config's errors (o, final state) on the case's inputs, computed once per case."""
    if spec.name not in c.default_errors:
        _, _, err_o, err_s = _errors(spec, c, spec.default_config(problem.K, problem.V))
        c.default_errors[spec.name] = {"o": err_o, "final state": err_s}
    return c.default_errors[spec.name]


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
    max_vs_default: float | None = None,
) -> GateResult:
    """Run ``kernel`` with ``config`` on the gate's inputs and check it against the float64 reference.

    ``edge``: also the packed variable-length edge case (:data:`EDGE_SEQ_LENS`). ``reuse``: take the inputs and
    their reference from this process's cache (:func:`case`) instead of drawing and computing them afresh.
    ``seq_lens``: gate that packed batch of ``problem``'s heads and dims instead of ``problem``'s rows.
    ``max_vs_default``: the accuracy criterion (see the module): fail a config whose error of o or of the final state
    is more than this many times the template default's on the same inputs.
    """
    spec = get_kernel(kernel) if isinstance(kernel, str) else kernel
    if spec.backward:  # a backward family's configs are checked on every gradient of the op's training step
        return gate_backward(
            spec, problem, dtype, device, config, tolerance, seed=seed, determinism=determinism,
            max_vs_default=max_vs_default,
        )  # fmt: skip
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
    elif max_vs_default is not None and not is_default(spec, problem, config):
        reason = less_accurate({"o": err_o, "final state": err_s}, _default_errors(spec, problem, main), max_vs_default)
    if reason is None and edge:
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
