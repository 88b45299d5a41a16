"""Public ops, with flash-linear-attention's argument order and ``[B, T, H, D]`` layout.

Every op validates its inputs before any launch, picks its launch configuration (the ``config`` argument,
else the tuned config for this GPU and shape from :mod:`dtune.store`, else the template's default) and
returns ``(o, final_state)``: ``o`` has v's dtype and shape ``[B, T, HV, V]``; ``final_state`` is
``[N, HV, K, V]`` float32, or ``None`` unless ``output_final_state``.

The recurrence (docs/DESIGN.md §1), per value head and token: ``S ← diag(exp(g_t)) S`` (Gated DeltaNet: one
scalar decay per head; DeltaNet: none), ``u_t = β_t (v_t − Sᵀ k_t)``, ``S ← S + k_t u_tᵀ``,
``o_t = Sᵀ (scale · q_t)``.

The gate contract: ``g`` is a log-space decay, ``g <= 0`` everywhere; ``-inf`` is a valid full forget (the state
is cleared at that token, as in the float64 reference). The default call reads nothing back from the GPU (no host
sync: it can be captured in a CUDA graph), so it does not look at ``g``'s values: a NaN gives NaN in every output it
reaches (never a finite number in its place), and a positive entry is computed as the recurrence says (the state
grows by ``exp(g)`` at that step; large ones overflow to inf/NaN). ``check_gate=True`` (or ``DTUNE_CHECK_GATE=1`` in
the environment when dtune is imported, for a whole program) refuses NaN and positive entries with a ``ValueError``
naming ``g`` before anything is launched, at the cost of one read of ``g`` and one host sync per call (skipped while a
CUDA graph is being captured).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from dtune import inputs
from dtune.autograd import chunk_with_grad, needs_grad
from dtune.inputs import check_inputs, check_interpretable
from dtune.kernels import get_kernel
from dtune.kernels.options import NO_IN_KERNEL
from dtune.options import Options, in_kernel_pays
from dtune.shape import Gate
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


def other_device(t: Any) -> torch.device | None:
    """``t``'s CUDA device where it is not the current one (a model spread over GPUs, ``device_map="auto"``), else
    None."""
    if isinstance(t, Tensor) and t.is_cuda and t.get_device() != torch.cuda.current_device():
        return t.device
    return None


def on_inputs_device(t: Any) -> contextlib.AbstractContextManager[Any]:
    """The CUDA device ``t`` lives on made current for the block, where it is another (else nothing changes)."""
    device = other_device(t)
    return _AS_IS if device is None else torch.cuda.device(device)


_AS_IS = contextlib.nullcontext()  # (reusable: it holds nothing)


# Under torch.compile each call is a graph break and runs eagerly, as fla's ops do (``torch.compiler.disable``): the
# call's host logic (input checks, the config lookup, the chunk tables, the launch cache) is not traceable, and a
# model compiled around a layer that calls an op must still run it.
@torch.compiler.disable
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
    bwd_config: dict[str, Any] | None = None,
    check_gate: bool | None = None,
    options: Options | None = None,
) -> Result:
    """Run the kernel named ``kernel`` (e.g. ``"chunk_kda"``): the one entry point behind every op.

    With grad mode on and an input that requires grad, the chunk kernels run through their autograd Function
    (:mod:`dtune.autograd`; ``bwd_config`` overrides the backward's tuned/default config) and the fused-recurrent
    ones raise (they have no backward). ``g`` is ``None`` for the ungated kernels. ``check_gate``: refuse NaN and
    positive gate values, one host sync (see the module's docstring); ``None``: ``DTUNE_CHECK_GATE``, default off.
    No host sync otherwise, beyond one read of a ``cu_seqlens`` tensor not seen before. ``options``:
    flash-linear-attention's in-kernel options (:class:`dtune.options.Options`): the fused-recurrent kernels apply
    them as they load each token (one launch); the chunk forward outside autograd applies them in its stages as
    they load g, q, k and beta (``state_v_first``'s states transposed around it); under autograd (or
    ``check_gate``) every option is a separate differentiable pass. The kernels run on the inputs' device, whichever
    device is current."""
    with on_inputs_device(q):  # Triton launches on the current device: make it the inputs' (as fla's ops do)
        spec = get_kernel(kernel)
        if spec.backward:
            raise ValueError(
                f"{kernel} is the backward of {spec.forward_kernel}: call {spec.forward_kernel} with inputs that "
                f"require grad (its bwd_config= sets {kernel}'s parameters)"
            )
        in_kernel, route = NO_IN_KERNEL, None
        if options is not None:
            route = _route(spec.family, spec.gate, options, check_gate, bwd_config, cu_seqlens, q, k, v, g, beta,
                           initial_state)  # fmt: skip
            if route == "passes":
                call = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
                return _run_with_options(kernel, *call, config, bwd_config, check_gate, options)
            if isinstance(q, Tensor) and isinstance(v, Tensor) and q.dim() == 4 and v.dim() == 4:  # else checked below
                options.check(Gate(spec.gate), v.shape[2], q.shape[3], q.device)
            if route == "kernel":
                in_kernel = options.in_kernel()
            else:  # "chunk": the chunk forward's stages apply the options as they load g, q, k and beta
                in_kernel = options.chunk_in_kernel()
                if options.state_v_first and initial_state is not None:  # [V, K] states: transposed around the call
                    initial_state = initial_state.transpose(-1, -2)
        h0 = initial_state.transpose(-1, -2) if in_kernel.state_vk and initial_state is not None else initial_state
        problem = check_inputs(q, k, v, g, beta, GATES[spec.gate], scale, h0, cu_seqlens, check_gate)
        chunk = spec.family == "chunk"
        if chunk and q.is_cpu:
            check_interpretable(kernel, spec.family, q, v)
        grad = needs_grad(q, k, v, g, beta, initial_state)
        if config is None:
            config = tuned_config(spec.name, problem, v.dtype, v.device)
        full = spec.check_config(problem.K, problem.V, config)
        scale = problem.K**-0.5 if scale is None else float(scale)
        args = (q, k, v, g, beta, spec.gate, scale, initial_state, output_final_state, cu_seqlens)
        if grad or bwd_config is not None:
            bwd_name = spec.backward_kernel
            if bwd_name is None:
                raise NotImplementedError(
                    f"{kernel} has no backward (it serves inference: decoding and short prompts), but "
                    + ("an input requires grad" if grad else "a bwd_config was given")
                    + f"; for training use {kernel.replace('fused_recurrent_', 'chunk_')} (same arguments), or call it "
                    "under torch.no_grad() / with detached inputs"
                )
            bwd_spec = get_kernel(bwd_name)
            if grad and bwd_config is None:
                bwd_config = tuned_config(bwd_name, problem, v.dtype, v.device)
            bwd = bwd_spec.check_config(problem.K, problem.V, bwd_config)  # checked even when not needed: fail early
            if grad:
                return chunk_with_grad(*args, full, bwd)
        if chunk:  # its chunk tables come from the offsets check_inputs already read (no second copy)
            if route != "chunk":
                return spec.module.forward(*args, full, seq_offsets=problem.seq_offsets)
            assert options is not None
            o, ht = spec.module.forward(*args, full, seq_offsets=problem.seq_offsets, in_kernel=in_kernel)
            return o, options.final_state(ht)
        if options is not None:
            return spec.module.forward(*args, full, in_kernel=in_kernel)
        return spec.module.forward(*args, full)


GATES = {gate.value: gate for gate in Gate}


def _route(
    family: str,
    gate: str,
    options: Options,
    check_gate: bool | None,
    bwd_config: dict[str, Any] | None,
    cu_seqlens: Tensor | None,
    *tensors: Tensor | None,
) -> str:
    """Where a call's options are applied: ``"kernel"`` (all inside the fused-recurrent kernel), ``"chunk"`` (inside
    the chunk forward's stages: the gate, the l2norm and beta's activation as they load them; ``state_v_first``'s
    states transposed around the call) or ``"passes"`` (every option a separate pass: under autograd, where the
    passes' backward gives every gradient, dA_log and ddt_bias included, with the gate check, which checks the
    activated gate and syncs with the host anyway, and for calls longer than the kernels pay for:
    :func:`dtune.options.in_kernel_pays`)."""
    if inputs.CHECK_GATE if check_gate is None else check_gate:
        return "passes"
    q = tensors[0]
    if isinstance(q, Tensor) and q.dim() == 4:
        tokens = q.shape[0] * q.shape[1]
        seqs = q.shape[0] if cu_seqlens is None else max(1, cu_seqlens.numel() - 1)
        if not in_kernel_pays(family, tokens, tokens / seqs, gate):
            return "passes"
    if family == "fused_recurrent":
        return "kernel"
    grad = needs_grad(*tensors, options.A_log, options.dt_bias)
    return "passes" if grad or bwd_config is not None else "chunk"


def _run_with_options(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    config: dict[str, Any] | None,
    bwd_config: dict[str, Any] | None,
    check_gate: bool | None,
    options: Options,
) -> Result:
    """:func:`run_kernel` with fla's options: checked, applied to the inputs, the final state put in their layout."""
    if all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, v)):  # else check_inputs names the problem
        options.check(Gate(get_kernel(kernel).gate), v.shape[2], q.shape[3], q.device)
        q, k, g, beta, initial_state = options.apply(q, k, g, beta, initial_state)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    o, ht = run_kernel(kernel, *args, config, bwd_config, check_gate)
    return o, options.final_state(ht)


