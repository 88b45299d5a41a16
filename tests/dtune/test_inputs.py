"""Validation before any launch: every bad argument gets an error that names it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import dtune.inputs
from dtune import ops
from dtune.inputs import dtype_from_name
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape


def _inputs(gate: Gate = Gate.CHANNEL, **over: Any) -> dict[str, Any]:
    x = make_inputs(Shape(2, 5, 2, 4, 16, 8, 2, gate), seed=0)
    x.update(over)
    return x


def _call(x: dict[str, Any], kernel: str = "fused_recurrent_kda", **kw: Any) -> Any:
    return ops.run_kernel(
        kernel,
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"],
        **kw,
    )


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


BAD: list[tuple[str, Callable[[], dict[str, Any]], type[Exception], str]] = [
    ("q-k-shape", lambda: _inputs(k=_t(2, 5, 2, 8)), ValueError, "q and k"),
    ("q-not-tensor", lambda: _inputs(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    ("q-3d", lambda: _inputs(q=_t(2, 5, 16)), ValueError, "q must have 4 dimensions"),
    ("v-batch", lambda: _inputs(v=_t(3, 5, 4, 8)), ValueError, "v must be [B, T, HV, V]"),
    ("hv-not-multiple", lambda: _inputs(v=_t(2, 5, 3, 8), beta=_t(2, 5, 3)), ValueError, "not a multiple"),
    ("beta-shape", lambda: _inputs(beta=_t(2, 5, 2)), ValueError, "beta must have shape"),
    ("g-shape-kda", lambda: _inputs(g=_t(2, 5, 4)), ValueError, "g must have shape [B, T, HV, K]"),
    ("g-missing", lambda: _inputs(g=None), TypeError, "g must be a torch.Tensor"),
    ("int-dtype", lambda: _inputs(v=torch.ones(2, 5, 4, 8, dtype=torch.int32)), TypeError, "v must be float32"),
    ("g-int", lambda: _inputs(g=torch.ones(2, 5, 4, 16, dtype=torch.int64)), TypeError, "g must be float32"),
    ("beta-int", lambda: _inputs(beta=torch.ones(2, 5, 4, dtype=torch.int32)), TypeError, "beta must be float32"),
    ("beta-bool", lambda: _inputs(beta=torch.ones(2, 5, 4, dtype=torch.bool)), TypeError, "beta must be float32"),
    ("q-float64", lambda: _inputs(q=_t(2, 5, 2, 16, dtype=torch.float64)), TypeError, "q must be float32"),
    ("h0-shape", lambda: _inputs(initial_state=_t(2, 4, 16, 9)), ValueError, "initial_state must have shape"),
    ("h0-int", lambda: _inputs(initial_state=torch.ones(2, 4, 16, 8, dtype=torch.int32)), TypeError, "initial_state"),
    ("cu-batch", lambda: _inputs(cu_seqlens=torch.tensor([0, 5])), ValueError, "B = 1"),
    ("cu-float", lambda: _inputs(cu_seqlens=torch.tensor([0.0, 5.0])), TypeError, "cu_seqlens must be int32"),
    ("cu-2d", lambda: _inputs(cu_seqlens=torch.tensor([[0, 5]])), ValueError, "cu_seqlens must be 1-D"),
]


@pytest.mark.parametrize(("make", "exc", "msg"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(make: Callable[[], dict[str, Any]], exc: type[Exception], msg: str) -> None:
    """Also after a good call of the same shapes: the cache of checked argument signatures hides no bad argument."""
    dtune.inputs._SIGNATURES.clear()
    with pytest.raises(exc, match=_escape(msg)):
        _call(make())
    good = _inputs()
    dtune.inputs.check_inputs(*_check_args(good))  # the good signature, checked and remembered
    with pytest.raises(exc, match=_escape(msg)):
        _call(make())


def _check_args(x: dict[str, Any]) -> tuple[Any, ...]:
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], Gate.CHANNEL, None, x["initial_state"], x["cu_seqlens"])


def test_checked_signatures_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature that passed costs one lookup on its next call; a change of any dtype, shape or device is checked
    again; the cache is bounded."""
    dtune.inputs._SIGNATURES.clear()
    x = _inputs()
    first = dtune.inputs.check_inputs(*_check_args(x))
    calls: list[int] = []
    real = dtune.inputs._check_signature
    monkeypatch.setattr(dtune.inputs, "_check_signature", lambda *a: calls.append(1) or real(*a))
    assert dtune.inputs.check_inputs(*_check_args(_inputs())) == first and calls == []  # new tensors, same signature
    with pytest.raises(TypeError, match="beta must be float32"):
        dtune.inputs.check_inputs(*_check_args(_inputs(beta=x["beta"].to(torch.int32))))
    assert calls == [1]
    monkeypatch.setattr(dtune.inputs, "SIGNATURE_CACHE_SIZE", 2)
    for t in (3, 4, 5):
        y = make_inputs(Shape(1, t, 2, 4, 16, 8, 1, Gate.CHANNEL), seed=0)
        dtune.inputs.check_inputs(*_check_args(y))
    assert len(dtune.inputs._SIGNATURES) <= 2


