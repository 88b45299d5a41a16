"""The default call on a CUDA GPU: no host sync, and capturable in a CUDA graph (``pytest -m gpu``).

* Every op's forward (fixed length and packed with a ``cu_seqlens`` tensor seen once before, initial and final
  state) and the chunk ops' training step run under ``torch.cuda.set_sync_debug_mode("error")``: any
  synchronising CUDA call (``.item()``, ``.cpu()``, ``.tolist()``, a blocking copy either way, ``nonzero``, a stream
  or device synchronize) raises inside the op. The test proves itself: the opt-in gate check (``float(g.max())``,
  an ``.item()``) and a ``cu_seqlens`` tensor never seen (its one host read) must raise under the same mode.
* The launch cache (:mod:`dtune.kernels.launches`): a second call of the same signature replays the first call's
  launches with its own pointers; in check mode every replay is compared, launch by launch, with the compiled kernel
  Triton's own lookup picks and the arguments the launchers pass, and its outputs with the cache turned off.
* The default prefill (chunk ops, fixed length) and decode (fused-recurrent, T = 1, with state) calls are captured
  in a CUDA graph after a warm-up call, replayed on new inputs copied into the static buffers, and must equal an
  eager call on those inputs.

Shapes use the shipped tuned configs where they exist (bf16, K = V = 128; B = 1, T = 8192 picks a sequence-parallel
config, whose segment tables are uploaded): what a user's default call launches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from dtune.kernels import launches

import dtune.inputs
from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

OPS: dict[str, Gate] = {
    "fused_recurrent_delta_rule": Gate.NONE,
    "fused_recurrent_gated_delta_rule": Gate.SCALAR,
    "fused_recurrent_kda": Gate.CHANNEL,
    "chunk_delta_rule": Gate.NONE,
    "chunk_gated_delta_rule": Gate.SCALAR,
    "chunk_kda": Gate.CHANNEL,
}
CHUNK = [op for op in OPS if op.startswith("chunk")]
SEQ_LENS = [1, 700, 0, 333, 64]
SHAPES = {  # id -> (shape, packed sequence lengths)
    "B2-T1000-H4-HV8": (Shape(2, 1000, 4, 8, 128, 128, 2), None),
    "B1-T8192-H16": (Shape(1, 8192, 16, 16, 128, 128, 1), None),
    "varlen-H4-HV8": (Shape(1, 0, 4, 8, 128, 128, len(SEQ_LENS), varlen=True), SEQ_LENS),
}
SYNC = "synchroniz"  # torch: "called a synchronizing CUDA operation"


@pytest.fixture(autouse=True)
def gate_check_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default call, whatever DTUNE_CHECK_GATE says in this environment."""
    monkeypatch.setattr(dtune.inputs, "CHECK_GATE", False)


@contextmanager
def no_sync() -> Iterator[None]:
    """Any synchronising CUDA call inside raises RuntimeError."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _inputs(op: str, shape: Shape, seq_lens: list[int] | None, seed: int = 5) -> dict[str, Any]:
    p = Shape(shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V, shape.N, OPS[op], shape.varlen)
    return make_inputs(p, torch.bfloat16, "cuda", seed=seed, seq_lens=seq_lens, gate_min=-5.0)


def _call(op: str, x: dict[str, Any], **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    gates = () if x["g"] is None else (x["g"],)
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = getattr(ops, op)
    return fn(
        x["q"], x["k"], x["v"], *gates, x["beta"], initial_state=x["initial_state"], output_final_state=True,
        cu_seqlens=x["cu_seqlens"], **kw,
    )  # fmt: skip


@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("op", list(OPS))
def test_forward_makes_no_host_sync(op: str, shape_id: str) -> None:
    shape, seq_lens = SHAPES[shape_id]
    x = _inputs(op, shape, seq_lens)
    want, _ = _call(op, x)  # compiles, builds and caches the chunk tables, reads this cu_seqlens once
    with no_sync():
        o, s = _call(op, x)
    assert s is not None and torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, want) < 1e-6  # the same call as the warm-up


@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("op", CHUNK)
def test_training_step_makes_no_host_sync(op: str, shape_id: str) -> None:
    shape, seq_lens = SHAPES[shape_id]
    x = _inputs(op, shape, seq_lens)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if x[n] is not None]
    for n in names:
        x[n] = x[n].detach().requires_grad_()
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)

    def step() -> tuple[torch.Tensor, ...]:
        o, s = _call(op, x)
        assert s is not None
        return torch.autograd.grad((o, s), [x[n] for n in names], (do, torch.ones_like(s)))

    want = step()  # warm-up: compiles, caches the training config's tables
    with no_sync():
        got = step()
    for n, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), n
        assert rel_err(a, b) < 1e-6, n  # the same step twice (the backward's partial sums are deterministic)


@pytest.mark.parametrize("op", ["fused_recurrent_kda", "chunk_gated_delta_rule", "chunk_kda"])
def test_the_sync_test_catches_a_sync(op: str) -> None:
    """The opt-in gate check reads ``g`` (``float(g.max())``: an ``.item()``) and a ``cu_seqlens`` tensor never seen
    is read once: both are syncs, and the mode above must catch them (else the tests above prove nothing)."""
    shape, seq_lens = SHAPES["varlen-H4-HV8"]
    x = _inputs(op, shape, seq_lens)
    _call(op, x)  # warm-up
    with no_sync(), pytest.raises(RuntimeError, match=SYNC):
        _call(op, x, check_gate=True)
    fresh = x["cu_seqlens"].clone()  # the same offsets in a tensor dtune has not read
    with no_sync(), pytest.raises(RuntimeError, match=SYNC):
        _call(op, {**x, "cu_seqlens": fresh})
    _call(op, {**x, "cu_seqlens": fresh}, check_gate=True)  # outside the mode both run (valid gates)


@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("op", list(OPS))
def test_replayed_launches_match_tritons_own(op: str, shape_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, seq_lens = SHAPES[shape_id]
    launches.clear()
    monkeypatch.setattr(launches, "MODE", "check")
    first = _inputs(op, shape, seq_lens, seed=1)
    _call(op, first)  # recorded
    # new values, the same cu_seqlens tensor (a model's layers share one; a new one is read once, a host sync)
    x = {**_inputs(op, shape, seq_lens, seed=2), "cu_seqlens": first["cu_seqlens"]}
    with no_sync():
        o, s = _call(op, x)  # replayed, checked against Triton's lookup and the launchers' arguments
    cached = launches.cached()
    monkeypatch.setattr(launches, "MODE", "off")
    want_o, want_s = _call(op, x)
    assert s is not None and want_s is not None and torch.isfinite(o).all()
    assert rel_err(o, want_o) < 1e-6 and rel_err(s, want_s) < 1e-6
    if op.startswith("chunk"):
        assert cached == 1, "the chunk forward's call was not recorded"


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"])
def test_default_call_inside_torch_compile(op: str) -> None:
    """A layer compiled by torch.compile (Inductor) around the op: a graph break, the op eager, the result the eager
    layer's; its training step too (the chunk ops)."""
    shape = Shape(2, 1000, 4, 8, 128, 128, 2) if op.startswith("chunk") else Shape(32, 1, 4, 8, 128, 128, 32)
    x = _inputs(op, shape, None, seed=21)
    w = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) / 12

    def layer(q: torch.Tensor) -> torch.Tensor:
        o, s = _call(op, {**x, "q": torch.nn.functional.normalize(q @ w, dim=-1)})
        return (o.float() * 2).sum() + s.sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer)
    # (Inductor computes the layer's normalize in its own order around the op: 1.5e-3 and 2.4e-3 on an H100)
    assert rel_err(compiled(x["q"]), layer(x["q"])) < 1e-2
    if op.startswith("chunk"):
        q1, q2 = (x["q"].clone().requires_grad_() for _ in range(2))
        (want,) = torch.autograd.grad(layer(q1), q1)
        (got,) = torch.autograd.grad(compiled(q2), q2)
        assert rel_err(got, want) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_kda"])
