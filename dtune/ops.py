"""Public ops, with flash-linear-attention's argument order and ``[B, T, H, D]`` layout.

Every op validates its inputs before any launch, picks its launch configuration (the ``config`` argument,
else the tuned config for this GPU and shape from :mod:`dtune.store`, else the template's default) and
returns ``(o, final_state)``: ``o`` has v's dtype and shape ``[B, T, HV, V]``; ``final_state`` is
``[N, HV, K, V]`` float32, or ``None`` unless ``output_final_state``.
"""

from __future__ import annotations

from typing import Any

import torch

from dtune.inputs import Gate, check_inputs
from dtune.kernels import get_kernel
from dtune.store import tuned_config

Tensor = torch.Tensor
Result = tuple[Tensor, Tensor | None]

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "run_kernel",
]


def run_kernel(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """Run the kernel named ``kernel`` (e.g. ``"chunk_kda"``): the one entry point behind every op."""
    spec = get_kernel(kernel)
    problem = check_inputs(q, k, v, g, beta, Gate(spec.gate), scale, initial_state, cu_seqlens)
    if config is None:
        config = tuned_config(spec.name, problem, v.dtype, v.device)
    full = spec.check_config(problem.K, problem.V, config)
    scale = problem.K**-0.5 if scale is None else float(scale)
    # the chunk family builds its chunk tables from the offsets check_inputs already read (no second host copy)
    extra = {"seq_offsets": problem.seq_offsets} if spec.family == "chunk" else {}
    return spec.module.forward(
        q, k, v, g, beta, spec.gate, scale, initial_state, output_final_state, cu_seqlens, full, **extra
    )


def fused_recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """DeltaNet, token by token (decoding, short prompts)."""
    return run_kernel(
        "fused_recurrent_delta_rule",
        q,
        k,
        v,
        None,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        config,
    )


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """Gated DeltaNet (scalar log gate ``g`` [B, T, HV]), token by token."""
    return run_kernel(
        "fused_recurrent_gated_delta_rule",
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        config,
    )


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """Kimi Delta Attention (per-channel log gate ``g`` [B, T, HV, K]), token by token."""
    return run_kernel(
        "fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, config
    )


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """DeltaNet, chunkwise (prefill, training)."""
    return run_kernel(
        "chunk_delta_rule", q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens, config
    )


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """Gated DeltaNet, chunkwise."""
    return run_kernel(
        "chunk_gated_delta_rule",
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        config,
    )


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> Result:
    """Kimi Delta Attention, chunkwise."""
    return run_kernel("chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, config)
