"""dtune as a backend of flash-linear-attention's dispatch (fla-core >= 0.6.0): fla's own ops, and the models built on
them, run dtune's kernels without a line of their code changed.

    import dtune.integrations.fla as dtune_fla
    dtune_fla.enable()          # or FLA_DTUNE=1 in the environment (the import registers the backend)

Importing this module registers :class:`DtuneBackend` with ``fla.backends`` for the entry points fla dispatches that
dtune serves:

- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla's operation ``'gated_delta_rule'``): dtune's
  ``chunk_gated_delta_rule``, forward and backward;
- ``fla.ops.kda.chunk_kda`` (the function's own registry): dtune's ``chunk_kda``, forward and backward;
- ``fla.ops.kda.fused_recurrent_kda`` (operation ``'kda'``, its ``fused_recurrent_kda_fwd``): dtune's
  ``fused_recurrent_kda`` (decoding; inference only, as fla's).

fla 0.6.0 dispatches neither its delta rule nor its Gated DeltaNet decode (``fused_recurrent_gated_delta_rule``), so no
backend can take those calls. For the chunk delta rule this module gives :func:`chunk_delta_rule`: fla's own function
put behind fla's own dispatch (``fla.backends.dispatch``), with this backend registered on it. Same signature, same
results, and the same fallback to fla's function for the calls dtune declines; a model uses it by importing it from
here instead of from ``fla.ops.delta_rule`` (the one line that changes). Nothing in fla is patched.

**Switch.** Off by default, as fla's opt-in backends are (``default_enable = False``), because it must never make a
user slower by surprise. ``FLA_DTUNE`` (fla's convention: ``FLA_FLASH_QLA``, ``FLA_TILELANG``) switches it without a
code change and always wins: ``0`` off, ``1`` on, ``always`` on without the speed rule below. fla never imports dtune,
so the module has to be imported once (e.g. in the launcher); :func:`enable` is that import and the switch for code
(``enable("always")``), :func:`disable` undoes it.

**Priority** 2: before FlashQLA and FlashKDA (3), TileLang (5) and fla's own Triton path (the fallback).

**Verifier.** Each entry point's ``<name>_verifier`` accepts exactly the calls dtune computes right and names the
first thing it does not honour for the rest (dtype, head dims outside 16-256, an fla option dtune does not have,
context parallelism, CUDA-graph varlen, continuous batching, ...); the call then falls through to the next backend
and finally to fla's own function. The in-kernel options real models pass (``use_qk_l2norm_in_kernel``,
``use_gate_in_kernel`` with ``A_log``/``dt_bias``/``lower_bound``, ``use_beta_sigmoid_in_kernel``,
``allow_neg_eigval``, ``state_v_first``) are applied inside the fused-recurrent kernel, the gate inside the chunk
forward's first stage outside autograd, and otherwise as exact separate passes (:mod:`dtune.options`); ``safe_gate``,
``disable_recompute`` and ``chunk_size`` are speed and memory choices of fla's kernels that do not change a result, and
are accepted; ``cu_seqlens_cpu`` saves dtune's host read of ``cu_seqlens``.

**Never slower** (policy ``measured``, the default). The verifier finds which backend would run the call if dtune
declined (the next one in fla's order whose own verifier accepts it, else ``"fla"``: fla's Triton path) and accepts
only where the nearest tuned-config entry that measured the two side by side in one run, at the call's head dims and
value-head ratio, records dtune at least as fast as that one (``side_by_side_ms``: the forward entry for a call without
gradients, the ``*_bwd`` entry's training step for one with them): the call's own bucket where it was measured, else
the nearest measured one. No such measurement near the call's shape (within a factor of :data:`NEAR` in tokens per
sequence, sequences and heads), or a faster peer: dtune declines and says why. One exception: where fla's own function
would raise on the call (its Gated DeltaNet backward on Hopper with Triton >= 3.4, < 3.7.1, fla issue 640) and no other
backend takes it, dtune takes it, measured or not (:func:`fla_refusal`): the alternative is an error. The verdict is
cached by shape, dtype, options and what would run instead (the other backends' verifiers are asked on every call: their
verdicts may read any argument), so a call pays attribute reads and those verifiers; :func:`decisions` lists the
verdicts so far.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from inspect import unwrap
from typing import Any, ClassVar

import torch

from dtune import store
from dtune.autograd import needs_grad
from dtune.inputs import FLOAT_DTYPES, dtype_name, interpreting
from dtune.integrations.fla_calls import KERNEL_OF, READERS, Call
from dtune.integrations.speed_rule import NEAR, speed_verdict
from dtune.kernels import get_kernel
from dtune.kernels.chunk.tables import remember_host_offsets
from dtune.ops import run_kernel
from dtune.shape import Gate, Shape

try:
    import fla.backends as fla_backends
    from fla.backends import BaseBackend, register
    from fla.ops.delta_rule import chunk_delta_rule as _fla_chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda as _fla_chunk_kda
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dtune.integrations.fla needs flash-linear-attention's fla-core >= 0.6.0 (fla.backends.register): "
        f'pip install "dtune[fla]" ({exc})'
    ) from exc

Tensor = torch.Tensor
__all__ = ["NEAR", "DtuneBackend", "chunk_delta_rule", "clear_cache", "decisions", "disable", "enable", "policy"]

ENV = "FLA_DTUNE"
POLICIES = ("measured", "always")
HEAD_DIMS = (16, 256)  # the head dims dtune's templates are checked at
PRIORITY = 2

logger = logging.getLogger(__name__)

_switch: dict[str, Any] = {"on": False, "policy": "measured"}  # what enable()/disable() set; FLA_DTUNE wins


def enable(policy: str = "measured") -> None:
    """Turn the dtune backend on (unless ``FLA_DTUNE=0``): ``"measured"`` runs dtune where the tuned configs record
    it faster than the backend that would run otherwise; ``"always"`` wherever dtune computes the call right."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    _switch.update(on=True, policy=policy)
    clear_cache()


