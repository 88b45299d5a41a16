"""What the kernels compute for gate values outside the contract, unchecked (the default call reads no gate value).

* NaN in ``g`` gives NaN in every output and gradient the float64 recurrence gives NaN in (a NaN may also reach a
  few more entries of the same chunk), never a finite number there; everything it does not reach (the other batch
  row, the other value head, the other packed sequences) stays right. The chunk kernels clamp gates at load
  (``kernels/config.py`` GATE_FLOOR): Triton's default ``maximum`` returns the other operand for NaN, which would
  have read a NaN gate as a full forget and returned a finite wrong answer.
* a positive entry is computed as the recurrence says (the state grows by ``exp(g)``), checked at mild values, also
  where a KDA chunk is steep enough for the exact element-wise diagonal blocks (forward and backward).
* ``-inf`` is a full forget: tests/dtune/test_ops.py.

Tiny shapes under the interpreter: H = 1, HV = 2 (grouped value heads), K = V = 16, T = 37 (two chunks of 32, or
three of 16), an initial state, strong decays.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from dtune.kernels.chunk.common import GATE_FLOOR, floor_gate
from dtune.kernels.reference import naive_recurrent

from dtune import ops
from dtune.measure.grad import op_step, reference_step, with_output_grads
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

# numpy's "invalid value" / "All-NaN slice" warnings from inside the interpreter, on the NaN cases
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = 1e-4  # fp32 against float64
GATED = {"fused_recurrent_gated_delta_rule": Gate.SCALAR, "fused_recurrent_kda": Gate.CHANNEL}
GATED |= {"chunk_gated_delta_rule": Gate.SCALAR, "chunk_kda": Gate.CHANNEL}
CHUNK_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "BT16": {"BT": 16, "BC": 16},
    "rows": {"INTRA": "rows"},
    "seqpar": {"SEG_CHUNKS": 1},  # the sequence-parallel state pass (segments of one chunk)
    "unfused": {"FUSE_OUTPUT": False},
}
FWD_CASES = [("fused_recurrent_gated_delta_rule", {}), ("fused_recurrent_kda", {})]
FWD_CASES += [(op, cfg) for op in ("chunk_gated_delta_rule", "chunk_kda") for cfg in CHUNK_CONFIGS.values()]
FWD_CASES += [("chunk_kda", {"INTRA": "onepass"})]
FWD_IDS = [f"{op}-{'-'.join(f'{k}{v}' for k, v in cfg.items()) or 'default'}" for op, cfg in FWD_CASES]
SEQ_LENS = [5, 0, 19, 13]  # the NaN goes into the third sequence (tokens 5 .. 23)


def _inputs(gate: Gate, varlen: bool, gate_min: float = -5.0, seed: int = 3) -> dict[str, Any]:
    shape = Shape(1, 0, 1, 2, 16, 16, 4, gate, True) if varlen else Shape(2, 37, 1, 2, 16, 16, 2, gate)
    x = make_inputs(shape, seed=seed, gate_min=gate_min, seq_lens=SEQ_LENS if varlen else None)
    x["g"] = x["g"].clone()
    return x


def _plant_nan(x: dict[str, Any], varlen: bool) -> None:
    """One NaN at token 20 (fixed length, batch row 0) or 12 (varlen: inside the third sequence), value head 1; for
    KDA in one key channel only."""
    t = 12 if varlen else 20
    if x["g"].dim() == 4:
        x["g"][0, t, 1, 3] = math.nan
    else:
        x["g"][0, t, 1] = math.nan


def _unaffected(x: dict[str, Any], varlen: bool) -> tuple[Any, Any]:
    """Index of the outputs ``[B, T, HV, V]`` and of the states ``[N, ...]`` that the NaN cannot reach."""
    if varlen:
        tokens = torch.ones(sum(SEQ_LENS), dtype=torch.bool)
        tokens[5:24] = False
        return (0, tokens), torch.tensor([0, 1, 3])
    return (1,), (1,)


def _call(op: str, x: dict[str, Any], config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    fn = getattr(ops, op)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    if op.startswith("chunk"):
        kw["config"] = config
    o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert s is not None
    return o, s


def _reference(x: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    kw = {"initial_state": x["initial_state"], "cu_seqlens": x["cu_seqlens"]}
    o, s = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, **kw)
    assert s is not None
    return o, s


def assert_nan_where_the_recurrence_has_it(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` is NaN wherever ``want`` (float64) is; where ``got`` is finite it is right; never an inf."""
    want_nan = torch.isnan(want)
    assert want_nan.any(), f"{what}: the planted NaN reaches nothing (the test plants it wrong)"
    missing = want_nan & ~torch.isnan(got)
    assert not missing.any(), f"{what}: {int(missing.sum())} finite entries where the recurrence gives NaN"
    assert not torch.isinf(got).any(), f"{what}: inf"
    finite = ~torch.isnan(got)
    assert rel_err(got[finite], want[finite]) < TOL, f"{what}: finite entries off the reference"