class UngatedOp(Protocol):
    """An op without a gate: ``op(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, config=None, bwd_config=None) -> (o, final_state)``; ``bwd_config`` sets the chunk
    backward's parameters (the fused-recurrent ops have no backward)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
        options: Options | None = None,
    ) -> Result: ...


class GatedOp(Protocol):
    """An op with a log-space gate ``g``: ``op(q, k, v, g, beta, ..., check_gate=None)``, the rest as
    :class:`UngatedOp`; ``check_gate=True`` checks the gate's values (NaN, positive: one host sync), ``None`` does
    as ``DTUNE_CHECK_GATE`` says (default: no check)."""

    def __call__(
        self,
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
        bwd_config: dict[str, Any] | None = None,
        check_gate: bool | None = None,
        options: Options | None = None,
    ) -> Result: ...


def _ungated(kernel: str, doc: str) -> UngatedOp:
    def op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
        options: Options | None = None,
    ) -> Result:
        args = (q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
        return run_kernel(kernel, *args, config, bwd_config, options=options)

    op.__name__ = op.__qualname__ = kernel
    op.__doc__ = doc
    return op


def _gated(kernel: str, doc: str) -> GatedOp:
    def op(
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
        bwd_config: dict[str, Any] | None = None,
        check_gate: bool | None = None,
        options: Options | None = None,
    ) -> Result:
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        return run_kernel(kernel, *args, config, bwd_config, check_gate, options)

    op.__name__ = op.__qualname__ = kernel
    op.__doc__ = doc
    return op


ARGS = """

