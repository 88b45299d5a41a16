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


def check_gate_values(g: Tensor) -> None:
    """ValueError naming ``g`` when it holds NaN or a positive entry.

    The gate is the log of a decay in [0, 1]: ``g <= 0`` everywhere, ``-inf`` being a full forget (the state is
    cleared, exactly as the reference computes it). A positive entry grows the state without bound (a constant +5
    overflows to inf within a few dozen tokens) and NaN spreads through the whole state, so both are refused.
    Costs one reduction over ``g`` and one host sync; skipped while a CUDA graph is being captured (the check cannot
    read a value back there: validate before capture, or upstream, and pass ``check_gate=False``).
    """
    if g.numel() == 0 or capturing(g):
        return
    top = float(g.max())  # NaN when any entry is NaN (torch.max propagates NaN)
    hint = "; pass check_gate=False if you validate gates upstream"
    if math.isnan(top):
        raise ValueError(f"g contains NaN: the log-space gate must be a number <= 0 (-inf is a full forget){hint}")
    if top > 0:
        raise ValueError(
            f"g must be a log-space gate <= 0 (log of a decay in [0, 1]; -inf is a full forget), but its largest "
            f"entry is {top:g}: a positive gate grows the state without bound{hint}"
        )


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
    check_gate: bool = True,
) -> Shape:
    """Validate one call's arguments against the contract; return its :class:`~dtune.shape.Shape`.

    Shapes, dtypes, devices and ``cu_seqlens`` are always checked. With ``check_gate`` (the default) the gate's
    values are checked too (:func:`check_gate_values`: no NaN, no positive entry; ``-inf`` allowed), which reads
    ``g`` once and syncs with the device.
    """
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
    offs: tuple[int, ...] | None = None
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
        # Checking the offsets' values reads them on the host: skipped while a CUDA graph is being captured.
        if not capturing(cu_seqlens):
            offs = host_offsets(cu_seqlens)  # once per tensor: layers sharing cu_seqlens read it once
            if offs[0] != 0 or offs[-1] != T:
                raise ValueError(f"cu_seqlens must run from 0 to T = {T}, got {offs[0]} ... {offs[-1]}")
            if any(b < a for a, b in zip(offs[:-1], offs[1:])):
                raise ValueError("cu_seqlens must be non-decreasing")

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
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "dtune's Triton kernels need a CUDA GPU: move the tensors to 'cuda', or run on the CPU under "
            "Triton's interpreter with TRITON_INTERPRET=1 set before importing dtune"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors on {q.device.type!r} are not supported; use a CUDA GPU")
    if check_gate and g is not None:
        check_gate_values(g)
    offsets = offs
    return Shape(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, gate=gate, varlen=cu_seqlens is not None, seq_offsets=offsets)


# Names this module had before the layers, for code that still imports them from here (tests/kernels/test_chunk.py):
# the shape type is dtune.shape.Shape, the input builder dtune.measure.inputs.make_inputs.
Problem = Shape


def __getattr__(name: str) -> Any:
    if name == "make_inputs":
        from dtune.measure.inputs import make_inputs

        return make_inputs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
