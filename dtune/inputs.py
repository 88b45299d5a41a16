"""Input contract of every dtune op (run time): validation before any launch, and the dtypes dtune takes.

:func:`check_inputs` turns the tensors a user passes into a :class:`~dtune.shape.Shape` (or raises a
``ValueError`` / ``TypeError`` naming the offending argument). Random inputs that obey the contract are
:func:`dtune.measure.inputs.make_inputs`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from dtune.kernels.chunk.tables import host_offsets
from dtune.shape import Gate, Shape

Tensor = torch.Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in FLOAT_DTYPES:
            raise ValueError(f"dtype {name} is not supported; use one of fp32, fp16, bf16")
        return name
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPE_NAMES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPE_NAMES)}")


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (TRITON_INTERPRET=1) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _need_tensor(name: str, x: Any, ndim: int) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def _need_float(name: str, x: Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def capturing(x: Tensor) -> bool:
    """True while a CUDA graph is being captured on the current stream (reading a value back would break it)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# ---- the gate's values: an opt-in check ------------------------------------------------------------------------

CHECK_GATE_ENV = "DTUNE_CHECK_GATE"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# Whether the gated ops check their gate's values when the call does not say (``check_gate=None``): off, unless
# DTUNE_CHECK_GATE is set (to anything but 0/false/no/off) when dtune is imported. Read once, not per call; a program
# may also set this attribute at run time.
CHECK_GATE: bool = _env_flag(CHECK_GATE_ENV)


def check_gate_values(g: Tensor) -> None:
    """ValueError naming ``g`` when it holds NaN or a positive entry: the opt-in check of the gate contract.

    The gate is the log of a decay in [0, 1]: ``g <= 0`` everywhere, ``-inf`` being a full forget (the state is
    cleared, exactly as the reference computes it). A positive entry grows the state (a constant +5 overflows float32
    within a few dozen tokens) and NaN spreads through the state; without this check the kernels compute them as the
    recurrence says (NaN in the outputs it reaches). Costs one reduction over ``g`` and one host sync, which is why it
    is opt-in; skipped while a CUDA graph is being captured (nothing can be read back there: validate before capture).
    """
    if g.numel() == 0 or capturing(g):
        return
    top = float(g.detach().max())  # NaN when any entry is NaN (torch.max propagates NaN); detached: no grad warning
    if math.isnan(top):
        raise ValueError("g contains NaN: the log-space gate must be a number <= 0 (-inf is a full forget)")
    if top > 0:
        raise ValueError(
            f"g must be a log-space gate <= 0 (log of a decay in [0, 1]; -inf is a full forget), but its largest "
            f"entry is {top:g}: a positive gate grows the state without bound"
        )


# ---- what the CPU path cannot compute --------------------------------------------------------------------------

INTERPRETER_BF16 = (
    "Triton's interpreter computes tl.dot on bfloat16 operands wrongly (results of magnitude ~1e10), so the chunk "
    "kernels cannot run bf16 on the CPU"
)


def interpreter_computes(family: str, dtype: torch.dtype) -> bool:
    """Whether a kernel of ``family`` whose dots run in ``dtype`` computes right under Triton's interpreter (3.9):
    not a chunk kernel in bfloat16 (its ``tl.dot`` on bf16 operands returns garbage; float16 and float32 dots are
    right). The fused-recurrent kernels have no ``tl.dot``: right in every dtype."""
    return not (family == "chunk" and dtype == torch.bfloat16)


def check_interpretable(kernel: str, family: str, q: Tensor, v: Tensor) -> None:
    """RuntimeError when ``kernel`` would return garbage under the interpreter: bf16 dots (the chunk kernels' dots
    run in ``promote_types(q.dtype, v.dtype)``); says what to do instead."""
    dot_dtype = torch.promote_types(q.dtype, v.dtype)
    if not interpreter_computes(family, dot_dtype):
        raise RuntimeError(
            f"{kernel} refused on bfloat16 tensors under Triton's interpreter: {INTERPRETER_BF16}; use float32 (or "
            "float16) tensors on the CPU, or a CUDA GPU"
        )


# ---- the call's arguments --------------------------------------------------------------------------------------