Args:
    q, k: ``[B, T, H, K]`` queries and keys (float32, float16 or bfloat16; keys are usually L2-normalised).
    v: ``[B, T, HV, V]`` values, ``HV`` a multiple of ``H`` (value head ``hv`` reads key head ``hv // (HV/H)``).{gate}
    beta: ``[B, T, HV]`` write strengths, usually in (0, 1).
    scale: multiplies ``q``; default ``K ** -0.5``.
    initial_state: ``[N, HV, K, V]`` (float32 recommended), ``N = B``, or the number of sequences with ``cu_seqlens``.
    output_final_state: also return the state after the last token, ``[N, HV, K, V]`` float32.
    cu_seqlens: ``[N + 1]`` int32/int64 offsets of ``N`` sequences packed along T (``B == 1``), from 0 to T.
    config: launch parameters of the template (a partial dict is completed from the default); default: the tuned
        config for this GPU and shape bucket (:mod:`dtune.store`), else the template's default.
    bwd_config: the chunk backward's parameters, used when an input requires grad (the chunk ops are differentiable;
        default: the tuned ``<op>_bwd`` config, else the backward's default). The fused-recurrent ops have no
        backward: they refuse it, and raise when an input requires grad.{check}
    options: flash-linear-attention's in-kernel options (:class:`dtune.options.Options`: ``use_qk_l2norm_in_kernel``,
        ``use_gate_in_kernel`` with ``A_log``/``dt_bias``/``lower_bound``, ``use_beta_sigmoid_in_kernel``,
        ``allow_neg_eigval``, ``state_v_first``; ``initial_state`` and ``final_state`` then ``[N, HV, V, K]``):
        the fused-recurrent ops apply them inside their kernel, the chunk ops outside autograd inside their
        stages (the states of ``state_v_first`` transposed around the call); under autograd every option is a
        separate differentiable pass; default none.