def disable() -> None:
    """Turn the dtune backend off (``FLA_DTUNE`` still wins where it is set)."""
    _switch.update(on=False, policy="measured")
    clear_cache()


def policy() -> str | None:
    """The policy in force: ``"measured"``, ``"always"``, or None when the backend is off."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env == "0" else ("always" if env == "always" else "measured")
    return str(_switch["policy"]) if _switch["on"] else None


_SPECS = {k: (get_kernel(k), Gate(get_kernel(k).gate)) for k in KERNEL_OF.values()}  # kernel -> (spec, gate)


# ---- what dtune computes right -------------------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dtype in FLOAT_DTYPES


def call_needs_grad(call: Call) -> bool:
    """True when autograd records the call: grad mode on and an input (A_log, dt_bias included) requires grad."""
    A_log, dt_bias = call.options.tensors()
    return needs_grad(call.q, call.k, call.v, call.g, call.beta, call.initial_state, A_log, dt_bias)


def unsupported(call: Call, grad: bool) -> str | None:
    """Why dtune cannot compute this call right (a reason for fla's log), or None. Reads shapes, dtypes and devices
    only: no tensor values, no host sync, no environment read on a GPU."""
    if call.unsupported is not None:
        return f"dtune does not support {call.unsupported}"
    q, k, v, g, beta, h0 = call.q, call.k, call.v, call.g, call.beta, call.initial_state
    spec, gate = _SPECS[call.kernel]
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(beta, Tensor)):
        return "dtune takes q, k [B, T, H, K] and v [B, T, HV, V] tensors"
    if q.dim() != 4 or v.dim() != 4:
        return "dtune takes q, k [B, T, H, K] and v [B, T, HV, V] tensors"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or HV % H or beta.shape != (B, T, HV):
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}"
        return f"inconsistent shapes {shapes}"
    if gate is not Gate.NONE:
        want = (B, T, HV) if gate is Gate.SCALAR else (B, T, HV, K)
        if not isinstance(g, Tensor) or g.shape != want:
            return f"a gate g of shape {tuple(g.shape) if isinstance(g, Tensor) else None}, not {want}"
    dtype = q.dtype
    if not (dtype == k.dtype == v.dtype and dtype in FLOAT_DTYPES):
        return f"q, k, v of dtypes {q.dtype}, {k.dtype}, {v.dtype} (dtune: one of float32, float16, bfloat16)"
    for x in (beta, g, h0):
        if x is not None and not _is_float(x):
            return "a beta, gate or initial state that is not floating point"
    if not (HEAD_DIMS[0] <= K <= HEAD_DIMS[1] and HEAD_DIMS[0] <= V <= HEAD_DIMS[1]):
        return f"head dims K={K}, V={V} (dtune's kernels: {HEAD_DIMS[0]} to {HEAD_DIMS[1]})"
    device = q.device
    cu, o = call.cu_seqlens, call.options
    for x in (k, v, g, beta, h0, cu, o.A_log, o.dt_bias):
        if x is not None and isinstance(x, Tensor) and x.device != device:
            return "tensors on different devices"
    if device.type != "cuda":
        if not (device.type == "cpu" and interpreting()):
            return f"tensors on {device.type} (dtune's kernels run on CUDA GPUs)"
        if spec.family == "chunk" and dtype != torch.float32:
            return "16-bit inputs under Triton's interpreter (its tl.dot is wrong on them: float32 only)"
    N = B
    if cu is not None:
        if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            return "cu_seqlens that is not a 1-D int32/int64 tensor"
        if B != 1 or cu.numel() < 2:
            return f"cu_seqlens with B = {B} (fla packs sequences into B = 1)"
        N = cu.numel() - 1
        cpu = call.cu_seqlens_cpu
        if cpu is not None and (not isinstance(cpu, Tensor) or cpu.device.type != "cpu" or cpu.numel() != cu.numel()):
            return "a cu_seqlens_cpu that is not a CPU copy of cu_seqlens"
    if h0 is not None:
        want_h0 = (N, HV, V, K) if o.state_v_first else (N, HV, K, V)
        if h0.shape != want_h0:
            return f"an initial state of shape {tuple(h0.shape)}, not {want_h0}"
    try:
        o.check(gate, HV, K)
    except ValueError as e:
        return str(e)
    if grad and spec.backward_kernel is None:
        return f"gradients through {call.entry} (dtune's {call.kernel} has no backward, nor has fla's)"
    if call.out is not None and (not isinstance(call.out, Tensor) or call.out.shape != v.shape):
        return "an output buffer whose shape is not v's"
    return None


# ---- the speed rule ------------------------------------------------------------------------------------------


_REGISTRIES: dict[str, Any] = {}


def _registry(entry: str) -> Any:
    """fla's registry that dispatches ``entry`` (None where this fla keeps it elsewhere); looked up once."""
    if entry in _REGISTRIES:
        return _REGISTRIES[entry]
    if entry in ("chunk_kda", "chunk_delta_rule"):
        fn = _fla_chunk_kda if entry == "chunk_kda" else _fla_chunk_delta_rule
        found = getattr(fla_backends, "_function_registries", {}).get(unwrap(fn))
    else:
        op = "gated_delta_rule" if entry == "chunk_gated_delta_rule" else "kda"
        found = getattr(fla_backends, "_operation_registries", {}).get(op)
    if found is not None:
        _REGISTRIES[entry] = found
    return found


def _others(registry: Any) -> list[Any]:
    """The enabled backends after dtune in fla's order for this registry."""
    if registry is None or not hasattr(registry, "_get_sorted_backends"):
        return []
    order = registry._get_sorted_backends()
    return [b for b in order if b.backend_type != DtuneBackend.backend_type and b.is_available() and b.is_enabled()]


def fallback(entry: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Which implementation runs this call if dtune declines it: the first enabled backend after dtune whose own
    verifier accepts it, else ``"fla"`` (fla's function); None when this fla's registry cannot be inspected."""
    registry = _registry(entry)
    if registry is None or not hasattr(registry, "_get_sorted_backends"):
        return None
    for backend in _others(registry):
        accepted, _ = backend.verify(entry, *args, **kwargs)
        if accepted and backend.get_implementation(entry) is not None:
            return str(backend.backend_type)
    return "fla"


def fla_checks_gated_backward() -> bool:
    """Whether fla's own ``chunk_bwd_dqkwg`` refuses its gated call here (Hopper, Triton >= 3.4, < 3.7.1: fla issue
    640), from fla's own flags; False for an fla without them."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except Exception:  # another fla layout: no known refusal
        return False
    flags = (getattr(chunk_o, n, None) for n in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1"))
    return tuple(flags) == (True, True, False)


def fla_refusal(call: Call, grad: bool, peer: str | None) -> str | None:
    """Why fla's own function would raise on this call where dtune computes it (None: it would not). fla 0.6.0 refuses
    the Gated DeltaNet backward on Hopper with Triton >= 3.4, < 3.7.1 (its issue 640: a miscompile that gives wrong
    ``dg``; its ``chunk_bwd_dqkwg`` raises unless a backend of its ``'common'`` operation, TileLang, serves it). Read
    from fla's own flags, once per verdict."""
    if not grad or peer != "fla" or call.kernel != "chunk_gated_delta_rule" or not fla_checks_gated_backward():
        return None
    common = getattr(fla_backends, "_operation_registries", {}).get("common")
    if any(b.get_implementation("chunk_bwd_dqkwg") is not None for b in _others(common)):
        return None  # fla hands that kernel to another backend and does not raise
    return (
        "fla's own Gated DeltaNet backward raises on Hopper with Triton >= 3.4, < 3.7.1 (fla issue 640): "
        "dtune takes the training step"
    )


def measured_verdict(call: Call, peer: str | None, grad: bool) -> tuple[bool, str | None]:
    """The speed rule (:func:`dtune.integrations.speed_rule.speed_verdict`) on the call's shape, with the tuned
    configs in force on its GPU."""
    q, v = call.q, call.v
    B, T, H, K = q.shape
    N = B if call.cu_seqlens is None else call.cu_seqlens.numel() - 1
    spec = get_kernel(call.kernel)
    shape = Shape(B, T, H, v.shape[2], K, v.shape[3], N, Gate(spec.gate), call.cu_seqlens is not None)
    gpu = store.gpu_key(q.device)  # through the module: tests and tools may swap it
    configs = store.configs_in_force(gpu) if gpu is not None else None
    return speed_verdict(configs, call.kernel, shape, dtype_name(v.dtype), peer, grad)


_verdicts: dict[tuple[Any, ...], tuple[bool, str | None]] = {}


def _verdict_text(verdict: tuple[bool, str | None]) -> str:
    ok, why = verdict
    return ("dtune" + (f" ({why})" if why else "")) if ok else f"declined: {why}"


def clear_cache() -> None:
    """Forget the cached verdicts (after loading other tuned configs with ``dtune.store.load_configs``)."""
    _verdicts.clear()


def decisions() -> list[dict[str, Any]]:
    """The verdicts so far: entry point, shape, dtype, gradients, options, what runs instead when dtune declines,
    accepted and the reason."""
    keys = ("entry", "q", "v", "N", "dtype", "device", "grad", "options", "instead")
    return [{**dict(zip(keys, key)), "accepted": ok, "reason": why} for key, (ok, why) in _verdicts.items()]


def _key(call: Call, grad: bool, peer: str | None) -> tuple[Any, ...]:
    o = call.options
    flags = (
        o.use_qk_l2norm_in_kernel,
        o.use_gate_in_kernel,
        o.lower_bound,
        o.use_beta_sigmoid_in_kernel,
        o.allow_neg_eigval,
        o.state_v_first,
        call.initial_state is not None,
        call.output_final_state,
    )
    N = call.q.shape[0] if call.cu_seqlens is None else -(call.cu_seqlens.numel() - 1)  # negative: packed
    dev = (call.q.device.type, call.q.device.index)
    return (call.entry, tuple(call.q.shape), tuple(call.v.shape), N, call.q.dtype, dev, grad, flags, peer)


# ---- the backend ---------------------------------------------------------------------------------------------


class DtuneBackend(BaseBackend):
    """dtune's kernels behind fla's dispatch (see the module docstring). One instance per fla registry."""

    backend_type: ClassVar[str] = "dtune"
    package_name: ClassVar[str | None] = "dtune"
    env_var = ENV
    default_enable: ClassVar[bool] = False
    priority: ClassVar[int] = PRIORITY

    def is_enabled(self) -> bool:
        return policy() is not None

    def _verify(self, entry: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, str | None]:
        call = READERS[entry](*args, **kwargs)
        grad = call_needs_grad(call)
        why = unsupported(call, grad)
        if why is not None:
            return False, why
        if policy() == "always":
            return True, None
        peer = fallback(entry, args, kwargs)  # asked every call: a peer's verdict may read any argument
        key = _key(call, grad, peer)
        verdict = _verdicts.get(key)
        if verdict is None:
            refusal = fla_refusal(call, grad, peer)  # dtune, or an error: no speed to compare
            verdict = (True, refusal) if refusal else measured_verdict(call, peer, grad)
            _verdicts[key] = verdict
            logger.info("%s %s: %s", entry, key[1:4], _verdict_text(verdict))
        return verdict

    def _run(self, entry: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = READERS[entry](*args, **kwargs)
        if call.cu_seqlens_cpu is not None and isinstance(call.cu_seqlens, Tensor):
            remember_host_offsets(call.cu_seqlens, call.cu_seqlens_cpu)
        inputs = (call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state, call.output_final_state)
        o, ht = run_kernel(
            call.kernel, *inputs, call.cu_seqlens, check_gate=False, options=call.options
        )  # fla checks no gate values: neither does its backend (no host sync)
        if call.out is not None:
            o = call.out.copy_(o)
        if call.inplace_final_state and ht is not None:
            ht = call.initial_state.copy_(ht)
        if call.entry.startswith("chunk"):
            o = o.to(call.q.dtype)  # fla's chunk ops return o in q's dtype
        return o, ht

    def chunk_gated_delta_rule_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
        return self._verify("chunk_gated_delta_rule", args, kwargs)

    def chunk_gated_delta_rule(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        result: tuple[Tensor, Tensor | None] = self._run("chunk_gated_delta_rule", args, kwargs)
        return result

    def chunk_kda_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
        return self._verify("chunk_kda", args, kwargs)

    def chunk_kda(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        result: tuple[Tensor, Tensor | None] = self._run("chunk_kda", args, kwargs)
        return result

    def fused_recurrent_kda_fwd_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
        return self._verify("fused_recurrent_kda_fwd", args, kwargs)

    def fused_recurrent_kda_fwd(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        result: tuple[Tensor, Tensor | None] = self._run("fused_recurrent_kda_fwd", args, kwargs)
        return result

    def chunk_delta_rule_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
        return self._verify("chunk_delta_rule", args, kwargs)

    def chunk_delta_rule(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        result: tuple[Tensor, Tensor | None] = self._run("chunk_delta_rule", args, kwargs)
        return result


def _dispatched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind fla's dispatch: itself where fla dispatches it already (or dispatch is disabled), else
    ``fla.backends.dispatch(fn)`` (fla's own wrapper: verifiers, fallback, the log line)."""
    if unwrap(fn) in getattr(fla_backends, "_function_registries", {}):
        return fn
    wrapped: Callable[..., Any] = fla_backends.dispatch(fn)
    if wrapped is not fn:
        wrapped.__doc__ = (
            "fla's ``chunk_delta_rule`` (same signature and results) behind fla's dispatch, with the dtune backend "
            "registered on it: ``from dtune.integrations.fla import chunk_delta_rule``. fla 0.6.0 dispatches no "
            "delta-rule op itself.\n\n" + (fn.__doc__ or "")
        )
    return wrapped


chunk_delta_rule = _dispatched(_fla_chunk_delta_rule)

register("gated_delta_rule")(DtuneBackend)
register(_fla_chunk_kda)(DtuneBackend)
register("kda")(DtuneBackend)
register(chunk_delta_rule)(DtuneBackend)
_ = _fla_chunk_gated_delta_rule  # imported so that fla's 'gated_delta_rule' registry and its backends are loaded