def test_bad_cu_seqlens_is_refused_on_every_call() -> None:
    """Offsets that failed are never remembered as checked; good ones are checked once per tensor."""
    x = _packed([0, 4, 2, 6])
    for _ in range(2):
        with pytest.raises(ValueError, match="non-decreasing"):
            _call(x, kernel="fused_recurrent_gated_delta_rule")
    y = _packed([0, 2, 3, 6])
    _call(y, kernel="fused_recurrent_gated_delta_rule")
    y["cu_seqlens"][3] = 5  # in place: read again, checked again
    with pytest.raises(ValueError, match="from 0 to T = 6"):
        _call(y, kernel="fused_recurrent_gated_delta_rule")


def _escape(s: str) -> str:
    import re

    return re.escape(s)


def _packed(offsets: list[int], n_h0: int | None = None) -> dict[str, Any]:
    x = make_inputs(Shape(1, 6, 1, 1, 16, 8, 1, Gate.SCALAR), seed=1)
    x["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    x["initial_state"] = None if n_h0 is None else _t(n_h0, 1, 16, 8)
    return x


@pytest.mark.parametrize(
    ("offsets", "msg"),
    [([1, 6], "from 0 to T = 6"), ([0, 4], "from 0 to T = 6"), ([0, 4, 2, 6], "non-decreasing"), ([0], "at least 2")],
    ids=["not-from-0", "not-to-T", "decreasing", "single"],
)
def test_bad_cu_seqlens(offsets: list[int], msg: str) -> None:
    with pytest.raises(ValueError, match=_escape(msg)):
        _call(_packed(offsets), kernel="fused_recurrent_gated_delta_rule")


def test_varlen_initial_state_needs_one_per_sequence() -> None:
    with pytest.raises(ValueError, match=_escape("[N, HV, K, V] = (3, 1, 16, 8)")):
        _call(_packed([0, 2, 3, 6], n_h0=1), kernel="fused_recurrent_gated_delta_rule")


def test_gate_given_to_ungated_kernel() -> None:
    with pytest.raises(ValueError, match="g must be None"):
        _call(_inputs(Gate.CHANNEL), kernel="fused_recurrent_delta_rule")


def test_scalar_gate_shape() -> None:
    with pytest.raises(ValueError, match=_escape("[B, T, HV] (one log decay per value head)")):
        _call(_inputs(Gate.CHANNEL), kernel="fused_recurrent_gated_delta_rule")


def test_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'fused_kda'; known kernels: fused_recurrent_delta_rule"):
        _call(_inputs(), kernel="fused_kda")


@pytest.mark.parametrize(
    ("config", "exc", "msg"),
    [
        ({"BX": 16}, ValueError, "unknown parameter(s) ['BX']"),
        ({"BV": 24}, ValueError, "BV=24 is not one of"),
        ({"num_warps": True}, ValueError, "num_warps=True"),
        ([("BV", 16)], TypeError, "must be a dict"),
    ],
    ids=["unknown-key", "bad-value", "bool-for-int", "not-a-dict"],
)
def test_bad_config(config: Any, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=_escape(msg)):
        _call(_inputs(), config=config)


def test_different_devices() -> None:
    x = _inputs()
    x["beta"] = x["beta"].to("meta")
    with pytest.raises(ValueError, match="beta is on meta but q is on cpu"):
        _call(x)


def test_cpu_without_interpreter_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"need a CUDA GPU.*TRITON_INTERPRET=1"):
        _call(_inputs())


def test_scale_must_be_a_number() -> None:
    with pytest.raises(TypeError, match="scale must be a float"):
        _call(_inputs(), scale="0.5")


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_scale_must_be_finite_on_every_call(scale: float) -> None:
    x = _inputs()
    _call(x, scale=0.5)  # the signature (a float scale) passed and is remembered: the value is still checked
    with pytest.raises(ValueError, match="scale must be a finite number"):
        _call(x, scale=scale)


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float16)]
)
def test_dtype_names(name: str, dtype: torch.dtype) -> None:
    assert dtype_from_name(name) == dtype
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtype_from_name("fp8")


def test_cu_seqlens_read_once_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of a model share one cu_seqlens: one host read (and sync) per tensor, not per call; an in-place
    write is seen (a stale cache would accept offsets the tensor no longer holds)."""
    from dtune.kernels.chunk import tables

    reads: list[int] = []
    real = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> Any:
        reads.append(self.numel())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    x = _packed([0, 2, 3, 6])
    for _ in range(3):
        assert tables.host_offsets(x["cu_seqlens"]) == (0, 2, 3, 6)
    assert reads == [4]
    other = torch.tensor([0, 2, 3, 6], dtype=torch.int32)  # equal values, another tensor: read on its own
    assert tables.host_offsets(other) == (0, 2, 3, 6) and reads == [4, 4]
    x["cu_seqlens"][1] = 5  # in place: the version moves, the tensor is read again
    assert tables.host_offsets(x["cu_seqlens"]) == (0, 5, 3, 6) and reads == [4, 4, 4]
    with pytest.raises(ValueError, match="non-decreasing"):
        _call(x, kernel="fused_recurrent_gated_delta_rule")


def test_cu_seqlens_cache_is_bounded() -> None:
    from dtune.kernels.chunk import tables

    tensors = [torch.tensor([0, i + 1], dtype=torch.int32) for i in range(3 * tables.OFFSETS_CACHE_SIZE)]
    for t in tensors:
        tables.host_offsets(t)
    assert len(tables._OFFSETS_CACHE) == tables.OFFSETS_CACHE_SIZE
    assert tables._OFFSETS_CACHE[-1][0] is tensors[-1]