Returns:
    ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in v's dtype; ``final_state`` or ``None``.

Raises:
    ValueError / TypeError naming the argument, before any launch: shapes, dtypes, devices,
    ``cu_seqlens``{raises}.
"""
GATE_ARGS = {
    "scalar": """
    g: ``[B, T, HV]`` log-space decay per value head, ``<= 0``; ``-inf`` is a full forget (the state is cleared).""",
    "channel": """
    g: ``[B, T, HV, K]`` log-space decay per key channel, ``<= 0``; ``-inf`` is a full forget of that channel.""",
}
CHECK_ARG = """
    check_gate: ``True`` refuses NaN and positive entries of ``g`` with a ValueError (one read of ``g`` and one host
        sync per call; skipped during CUDA-graph capture); ``None`` (default): only when the environment variable
        ``DTUNE_CHECK_GATE=1`` was set when dtune was imported. Unchecked, NaN gives NaN in the outputs it reaches
        and a positive entry is computed as the recurrence says (the state grows by ``exp(g)``)."""


def _doc(summary: str, gate: str | None) -> str:
    if gate is None:
        return summary + ARGS.format(gate="", check="", raises="")
    return summary + ARGS.format(
        gate=GATE_ARGS[gate], check=CHECK_ARG, raises=", and with ``check_gate`` NaN or positive ``g``"
    )


fused_recurrent_delta_rule = _ungated(
    "fused_recurrent_delta_rule",
    _doc(
        "DeltaNet, token by token (decoding, short prompts): ``S ← S + k (β (v − Sᵀk))ᵀ``, ``o = Sᵀ(scale·q)``.", None
    ),
)
fused_recurrent_gated_delta_rule = _gated(
    "fused_recurrent_gated_delta_rule",
    _doc("Gated DeltaNet, token by token: DeltaNet after ``S ← exp(g_t) S`` (one log decay per value head).", "scalar"),
)
fused_recurrent_kda = _gated(
    "fused_recurrent_kda",
    _doc("Kimi Delta Attention, token by token: DeltaNet after ``S ← diag(exp(g_t)) S`` (per key channel).", "channel"),
)
chunk_delta_rule = _ungated(
    "chunk_delta_rule", _doc("DeltaNet, chunkwise (prefill, training); the same math as the token loop.", None)
)
chunk_gated_delta_rule = _gated(
    "chunk_gated_delta_rule", _doc("Gated DeltaNet, chunkwise (prefill, training); the same math.", "scalar")
)
chunk_kda = _gated("chunk_kda", _doc("Kimi Delta Attention, chunkwise (prefill, training); the same math.", "channel"))
