"""The training step: the measured call of a backward kernel (``chunk_*_bwd``), and the gradients it is checked on.

A backward kernel's config is timed and gated on what a training loop pays per call (``dtune.kernels``' docstring
says why not on the backward alone): the op's forward under autograd, then ``torch.autograd.grad`` of the output
and the final state from fixed random gradients ``do``, ``dht`` (:func:`output_grads`), into leaf copies of
``q, k, v, g, beta, initial_state`` that require grad. ``torch.autograd.grad`` returns the gradients without
accumulating them into ``.grad`` (no extra add kernels per call).

:func:`step_call` turns any forward (dtune's op, fla's, the float64 reference) into such a step; :func:`op_step` is
dtune's op with a backward config (the forward config: the tuned one for the shape, else the default, as a training
loop gets it). A step returns :class:`StepResult` ``(o, final_state, grads)``, whose first item is the output like a
forward call's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

Tensor = torch.Tensor
DIFF_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")  # the op's differentiable inputs, in the ops' order
OP_ARGS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens")
GRAD_SEED = 4321  # the output gradients every timed step uses
REFERENCE_CHUNK = 32  # chunk_reference's default chunk
REFERENCE_MAX_BYTES = 4 * 2**30  # the float64 reference's autograd graph beyond which a measurement skips or shrinks it


class StepResult(NamedTuple):
    """What one training step computed: the forward's outputs and the gradient of every differentiable input
    (``None`` for an input that is ``None``)."""

    o: Tensor
    final_state: Tensor | None
    grads: dict[str, Tensor | None]


def output_grads(x: dict[str, Any], seed: int = GRAD_SEED, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """Random gradients of the output (``[B, T, HV, V]``, v's dtype) and of the final state (``[N, HV, K, V]``,
    float32; None unless ``x["output_final_state"]``) of a call on inputs ``x``; ``values=False``: uninitialised."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v, k = x["v"], x["k"]
    B, T, HV, V = v.shape
    cu = x.get("cu_seqlens")
    N = B if cu is None else cu.numel() - 1
    if not values:
        blank_dht = torch.empty(N, HV, k.shape[-1], V, device=v.device) if x.get("output_final_state") else None
        return torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device), blank_dht
    do = torch.randn(B, T, HV, V, generator=gen).to(device=v.device, dtype=v.dtype)
    dht = None
    if x.get("output_final_state", False):
        dht = torch.randn(N, HV, k.shape[-1], V, generator=gen).to(device=v.device, dtype=torch.float32)
    return do, dht


def with_output_grads(x: dict[str, Any], seed: int = GRAD_SEED, values: bool = True) -> dict[str, Any]:
    """``x`` with ``do`` and ``dht`` (:func:`output_grads`) added, for a step to read."""
    do, dht = output_grads(x, seed, values)
    return {**x, "do": do, "dht": dht}


