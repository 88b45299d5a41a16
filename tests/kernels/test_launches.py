"""The launch cache (dtune.kernels.launches): a call's launches recorded once and replayed with a new call's pointers.

Off the GPU nothing is replayed (the cache needs CUDA tensors and Triton's compiled kernels), so these tests stand in
a fake for Triton's launch (:func:`launches._launch_one`: a compiled kernel per kernel and constants that records what
it is launched with; the interpreter's kernels intercepted as ``JITFunction`` is on a GPU) and check the records:
every pointer where the new call's tensors put it, the constants and grids as recorded, a signature that cannot be
recorded safely never replayed, and the check mode (what the GPU tests run under) catching a launch that a key left
out. The chunk forward's own key and tensors are checked the same way, over its variants (TMA descriptors,
sequence-parallel segments, varlen tables, KDA's two-pass diagonal, the in-kernel options). The GPU run of the same
checks: tests/kernels/test_hot_path_gpu.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from dtune.kernels import launches
from dtune.kernels.chunk import pipeline
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from dtune import ops
from dtune.inputs import Gate, Problem, make_inputs
from dtune.options import Options

Tensor = torch.Tensor
TRITON_KERNEL_CLASSES = launches._kernel_classes  # (the fixture swaps it for the fakes')


class FakeCompiled:
    """What Triton's compiled kernel offers a replay: ``run`` (recorded), ``function``, ``packed_metadata``."""

    function = "function"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple[tuple[int, int, int], int, tuple[Any, ...]]] = []

    def run(self, g0: int, g1: int, g2: int, stream: int, *rest: Any) -> None:
        assert rest[:5] == ("function", "metadata", None, None, None)  # no launch metadata, no hooks
        self.runs.append(((g0, g1, g2), stream, rest[5:]))


def _constants(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, Tensor) and not hasattr(v, "block_shape"))
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """Triton's launch faked (one compiled kernel per kernel and constant keywords; the Triton-path launches listed),
    the cache in force on CPU tensors."""
    compiled: dict[Any, FakeCompiled] = {}
    triton_path: list[tuple[Any, Any, tuple[Any, ...], dict[str, Any]]] = []

    def one(run: Any, kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dry: bool) -> Any:
        c = compiled.setdefault((id(kernel), _constants(kwargs)), FakeCompiled())
        if not dry:
            triton_path.append((kernel, grid, args, kwargs))
        return c

    monkeypatch.setattr(launches, "_launch_one", one)
    # (the chunk kernels under the interpreter: their run() intercepted like JITFunction's on a GPU)
    monkeypatch.setattr(launches, "_kernel_classes", lambda: [ToyKernel, InterpretedFunction])
    monkeypatch.setattr(launches, "_replayable", lambda tensors: True)
    monkeypatch.setattr(launches, "active", lambda t: True)
    monkeypatch.setattr(launches, "_device_stream", lambda: 7)
    monkeypatch.setattr(launches, "MODE", "on")
    launches.clear()
    yield SimpleNamespace(compiled=compiled, triton=triton_path)
    launches.clear()


def toy(x: Any, y: Any, n: Any, scale: Any, BLOCK: Any = 16, desc: Any = None, tail: Any = None) -> None:
    """A kernel's parameters (the fake kernel's ``fn``)."""