def test_an_op_on_another_gpu_than_the_current(op: str) -> None:
    """Inputs on cuda:1 while cuda:0 is current (a model spread over GPUs): the result on cuda:1, equal to the call
    made with cuda:1 current."""
    shape = Shape(2, 1000, 4, 8, 128, 128, 2) if op.startswith("chunk") else Shape(32, 1, 4, 8, 128, 128, 32)
    x = {n: t.to("cuda:1") if isinstance(t, torch.Tensor) else t for n, t in _inputs(op, shape, None).items()}
    with torch.cuda.device(0):
        o, s = _call(op, x)
    with torch.cuda.device(1):
        want_o, want_s = _call(op, x)
    assert o.device == torch.device("cuda", 1) and s is not None and want_s is not None
    assert rel_err(o, want_o) < 1e-6 and rel_err(s, want_s) < 1e-6


def _capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm up on a side stream (compiles, fills the caches), then capture ``fn`` into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


GRAPH_CASES = {
    **{f"{op}-prefill-B2-T1000": (op, Shape(2, 1000, 4, 8, 128, 128, 2)) for op in CHUNK},
    **{f"{op}-prefill-B1-T8192": (op, Shape(1, 8192, 16, 16, 128, 128, 1)) for op in CHUNK},
    **{f"{op}-decode-B32": (op, Shape(32, 1, 16, 16, 128, 128, 32)) for op in OPS if op not in CHUNK},
}


@pytest.mark.parametrize(("op", "shape"), list(GRAPH_CASES.values()), ids=list(GRAPH_CASES))
def test_default_call_replays_in_a_cuda_graph(op: str, shape: Shape) -> None:
    static = _inputs(op, shape, None, seed=11)
    graph, (o, s) = _capture(lambda: _call(op, static))
    assert s is not None
    for seed in (12, 13):  # new inputs into the static buffers, then replay
        new = _inputs(op, shape, None, seed=seed)
        for n, t in new.items():
            if isinstance(t, torch.Tensor):
                static[n].copy_(t)
        graph.replay()
        want_o, want_s = _call(op, new)
        torch.cuda.synchronize()
        assert want_s is not None and torch.isfinite(o).all()
        assert rel_err(o, want_o) < 1e-6 and rel_err(s, want_s) < 1e-6, seed


def test_capture_refuses_what_a_replay_would_get_wrong() -> None:
    """A chunk op with cu_seqlens builds its tables on the host from cu_seqlens' values, which a replay could change;
    a chunk table not built before capture would be filled only by a replay: both are refused with a clear error
    (before anything is launched, so the capture itself stays valid)."""
    shape, seq_lens = SHAPES["varlen-H4-HV8"]
    x = _inputs("chunk_kda", shape, seq_lens)
    _call("chunk_kda", x)  # warm-up: seen, tables cached; still refused
    refused = pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph with cu_seqlens")
    with refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        _call("chunk_kda", x)
    y = _inputs("chunk_gated_delta_rule", Shape(3, 777, 2, 2, 128, 128, 3), None)  # a shape no call has used
    with (
        pytest.raises(RuntimeError, match="run the call once before capturing"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        _call("chunk_gated_delta_rule", y, config={"SEG_CHUNKS": 2})