def leaves(x: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``x`` with its differentiable inputs replaced by leaves that require grad (``dtype``: cast first, e.g. float64
    for the reference; the storage is shared otherwise)."""
    out = dict(x)
    for name in DIFF_INPUTS:
        t = x.get(name)
        if t is not None:
            t = t.detach() if dtype is None else t.detach().to(dtype)
            out[name] = t.requires_grad_()
    return out


Forward = Callable[[dict[str, Any]], tuple[Tensor, Tensor | None]]


def step_call(forward: Forward, x: dict[str, Any], dtype: torch.dtype | None = None) -> Callable[[], StepResult]:
    """A zero-argument training step: ``forward(leaves)`` then the gradients of ``<o, do> + <final_state, dht>``.

    ``do``/``dht`` come from ``x`` (:func:`with_output_grads`), else :func:`output_grads`; ``dtype`` casts the
    leaves and the output gradients (the float64 reference)."""
    xs = leaves(x, dtype)
    do, dht = (x["do"], x.get("dht")) if "do" in x else output_grads(x)
    if dtype is not None:
        do = do.to(dtype)
        dht = None if dht is None else dht.to(dtype)
    names = [n for n in DIFF_INPUTS if xs.get(n) is not None]
    wrt = [xs[n] for n in names]

    def step() -> StepResult:
        o, ht = forward(xs)
        outs, grads_out = [o], [do.to(o.dtype)]
        if ht is not None and dht is not None:
            outs.append(ht)
            grads_out.append(dht.to(ht.dtype))
        got = torch.autograd.grad(outs, wrt, grads_out, allow_unused=True)
        grads: dict[str, Tensor | None] = {n: None for n in DIFF_INPUTS}
        grads.update(zip(names, got))
        return StepResult(o.detach(), None if ht is None else ht.detach(), grads)

    return step


def op_kwargs(x: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of an op call in ``x`` (without ``do``, ``dht`` or anything else)."""
    return {n: x[n] for n in OP_ARGS if n in x}


def op_step(
    kernel: str,
    x: dict[str, Any],
    bwd_config: dict[str, Any] | None,
    config: dict[str, Any] | None = None,
    **options: Any,
) -> Callable[[], StepResult]:
    """dtune's training step of the forward op ``kernel`` (e.g. ``"chunk_kda"``) with ``bwd_config`` (None: the
    tuned/default backward config) and the forward ``config`` (None: the tuned/default one): the default call, plus
    the op's keywords in ``options`` (e.g. ``check_gate=True``)."""
    from dtune.ops import run_kernel

    def forward(xs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        return run_kernel(kernel, **op_kwargs(xs), config=config, bwd_config=bwd_config, **options)

    return step_call(forward, x)


def op_step_stages(kernel: str, x: dict[str, Any], bwd_config: dict[str, Any] | None) -> list[Any]:
    """The launches of :func:`op_step`'s step as named stages (:func:`dtune.kernels.chunk.backward.plan_step`: the
    forward under autograd, then each backward launch), each runnable alone once all ran in order, for the stage-wise
    search to time one stage by itself. The forward config is the op's (tuned for the shape, else the default) and
    ``bwd_config`` is completed as the op completes it; ``x`` holds the output gradients (:func:`with_output_grads`)."""
    from dtune.inputs import check_inputs
    from dtune.kernels import get_kernel
    from dtune.kernels.chunk.backward import plan_step
    from dtune.ops import GATES
    from dtune.store import tuned_config

    spec = get_kernel(kernel)
    if not spec.backward:
        raise ValueError(f"{kernel} is no backward kernel (its stages are its plan's: dtune.measure.harness.op_stages)")
    fwd_spec = get_kernel(spec.forward_kernel)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    h0, cu = x.get("initial_state"), x.get("cu_seqlens")
    problem = check_inputs(q, k, v, g, beta, GATES[fwd_spec.gate], x.get("scale"), h0, cu, False)
    fwd = fwd_spec.check_config(problem.K, problem.V, tuned_config(fwd_spec.name, problem, v.dtype, v.device))
    if bwd_config is None:
        bwd_config = tuned_config(kernel, problem, v.dtype, v.device)
    bwd = spec.check_config(problem.K, problem.V, bwd_config)
    scale = problem.K**-0.5 if x.get("scale") is None else float(x["scale"])
    do, dht = (x["do"], x.get("dht")) if "do" in x else output_grads(x)
    final = bool(x.get("output_final_state", False))
    stages, _ = plan_step(q, k, v, g, beta, fwd_spec.gate, scale, h0, final, cu, fwd, bwd, do, dht)
    return stages


def reference_bytes(p: Any) -> float:
    """Rough float64 bytes of autograd through the chunked reference on shape ``p`` (a :class:`dtune.shape.Shape`):
    ~3 saved states per chunk and ~16 token-sized tensors."""
    chunks = -(-p.T // REFERENCE_CHUNK)
    return 8.0 * (3 * chunks * p.B * p.HV * p.K * p.V + 16 * p.B * p.T * p.HV * max(p.K, p.V))


def reference_step(x: dict[str, Any], loop: bool = False) -> StepResult:
    """The float64 truth of a step on ``x``: autograd through :func:`dtune.kernels.reference.chunk_reference`
    (vectorised over chunks, fit for real sizes on a GPU; agrees with the loop's gradients to ~1e-12), or with
    ``loop`` through the token-by-token :func:`~dtune.kernels.reference.naive_recurrent` (small inputs)."""
    from dtune.kernels.reference import chunk_reference, naive_recurrent

    fn = naive_recurrent if loop else chunk_reference

    def forward(xs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        return fn(**op_kwargs(xs))

    return step_call(forward, x, torch.float64)()