class ToyKernel:
    """A kernel as Triton's: ``kernel[grid](...)`` calls ``run`` (outside a recording: Triton's path, faked)."""

    fn = staticmethod(toy)
    pre_run_hooks: ClassVar[list[Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return launches._launch_one(ToyKernel.run, self, grid, args, kwargs, warmup)


KERNEL = ToyKernel()


def toy_call(x: Tensor, y: Tensor, n: int = 5, key: tuple[Any, ...] = ("toy",), temp: bool = False) -> None:
    """A call with one launch: x, a view of y one row in, constants, a descriptor on y; ``temp``: a pointer into a
    tensor the call does not list."""

    def launch_all() -> None:
        tail = torch.empty(4) if temp else None
        desc = TensorDescriptor(y, [4, 8], [8, 1], [2, 8])
        KERNEL[(4, 2)](x, y[1:], n, 0.5, BLOCK=32, desc=desc, tail=tail, num_warps=4)

    launches.run(key, [x, None, y], launch_all)


def test_replay_puts_the_new_calls_pointers_where_the_launchers_would(fake: SimpleNamespace) -> None:
    x, y = torch.randn(16), torch.randn(4, 8)
    toy_call(x, y)
    assert len(fake.triton) == 1 and launches.cached() == 1
    x2, y2 = torch.randn(16), torch.randn(4, 8)
    toy_call(x2, y2)
    assert len(fake.triton) == 1, "the second call of the signature went through Triton's path"
    (compiled,) = fake.compiled.values()
    grid, stream, args = compiled.runs[-1]
    assert grid == (4, 2, 1) and stream == 7
    assert args[0] == x2.data_ptr() and args[1] == y2.data_ptr() + 8 * 4  # y[1:]: one row of 8 floats in
    assert args[2:5] == (5, 0.5, 32) and args[6] is None
    desc = args[5]
    assert desc.base.data_ptr() == y2.data_ptr() and list(desc.shape) == [4, 8] and list(desc.strides) == [8, 1]
    assert list(desc.block_shape) == [2, 8] and desc.padding == "zero"


def test_pointer_outside_the_calls_tensors_is_never_replayed(fake: SimpleNamespace) -> None:
    for _ in range(3):
        toy_call(torch.randn(16), torch.randn(4, 8), temp=True)
    assert len(fake.triton) == 3 and launches.cached() == 0
    assert launches.summary() == "0 replayable, uncacheable: 1 x a pointer into none of the call's tensors"
    toy_call(torch.randn(16), torch.randn(4, 8), key=("toy", "kept"))
    assert launches.summary().startswith("1 replayable, uncacheable: 1 x")


def test_a_gluon_descriptor_keeps_tritons_path(fake: SimpleNamespace) -> None:
    """Gluon's TensorDescriptor (a shared-memory layout with it, kernels/chunk/state_ws.py) is not replayed."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    def call(x: Tensor, y: Tensor) -> None:
        layout = gl.NVMMASharedLayout.get_default_for([2, 8], gl.float32)
        desc = GluonDescriptor(y, [4, 8], [8, 1], [2, 8], layout)
        launches.run(("gluon",), [x, y], lambda: KERNEL[(4, 2)](x, y, 5, 0.5, BLOCK=32, desc=desc, tail=None))

    for _ in range(2):
        call(torch.randn(16), torch.randn(4, 8))
    assert len(fake.triton) == 2 and launches.cached() == 0
    assert "Gluon tensor descriptor" in launches.summary()


def test_check_mode_catches_what_a_key_left_out(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    toy_call(torch.randn(16), torch.randn(4, 8), n=5)
    monkeypatch.setattr(launches, "MODE", "check")
    toy_call(torch.randn(16), torch.randn(4, 8), n=5)  # the same launch: passes
    with pytest.raises(RuntimeError, match=r"differs in arguments \[2\]"):
        toy_call(torch.randn(16), torch.randn(4, 8), n=6)  # n is not in the key


def test_different_keys_record_apart_and_the_oldest_goes(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launches, "CACHE_SIZE", 2)
    for n in (1, 2, 3):
        toy_call(torch.randn(16), torch.randn(4, 8), n=n, key=("toy", n))
    assert launches.cached() == 2 and len(fake.triton) == 3
    toy_call(torch.randn(16), torch.randn(4, 8), n=1, key=("toy", 1))  # dropped: recorded again
    assert len(fake.triton) == 4
    toy_call(torch.randn(16), torch.randn(4, 8), n=3, key=("toy", 3))  # kept: replayed
    assert len(fake.triton) == 4


def test_off_and_unhashable_keys_take_tritons_path(fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launches, "MODE", "off")
    monkeypatch.setattr(launches, "_replayable", lambda tensors: launches.mode() != "off")
    for _ in range(2):
        toy_call(torch.randn(16), torch.randn(4, 8))
    assert len(fake.triton) == 2 and launches.cached() == 0
    monkeypatch.setattr(launches, "MODE", "on")
    for _ in range(2):
        toy_call(torch.randn(16), torch.randn(4, 8), key=("toy", [1]))  # a list in the key: no caching
    assert len(fake.triton) == 4 and launches.cached() == 0


def test_replayed_only_where_tritons_launch_path_is_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real conditions: CUDA tensors, no interpreter, ``JITFunction.run`` unpatched, no launch hooks, turned on."""
    from triton import knobs

    from dtune.measure.resources import capture_launches

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    t = [torch.empty(1)]
    assert launches.parse_mode(None) == "on" and launches.parse_mode("") == "on", "off by default"
    values = ("0", "off", "False", "no", "1", "on", "check", "junk")
    assert [launches.parse_mode(v) for v in values] == ["off"] * 4 + ["on", "on", "check", "on"]
    monkeypatch.setattr(launches, "MODE", "off")
    assert not launches._replayable(t) and not launches.active(t[0])
    monkeypatch.setattr(launches, "MODE", "on")
    assert launches._replayable(t) and launches.active(t[0])
    assert not launches._replayable([None])
    with capture_launches():
        assert not launches._replayable(t)
    hook = knobs.runtime.launch_exit_hook
    hook.add(print)  # a profiler's hook in Triton's chain
    try:
        assert not launches._replayable(t)
    finally:
        hook.remove(print)
    assert launches._replayable(t)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a hook set as a plain function
    assert not launches._replayable(t)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert launches._replayable(t)
    assert launches.set_mode("off") == "on"
    assert not launches._replayable(t)
    launches.set_mode("1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launches._replayable(t)


# The chunk forward: its signature and tensors, over the template's variants (every launch of the second call of a
# signature checked against what the launchers would pass).
SMALL = {"BT": 32, "BC": 16}
VARIANTS: dict[str, tuple[Gate, dict[str, Any], dict[str, Any]]] = {
    "gdn": (Gate.SCALAR, {}, {}),
    "gdn-unfused": (Gate.SCALAR, {"FUSE_OUTPUT": False}, {}),
    "gdn-tma": (Gate.SCALAR, {"STATE_TMA": True, "STATES_TMA": True, "FUSE_OUTPUT": False}, {}),
    "gdn-segments": (Gate.SCALAR, {"SEG_CHUNKS": 2}, {}),
    "gdn-varlen-segments": (Gate.SCALAR, {"SEG_CHUNKS": 2}, {"varlen": True}),
    "dn-recomputed": (Gate.NONE, {"WU": "recomputed", "AQK": "recomputed", "INTRA": "blocks"}, {}),
    "kda-two-pass": (Gate.CHANNEL, {"SAFE_DIAG": True}, {}),
    "kda-rows": (Gate.CHANNEL, {"INTRA": "rows"}, {}),
    "gdn-options": (Gate.SCALAR, {}, {"options": True}),
}


def _forward(gate: Gate, config: dict[str, Any], how: dict[str, Any], seed: int, scale: float | None = None) -> None:
    varlen = how.get("varlen", False)
    p = Problem(B=1 if varlen else 2, T=150, H=2, HV=4, K=32, V=16, gate=gate)
    x = make_inputs(p, torch.float32, "cpu", seed=seed, seq_lens=[40, 110] if varlen else None)
    g = x["g"]
    kw: dict[str, Any] = {}
    if how.get("options"):
        A_log, dt_bias = torch.rand(p.HV), torch.rand(p.HV)
        kw["options"] = Options(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    args = (x["q"], x["k"], x["v"]) + (() if gate is Gate.NONE else (g,)) + (x["beta"],)
    op = getattr(ops, {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule"}.get(gate, "chunk_kda"))
    op(*args, scale=scale, initial_state=x["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"],
       config={**SMALL, **config}, **kw)  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunk_forward_replays_what_its_launchers_pass(
    variant: str, fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, config, how = VARIANTS[variant]
    _forward(gate, config, how, seed=0)
    made = len(fake.triton)
    assert made >= 2 and launches.cached() == 1
    monkeypatch.setattr(launches, "MODE", "check")
    _forward(gate, config, how, seed=1)  # new tensors, same signature: replayed and checked launch by launch
    assert len(fake.triton) == made
    assert sum(len(c.runs) for c in fake.compiled.values()) == made
    _forward(gate, config, how, seed=2, scale=0.3)  # another scale: another signature
    assert len(fake.triton) == 2 * made and launches.cached() == 2


def test_chunk_signature_names_what_the_launchers_read() -> None:
    """Calls that differ only in a pointer share a signature; in alignment, scale, config or tables they do not."""
    p = Problem(B=2, T=64, H=2, HV=2, K=32, V=16, gate=Gate.SCALAR)
    x = make_inputs(p, torch.float32, "cpu", seed=0)
    cfg = KERNEL_CONFIG()

    def sig(q: Tensor, scale: float = 0.1, config: dict[str, Any] = cfg, offsets: Any = None) -> Any:
        from dtune.kernels.chunk.call import prepare_call

        cu = None if offsets is None else torch.tensor(offsets)
        call = prepare_call(q, x["k"], x["v"], x["g"], x["beta"], "scalar", scale, None, True, cu, config, offsets)
        return pipeline.signature(call)

    q = x["q"]
    assert sig(q) == sig(q.clone())
    base = torch.empty(q.numel() + 1)
    assert sig(base[1:].view_as(q).copy_(q)) != sig(q)  # 4 bytes off 16-byte alignment
    assert sig(q, scale=0.2) != sig(q)
    assert sig(q, config={**cfg, "h_num_warps": 2}) != sig(q)
    assert sig(q, offsets=[0, 60, 128]) != sig(q, offsets=[0, 64, 128])


def KERNEL_CONFIG() -> dict[str, Any]:
    from dtune.kernels import KERNELS

    return KERNELS["chunk_gated_delta_rule"].check_config(32, 16, dict(SMALL))


@pytest.mark.parametrize("how", ["plain", "varlen", "options"])
@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_fused_recurrent_replays_what_its_launcher_passes(
    gate: Gate, how: str, fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = Problem(B=1 if how == "varlen" else 3, T=1 if how != "varlen" else 9, H=2, HV=4, K=32, V=16, gate=gate)
    op = getattr(ops, {Gate.NONE: "fused_recurrent_delta_rule", Gate.SCALAR: "fused_recurrent_gated_delta_rule"}.get(
        gate, "fused_recurrent_kda"))  # fmt: skip
    kw: dict[str, Any] = {}
    if how == "options":
        opts: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
        if gate is not Gate.NONE:
            bias = torch.rand(p.HV * (p.K if gate is Gate.CHANNEL else 1))
            opts |= {"use_gate_in_kernel": True, "A_log": torch.rand(p.HV), "dt_bias": bias}
        kw["options"] = Options(**opts)

    def call(seed: int, scale: float | None = None) -> None:
        x = make_inputs(p, torch.float32, "cpu", seed=seed, seq_lens=[4, 5] if how == "varlen" else None)
        gates = () if gate is Gate.NONE else (x["g"],)
        op(x["q"], x["k"], x["v"], *gates, x["beta"], scale=scale, initial_state=x["initial_state"],
           output_final_state=True, cu_seqlens=x["cu_seqlens"], **kw)  # fmt: skip

    call(0)
    assert len(fake.triton) == 1 and launches.cached() == 1
    monkeypatch.setattr(launches, "MODE", "check")
    call(1)
    assert len(fake.triton) == 1 and sum(len(c.runs) for c in fake.compiled.values()) == 1
    call(2, scale=0.3)  # another scale: another signature (a replay would pass the old one)
    assert len(fake.triton) == 2 and launches.cached() == 2


def test_a_recording_leaves_the_kernels_run_as_it_found_it(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launchers call Triton's own ``kernel[grid](...)``: a recording swaps ``run`` only while it lasts, also when
    the call fails; Triton's ``JITFunction.run`` after one is Triton's."""
    from triton.runtime.jit import JITFunction

    before = {cls: cls.__dict__["run"] for cls in (ToyKernel, InterpretedFunction, JITFunction)}
    toy_call(torch.randn(16), torch.randn(4, 8))
    with pytest.raises(ZeroDivisionError):
        launches.run(("fails",), [torch.randn(2)], lambda: 1 / 0)
    monkeypatch.setattr(launches, "_kernel_classes", TRITON_KERNEL_CLASSES)  # the real list: JITFunction
    with launches._intercepted():
        assert JITFunction.__dict__["run"] is not before[JITFunction]
    assert {cls: cls.__dict__["run"] for cls in before} == before
    assert launches._LOCAL.recording is None


def test_a_call_inside_a_recording_is_part_of_it(fake: SimpleNamespace) -> None:
    """A cached call made by another's launchers is recorded as the outer call's launches (no second recording, no
    deadlock); its buffers are not the outer call's tensors, so the outer signature keeps Triton's path (where the
    inner call, outside any recording, records its own)."""
    x, y = torch.randn(16), torch.randn(4, 8)

    def outer() -> None:
        toy_call(torch.randn(16), torch.randn(4, 8), key=("inner",))

    def twice() -> None:
        launches.run(("outer",), [x, y], outer)
        assert launches._PLANS == {("outer",): None} and len(fake.triton) == 1
        launches.run(("outer",), [x, y], outer)

    worker = threading.Thread(target=twice, daemon=True)  # (a nested recording would deadlock: fail, not hang)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a call inside a recording deadlocked"
    assert launches._PLANS[("outer",)] is None and launches.cached() == 1 and len(fake.triton) == 2