@pytest.mark.parametrize(("op", "config"), FWD_CASES, ids=FWD_IDS)
def test_nan_gate_gives_nan_not_a_finite_answer(op: str, config: dict[str, Any]) -> None:
    x = _inputs(GATED[op], varlen=False)
    _plant_nan(x, varlen=False)
    o, s = _call(op, x, config)
    o_ref, s_ref = _reference(x)
    assert_nan_where_the_recurrence_has_it(o, o_ref, "output")
    assert_nan_where_the_recurrence_has_it(s, s_ref, "final state")
    for got, want in ((o[1], o_ref[1]), (o[0, :, 0], o_ref[0, :, 0]), (s[1], s_ref[1])):  # out of the NaN's reach
        assert torch.isfinite(got).all() and rel_err(got, want) < TOL


@pytest.mark.parametrize("op", list(GATED))
def test_nan_gate_in_one_packed_sequence(op: str) -> None:
    x = _inputs(GATED[op], varlen=True)
    _plant_nan(x, varlen=True)
    o, s = _call(op, x, {})
    o_ref, s_ref = _reference(x)
    assert_nan_where_the_recurrence_has_it(o, o_ref, "output")
    assert_nan_where_the_recurrence_has_it(s, s_ref, "final state")
    o_idx, s_idx = _unaffected(x, varlen=True)
    assert torch.isfinite(o[o_idx]).all() and rel_err(o[o_idx], o_ref[o_idx]) < TOL
    assert torch.isfinite(s[s_idx]).all() and rel_err(s[s_idx], s_ref[s_idx]) < TOL


BWD_CASES = [
    ("chunk_gated_delta_rule", {}),
    ("chunk_gated_delta_rule", {"SAVE": "none"}),
    ("chunk_kda", {}),
    ("chunk_kda", {"SAVE": "all", "FUSE_DV": False}),
]


def _step(op: str, x: dict[str, Any], bwd_config: dict[str, Any]) -> tuple[Any, Any]:
    x = with_output_grads({**x, "output_final_state": True})
    return op_step(op, x, bwd_config)(), reference_step(x, loop=True)


@pytest.mark.parametrize(("op", "bwd_config"), BWD_CASES, ids=[f"{op}-{c or 'default'}" for op, c in BWD_CASES])
def test_nan_gate_gives_nan_gradients(op: str, bwd_config: dict[str, Any]) -> None:
    x = _inputs(GATED[op], varlen=False)
    _plant_nan(x, varlen=False)
    got, want = _step(op, x, bwd_config)
    for name, ref in want.grads.items():
        if ref is None:
            continue
        grad = got.grads[name]
        assert grad is not None
        assert_nan_where_the_recurrence_has_it(grad, ref, f"d{name}")
        assert torch.isfinite(grad[1]).all() and rel_err(grad[1], ref[1]) < TOL, f"d{name} of the other batch row"


def _positive(x: dict[str, Any], steep: bool) -> None:
    """Mild positive gates (+0.1 at tokens 10..13); ``steep``: a KDA chunk steep enough for the exact element-wise
    diagonal blocks (12 nats of decay per step over tokens 0..7, then +0.2 per step over 8..15, all channels)."""
    if steep:
        x["g"][:, :8] = -12.0
        x["g"][:, 8:16] = 0.2
    else:
        x["g"][:, 10:14] = 0.1


POS_CASES = [(op, False) for op in GATED] + [("chunk_kda", True)]


@pytest.mark.parametrize(("op", "steep"), POS_CASES, ids=[f"{op}{'-steep' if s else ''}" for op, s in POS_CASES])
def test_positive_gate_is_computed_as_the_recurrence_says(op: str, steep: bool) -> None:
    x = _inputs(GATED[op], varlen=False, gate_min=-2.0)
    _positive(x, steep)
    o, s = _call(op, x, {"BT": 16, "BC": 16} if steep else {})
    o_ref, s_ref = _reference(x)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL, (rel_err(o, o_ref), rel_err(s, s_ref))
    if op.startswith("chunk"):
        got, want = _step(op, x, {"BT": 16, "BC": 16} if steep else {})
        for name, ref in want.grads.items():
            if ref is not None:
                assert rel_err(got.grads[name], ref) < TOL, f"d{name}: {rel_err(got.grads[name], ref):.3g}"


@triton.jit
def _floor_kernel(x, y, N: tl.constexpr, FLOOR: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, floor_gate(tl.load(x + o), FLOOR))


def test_floor_gate_keeps_nan() -> None:
    """The clamp every chunk kernel (forward and backward) applies to a loaded gate: -inf and below-floor values to
    the floor, NaN stays NaN (Triton's default maximum would return the floor for it), the rest unchanged."""
    x = torch.tensor([math.nan, -math.inf, -25.0, -20.0, -3.0, 0.0, 0.5, math.nan] + [-1.0] * 8)
    y = torch.empty_like(x)
    _floor_kernel[(1,)](x, y, 16, GATE_FLOOR)
    floor = GATE_FLOOR.value
    want = torch.tensor([math.nan, floor, floor, floor, -3.0, 0.0, 0.5, math.nan] + [-1.0] * 8)
    torch.testing.assert_close(y, want, equal_nan=True, rtol=0, atol=0)