_SIGNATURES: dict[tuple[Any, ...], Shape] = {}  # what check_inputs returned for an argument signature that passed
SIGNATURE_CACHE_SIZE = 512
_VALID_OFFSETS: list[tuple[int, ...]] = []  # cu_seqlens' host offsets already checked (by identity), newest last


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: Gate,
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    check_gate: bool | None = None,
) -> Shape:
    """Validate one call's arguments against the contract; return its :class:`~dtune.shape.Shape`.

    Shapes, dtypes, devices and ``cu_seqlens`` are always checked, and none of that reads device data beyond one
    read of a ``cu_seqlens`` tensor not seen before (:func:`~dtune.kernels.chunk.tables.host_offsets`). The gate's
    values are checked (:func:`check_gate_values`: one read of ``g`` and one host sync) only with ``check_gate``
    (``None``: :data:`CHECK_GATE`, i.e. the ``DTUNE_CHECK_GATE`` environment variable; default off).

    Everything but ``cu_seqlens``' values depends on the arguments' types, shapes, dtypes and devices alone, so a
    signature that passed is remembered (:data:`SIGNATURE_CACHE_SIZE` of them) and its next call costs one lookup.
    """
    try:
        sig = (
            gate, scale.__class__, q.__class__, q.shape, q.dtype, q.device, k.__class__, k.shape, k.dtype, k.device,
            v.__class__, v.shape, v.dtype, v.device, beta.__class__, beta.shape, beta.dtype, beta.device,
            None if g is None else (g.__class__, g.shape, g.dtype, g.device),
            None if initial_state is None else (initial_state.__class__, initial_state.shape, initial_state.dtype,
                                                initial_state.device),
            None if cu_seqlens is None else (cu_seqlens.__class__, cu_seqlens.shape, cu_seqlens.dtype,
                                             cu_seqlens.device),
        )  # fmt: skip
        shape = _SIGNATURES.get(sig)
    except (AttributeError, TypeError):  # not a tensor (or unhashable): the full check names the argument
        sig, shape = None, None
    if shape is None:
        shape = _check_signature(q, k, v, g, beta, gate, scale, initial_state, cu_seqlens)
        if sig is not None:
            if len(_SIGNATURES) >= SIGNATURE_CACHE_SIZE:
                _SIGNATURES.clear()
            _SIGNATURES[sig] = shape
    elif q.is_cpu:
        _check_runnable(q)  # (the interpreter switch is the environment's, not the signature's)
    if scale is not None and not math.isfinite(scale):  # (its type is the signature's, its value each call's)
        raise ValueError(f"scale must be a finite number, got {scale}")
    if cu_seqlens is not None and not capturing(cu_seqlens):
        # Checking the offsets' values reads them on the host: once per tensor; skipped during CUDA-graph capture.
        shape = Shape(**{**shape.__dict__, "seq_offsets": _checked_offsets(cu_seqlens, shape.T)})
    if (CHECK_GATE if check_gate is None else check_gate) and g is not None:
        check_gate_values(g)
    return shape


def _checked_offsets(cu_seqlens: Tensor, T: int) -> tuple[int, ...]:
    """``cu_seqlens`` on the host (read once per tensor: layers sharing it read it once), its values checked once."""
    offs = host_offsets(cu_seqlens)
    if any(o is offs for o in _VALID_OFFSETS):
        return offs
    if offs[0] != 0 or offs[-1] != T:
        raise ValueError(f"cu_seqlens must run from 0 to T = {T}, got {offs[0]} ... {offs[-1]}")
    if any(b < a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    _VALID_OFFSETS[:] = [*_VALID_OFFSETS[-15:], offs]  # held: an identity never belongs to another tuple meanwhile
    return offs


def _check_runnable(q: Tensor) -> None:
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "dtune's Triton kernels need a CUDA GPU: move the tensors to 'cuda', or run on the CPU under "
            "Triton's interpreter with TRITON_INTERPRET=1 set before importing dtune"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors on {q.device.type!r} are not supported; use a CUDA GPU")


def _check_signature(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: Gate,
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> Shape:
    """Every check that depends on the arguments' types, shapes, dtypes and devices alone; the Shape they give."""
    _need_tensor("q", q, 4)
    _need_tensor("k", k, 4)
    _need_tensor("v", v, 4)
    _need_tensor("beta", beta, 3)
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape [B, T, H, K], got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T} as in q, got v {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if min(B, H, K, HV, V) < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, v {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"v has HV={HV} value heads, which is not a multiple of q/k's H={H} heads")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        _need_float(name, x)
    if gate is Gate.NONE:
        if g is not None:
            raise ValueError("g must be None for the ungated delta rule")
    else:
        want = (B, T, HV) if gate is Gate.SCALAR else (B, T, HV, K)
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"g must be a torch.Tensor of shape {list(want)} (log-space gate), got {type(g).__name__}")
        if tuple(g.shape) != want:
            kind = (
                "[B, T, HV] (one log decay per value head)"
                if gate is Gate.SCALAR
                else "[B, T, HV, K] (per key channel)"
            )
            raise ValueError(f"g must have shape {kind} = {want}, got {tuple(g.shape)}")
        _need_float("g", g)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 offsets, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs the sequences packed into B = 1, got B = {B}")
        N = cu_seqlens.numel() - 1

    if initial_state is not None:
        _need_tensor("initial_state", initial_state, 4)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, got {tuple(initial_state.shape)}"
            )
        _need_float("initial_state", initial_state)

    named: list[tuple[str, Tensor | None]] = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("beta", beta),
        ("g", g),
        ("initial_state", initial_state),
        ("cu_seqlens", cu_seqlens),
    ]
    for name, t in named:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all tensors must be on one device")
    _check_runnable(q)
    return Shape(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, gate=gate, varlen=cu_seqlens is not None)


# Names this module had before the layers, for code that still imports them from here (tests/kernels/test_chunk.py):
# the shape type is dtune.shape.Shape, the input builder dtune.measure.inputs.make_inputs.
Problem = Shape


def __getattr__(name: str) -> Any:
    if name == "make_inputs":
        from dtune.measure.inputs import make_inputs

        return make_inputs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
