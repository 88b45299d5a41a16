"""The correctness gate of a backward config (a ``chunk_*_bwd`` kernel): every gradient against float64 autograd.

The same kinds of inputs as the forward gate (:mod:`dtune.tune.gate`, which hands backward kernels to this module;
both take their inputs from :mod:`dtune.tune.gate_common`): fresh random inputs with strong decays (log
gates down to -5) and a random initial state at the tuned shape, then the packed variable-length edge case (1, 17 and
150 tokens); random gradients of the output and of the final state; every buffer NaN-poisoned, so an element a stage
fails to write surfaces as NaN. The call is the measured one (:func:`dtune.measure.grad.op_step`: the forward op
under autograd with its tuned/default config, then the backward with the config under test). Checked against float64
autograd through :mod:`dtune.kernels.reference` (the vectorised chunked form at the tuned shape, the token-by-token
loop on the edge case), by relative RMS error: the forward's output ``o`` and final state (the backward config
changes the forward under autograd too), and the gradients ``dq, dk, dv, dg, dbeta, dh0``. Each must be finite, of
its input's shape and dtype, and within the space's tolerance (``[tolerance]`` of ``search_spaces/<kernel>.toml``).

:class:`~dtune.tune.gate.GateResult`'s ``error_o`` is the forward's larger error (o, final state), ``error_s`` the
largest gradient error; a failure's reason names the gradient and lists every error.

At the tuned shape the float64 reference keeps its autograd graph (per-chunk states) in device memory and takes its
time: a shape whose graph would exceed :data:`~dtune.measure.grad.REFERENCE_MAX_BYTES` (4 GiB) is checked with fewer
batch rows (B = 2 at T = 4096, H = 16, D = 128): the same T, heads and head dims, which is what a config specialises on.

With ``max_vs_default`` (the space's ``[accuracy]`` ratio, as in the forward gate) every output and gradient error at
the tuned shape must also be at most that many times the backward's template default's on the same inputs (the
default's training step runs on them once per gate call; the float64 reference is shared).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from dtune.kernels import KernelSpec

from dtune.inputs import dtype_name
from dtune.measure.error import rel_rms_error
from dtune.measure.grad import (
    REFERENCE_MAX_BYTES,
    StepResult,
    op_step,
    reference_bytes,
    reference_step,
    with_output_grads,
)
from dtune.shape import Shape
from dtune.tune.gate_common import (
    EDGE_SEQ_LENS,
    GateResult,
    edge_inputs,
    gate_inputs,
    is_default,
    less_accurate,
    poisoned_outputs,
)

GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}


def gate_shape(problem: Shape, device: torch.device | str) -> Shape:
    """``problem`` with B halved until the float64 reference's autograd graph is at most
    :data:`~dtune.measure.grad.REFERENCE_MAX_BYTES` (on a GPU; the interpreter's shapes are tiny): T, the heads and
    the head dims, what a config specialises on, stay."""
    if torch.device(device).type != "cuda":
        return problem
    p = problem
    while p.B > 1 and reference_bytes(p) > REFERENCE_MAX_BYTES:
        p = dataclasses.replace(p, B=p.B // 2, N=max(1, p.B // 2))
    return p


def _errors(got: StepResult, ref: StepResult, x: dict[str, Any]) -> tuple[dict[str, float], str | None]:
    """Relative errors of the outputs and gradients, and the first structural problem (shape, dtype, NaN), if any."""
    errors = {"o": rel_rms_error(got.o, ref.o)}
    if got.final_state is None or ref.final_state is None:
        return errors, "no final state returned although output_final_state=True"
    errors["final_state"] = rel_rms_error(got.final_state, ref.final_state)
    problem: str | None = None
    for name, label in GRADS.items():
        inp, grad, truth = x.get(name), got.grads.get(name), ref.grads.get(name)
        if inp is None:
            continue
        if grad is None or truth is None:
            problem = problem or f"no gradient for {name} ({label})"
            continue
        if tuple(grad.shape) != tuple(inp.shape) or grad.dtype != inp.dtype:
            want = f"{tuple(inp.shape)} {dtype_name(inp.dtype)}"
            problem = problem or f"{label} is {tuple(grad.shape)} {dtype_name(grad.dtype)}, want {want}"
        errors[label] = rel_rms_error(grad, truth)
    for label, err in errors.items():
        if problem is None and not math.isfinite(err):
            problem = f"NaN/Inf in {label} (unwritten elements or overflow)"
    return errors, problem


def _check(
    spec: KernelSpec,
    x: dict[str, Any],
    config: dict[str, Any] | None,
    tolerance: float,
    ref: StepResult,
    where: str,
) -> tuple[dict[str, float], str | None, StepResult]:
    with poisoned_outputs():
        got = op_step(spec.forward_kernel, x, dict(config or {}))()
    errors, problem = _errors(got, ref, x)
    if problem is None:
        over = {n: e for n, e in errors.items() if not e <= tolerance}
        if over:
            listed = ", ".join(f"{n}={e:.2e}" for n, e in errors.items())
            worst = max(over, key=lambda n: over[n])
            problem = (
                f"relative RMS error of {worst} {over[worst]:.2e} exceeds the "
                f"{dtype_name(x['v'].dtype)} tolerance {tolerance:.1e} ({listed})"
            )
    return errors, (f"{where}{problem}" if problem else None), got


def _split(errors: dict[str, float]) -> tuple[float, float]:
    fwd = max(errors.get("o", math.inf), errors.get("final_state", math.inf))
    grads = [e for n, e in errors.items() if n not in ("o", "final_state")]
    return fwd, max(grads, default=math.inf)


def gate_backward(
    spec: KernelSpec,
    problem: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    config: dict[str, Any] | None,
    tolerance: float,
    *,
    seed: int = 0,
    determinism: bool = False,
    max_vs_default: float | None = None,
) -> GateResult:
    """Run the training step with backward config ``config`` on fresh inputs; check every gradient (see the module)."""
    p = gate_shape(problem, device)
    x = with_output_grads({**gate_inputs(spec, p, dtype, device, seed), "output_final_state": True}, seed + 7)
    ref = reference_step(x, loop=False)
    errors, reason, got = _check(spec, x, config, tolerance, ref, where="")
    if reason is None and max_vs_default is not None and not is_default(spec, p, config):
        default_errors, _ = _errors(op_step(spec.forward_kernel, x, {})(), ref, x)
        reason = less_accurate(errors, default_errors, max_vs_default)
    if reason is None:
        edge = with_output_grads({**edge_inputs(spec, p, dtype, device, seed), "output_final_state": True}, seed + 8)
        where = f"edge case (packed sequences of {', '.join(map(str, EDGE_SEQ_LENS))} tokens): "
        edge_errors, reason, _ = _check(spec, edge, config, tolerance, reference_step(edge, loop=True), where=where)
        errors = {n: max(e, edge_errors.get(n, 0.0)) for n, e in errors.items()}
    if reason is None and determinism:
        again = op_step(spec.forward_kernel, x, dict(config or {}))()
        same = torch.equal(got.o, again.o) and all(
            a is None or (b is not None and torch.equal(a, b)) for a, b in zip(got.grads.values(), again.grads.values())
        )
        if not same:
            reason = "two runs on the same inputs differ (not deterministic: a race?)"
    error_o, error_s = _split(errors)
    return GateResult(reason is None, error_o, error_s, reason)
