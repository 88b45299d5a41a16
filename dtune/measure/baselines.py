"""The contestants ``dtune bench`` times beside the tuned config (dtune's default call): the same call with the
opt-in check of the gate's values (``tuned+check_gate``, gated kernels: what the check costs), the template's
default, flash-linear-attention (for chunk_kda both of its modes), FlashQLA (Gated DeltaNet, where it runs) and the
PyTorch chunked reference. Each turns the harness's inputs (:func:`dtune.measure.inputs.workload_inputs`) into a
zero-argument call. For a backward kernel (``chunk_kda_bwd``, ``dtune bench --mode fwd+bwd``) every contestant runs
its training step on the same inputs and output gradients: dtune's op with the backward config, ``fla.ops.*.chunk_*``
and the reference with inputs that require grad (:mod:`dtune.measure.grad`).

``fla`` is fla's own Triton path: with FlashQLA (or TileLang, or FlashKDA) installed, fla's ops would dispatch to
those backends on Hopper, so the fla rows switch them off with fla's own variables (:data:`FLA_TRITON_ONLY`, for the
process) and say so. fla refuses its Gated DeltaNet backward on Hopper with Triton >= 3.4, < 3.7.1 (its issue 640:
wrong ``dg`` reported there); the fla training-step rows lift that check for timing and say so (their gradient
errors show whether the gradients are right). ``flashqla`` is ``flash_qla.chunk_gated_delta_rule`` (TileLang; Gated
DeltaNet at K = V = 128, bf16/fp16, on sm_90 and sm_100/103, forward only on sm_120/121), skipped with its reason
elsewhere (:func:`flashqla_skip`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtune.kernels import get_kernel
from dtune.measure.grad import Forward, op_kwargs, step_call
from dtune.measure.harness import op_call
from dtune.shape import Shape

BASELINES = ("check_gate", "default", "fla", "flashqla", "torch")
FLA_IMPLS = ("fla", "fla_fast")  # the rows that are fla (its default and, for chunk_kda, its safe_gate mode)
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
# fla's switches for the backends its ops dispatch to before its Triton path (fla.backends: read at each call)
FLA_TRITON_ONLY = {"FLA_FLASH_QLA": "0", "FLA_TILELANG": "0", "FLA_FLASH_KDA": "0", "FLA_DTUNE": "0"}
FLASHQLA_OPS = ("chunk_gated_delta_rule",)
FLASHQLA_DIM = 128  # FlashQLA's kernels: K = V = 128
FLASHQLA_BACKWARD = ((9, 0), (10, 0), (10, 3))  # compute capabilities with its forward and backward kernels
FLASHQLA_FORWARD = ((12, 0), (12, 1))  # forward only

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


def fla_triton_only() -> str:
    """Switch off, for this process, the backends fla would dispatch to before its own Triton path (FlashQLA,
    TileLang, FlashKDA, dtune's): what the fla rows are. Returns the note they carry."""
    os.environ.update(FLA_TRITON_ONLY)
    return "fla's Triton path (" + " ".join(f"{k}={v}" for k, v in FLA_TRITON_ONLY.items()) + ")"


def lift_fla_triton_check() -> str:
    """Let fla's Gated DeltaNet backward run where it refuses to (Hopper, Triton >= 3.4, < 3.7.1: fla issue 640,
    wrong ``dg`` reported), for timing; the note the rows then carry, or "" where fla does not refuse."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except Exception:
        return ""
    refuses = getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
    if not refuses or getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return ""
    setattr(chunk_o, "TRITON_ABOVE_3_7_1", True)  # noqa: B010 (a module read at run time)
    return (
        "fla refuses this backward on Hopper with Triton < 3.7.1 (fla issue 640): check lifted for timing, "
        "see error_grad"
    )


def flashqla_skip(
    kernel: str, shape: Shape | None, dtype: torch.dtype | None, capability: tuple[int, int] | None
) -> str:
    """Why FlashQLA cannot run this call, in one line ("" when it can): Gated DeltaNet only, K = V = 128, bf16 or
    fp16, a GPU it has kernels for (``capability``: None without a CUDA GPU). ``shape``/``dtype`` None: not checked."""
    spec = get_kernel(kernel)
    if spec.forward_kernel not in FLASHQLA_OPS:
        return f"FlashQLA implements Gated DeltaNet only (chunk_gated_delta_rule), not {spec.forward_kernel}: skipped"
    if capability is None:
        return "FlashQLA needs a CUDA GPU: skipped"
    archs = FLASHQLA_BACKWARD if spec.backward else FLASHQLA_BACKWARD + FLASHQLA_FORWARD
    if tuple(capability) not in archs:
        what = "backward" if tuple(capability) in FLASHQLA_FORWARD else "kernels"
        have = ", ".join(f"sm_{a}{b}" for a, b in archs)
        return f"FlashQLA has no {what} for sm_{capability[0]}{capability[1]} (only {have}): skipped"
    if shape is not None and (shape.K != FLASHQLA_DIM or shape.V != FLASHQLA_DIM):
        return f"FlashQLA needs K = V = {FLASHQLA_DIM}, got K = {shape.K}, V = {shape.V}: skipped"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"FlashQLA needs bf16 or fp16 inputs, got {str(dtype).removeprefix('torch.')}: skipped"
    return ""


def flashqla_function() -> tuple[Callable[..., Any] | None, str]:
    """``flash_qla.chunk_gated_delta_rule``, or ``(None, why not)``."""
    try:
        return importlib.import_module("flash_qla").chunk_gated_delta_rule, ""
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"FlashQLA not importable ({type(exc).__name__}: {text}): skipped"


def _flashqla(fn: Callable[..., Any], backward: bool) -> Callable[[Inputs], Call]:
    """FlashQLA's op on the harness's inputs (by keyword, as fla's FlashQLA backend calls it), or its training step;
    ``cu_seqlens`` as int64, as it takes them (converted outside the timed region)."""

    def forward(x: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        out: tuple[torch.Tensor, torch.Tensor | None] = fn(
            q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=x["scale"],
            initial_state=x["initial_state"], output_final_state=x["output_final_state"], cu_seqlens=x["cu_seqlens"],
        )  # fmt: skip
        return out

    def make(x: Inputs) -> Call:
        if x.get("cu_seqlens") is not None:
            x = {**x, "cu_seqlens": x["cu_seqlens"].long()}
        return step_call(forward, x) if backward else (lambda: forward(x))

    return make


def _capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None  # type: ignore[return-value]


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
    kernel: str,
    baselines: Sequence[str],
    config: dict[str, Any] | None,
    source: str,
    on_gpu: bool,
    shape: Shape | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[list[Impl], list[str]]:
    """The contestants for one shape (``shape``, ``dtype``: what FlashQLA is checked on), and notes on baselines
    that cannot run here."""
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
            path = fla_triton_only()
            lifted = lift_fla_triton_check() if backward and op == "chunk_gated_delta_rule" else ""
            note = path + (f"; {lifted}" if lifted else "")
            impls.append(Impl("fla", _fla(fn, gated, backward), None, "fla default", note))
            if op == "chunk_kda":
                fast = _fla(fn, gated, backward, safe_gate=True, lower_bound=KDA_LOWER_BOUND)
                impls.append(Impl("fla_fast", fast, None, "fla safe_gate=True lower_bound=-5", note))
    if "flashqla" in baselines:
        why = flashqla_skip(kernel, shape, dtype, _capability() if on_gpu else None)
        fq, why_not = (None, why) if why else flashqla_function()
        if fq is None:
            notes.append(why_not)
        else:
            impls.append(Impl("flashqla", _flashqla(fq, backward), None, "flash_qla.chunk_gated_delta_rule"))
    if "torch" in baselines:
        impls.append(
            Impl("torch", _torch_reference(backward), None, f"reference.chunk_reference fp32, chunk {TORCH_CHUNK}")
        )
    return impls, notes
