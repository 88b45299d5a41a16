"""The contestants ``dtune bench`` times beside the tuned config (dtune's default call): the same call with the
opt-in check of the gate's values (``tuned+check_gate``, gated kernels: what the check costs), the template's
default, flash-linear-attention (for chunk_kda both of its modes) and the PyTorch chunked reference. Each turns the
harness's inputs (:func:`dtune.measure.inputs.workload_inputs`) into a zero-argument call. For a backward kernel
(``chunk_kda_bwd``, ``dtune bench --mode fwd+bwd``) every contestant runs its training step on the same inputs and
output gradients: dtune's op with the backward config, ``fla.ops.*.chunk_*`` and the reference with inputs that
require grad (:mod:`dtune.measure.grad`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtune.kernels import get_kernel
from dtune.measure.grad import Forward, op_kwargs, step_call
from dtune.measure.harness import op_call

BASELINES = ("check_gate", "default", "fla", "torch")
FLA_OPS: dict[str, tuple[str, str]] = {
    "chunk_delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "fused_recurrent_delta_rule": ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "fused_recurrent_kda": ("fla.ops.kda", "fused_recurrent_kda"),
}
CHECKED = "tuned+check_gate"  # the tuned row's call with the opt-in gate check
KDA_LOWER_BOUND = -5.0  # fla's fast mode for chunk_kda: safe_gate=True with gates in [lower_bound, 0)
TORCH_CHUNK = 16  # the reference factors exp(γ_i)·exp(−γ_j): 16 steps of log decay ≥ −5 stay inside float32

Inputs = dict[str, Any]
Call = Callable[[], Any]


@dataclass
class Impl:
    """One contestant: a name and a way to turn inputs into a zero-argument call."""

    name: str
    make: Callable[[Inputs], Call]
    config: dict[str, Any] | None = None
    config_source: str = ""
    note: str = ""


def ours(kernel: str, config: dict[str, Any], **options: Any) -> Callable[[Inputs], Call]:
    """dtune's op with ``config`` (``{}``: the template's default) and the op's keywords ``options``."""
    return lambda x: op_call(kernel, x, config, **options)


def fla_function(kernel: str) -> tuple[Callable[..., Any] | None, str]:
    """fla's op for ``kernel``, or ``(None, why not)``."""
    module, name = FLA_OPS[kernel]
    try:
        return getattr(importlib.import_module(module), name), ""
    except Exception as exc:
        return None, f"flash-linear-attention not importable ({type(exc).__name__}: {exc})"


def fla_forward(fn: Callable[..., Any], gated: bool, **extra: Any) -> Forward:
    """fla's op as a forward on inputs ``x`` (by keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g,
    gk, gv, beta, ...)); fla's own keywords (``safe_gate``) pass through, ``lower_bound`` too."""

    def forward(x: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        gates = {"g": x["g"], "beta": x["beta"]} if gated else {"beta": x["beta"]}
        kw = {
            **gates,
            "scale": x["scale"],
            "initial_state": x["initial_state"],
            "output_final_state": x["output_final_state"],
            "cu_seqlens": x.get("cu_seqlens"),
            **extra,
        }
        out: tuple[torch.Tensor, torch.Tensor | None] = fn(x["q"], x["k"], x["v"], **kw)
        return out

    return forward


def _fla(fn: Callable[..., Any], gated: bool, backward: bool = False, **extra: Any) -> Callable[[Inputs], Call]:
    """fla's op on the harness's inputs: its forward, or with ``backward`` its training step (inputs that require
    grad, ``torch.autograd.grad`` of the output and final state: :func:`dtune.measure.grad.step_call`). With
    ``lower_bound`` the gates are clamped to it before the call (outside the timed region; the gate's inputs are drawn
    at or above -5, so the clamp changes nothing and its gradient is the identity)."""
    forward = fla_forward(fn, gated, **extra)

    def make(x: Inputs) -> Call:
        if "lower_bound" in extra and x["g"] is not None:
            x = {**x, "g": x["g"].clamp(min=extra["lower_bound"])}
        if backward:
            return step_call(forward, x)
        return lambda: forward(x)

    return make


def _torch_reference(backward: bool = False) -> Callable[[Inputs], Call]:
    """The PyTorch chunked reference in float32 (chunk 16: at its default 32, strong decays overflow float32); with
    ``backward`` its training step through autograd."""
    from dtune.kernels.reference import chunk_reference

    def make(x: Inputs) -> Call:
        dtype = x["v"].dtype if x["v"].dtype == torch.float32 else torch.float32

        def forward(xs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
            return chunk_reference(**op_kwargs(xs), chunk_size=TORCH_CHUNK, dtype=dtype)

        return step_call(forward, x) if backward else (lambda: forward(x))

    return make


def build_impls(
    kernel: str, baselines: Sequence[str], config: dict[str, Any] | None, source: str, on_gpu: bool
) -> tuple[list[Impl], list[str]]:
    """The contestants for one shape, and notes on baselines that cannot run here."""
    spec = get_kernel(kernel)
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
    notes: list[str] = []
    backward, op = spec.backward, spec.forward_kernel  # a backward kernel: every contestant runs the training step
    impls = [Impl("tuned", ours(kernel, config or {}), config, source)]
    if "check_gate" in baselines and spec.gate != "none":
        checked = ours(kernel, config or {}, check_gate=True)
        impls.append(Impl(CHECKED, checked, config, source, "check_gate=True: one read of g and a host sync per call"))
    if "default" in baselines:
        impls.append(Impl("default", ours(kernel, {}), {}, "template default"))
    if "fla" in baselines:
        fn, why = fla_function(op)
        if fn is None:
            notes.append(why)
        elif not on_gpu:
            notes.append("flash-linear-attention needs a CUDA GPU: skipped")
        else:
            gated = spec.gate != "none"
            impls.append(Impl("fla", _fla(fn, gated, backward), None, "fla default"))
            if op == "chunk_kda":
                fast = _fla(fn, gated, backward, safe_gate=True, lower_bound=KDA_LOWER_BOUND)
                impls.append(Impl("fla_fast", fast, None, "fla safe_gate=True lower_bound=-5"))
    if "torch" in baselines:
        impls.append(
            Impl("torch", _torch_reference(backward), None, f"reference.chunk_reference fp32, chunk {TORCH_CHUNK}")
        )
    return impls, notes
