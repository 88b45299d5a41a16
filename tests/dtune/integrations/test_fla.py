"""dtune as a backend of fla's dispatch, on the CPU (Triton's interpreter, float32, tiny shapes).

Registration and the switch; each verifier's decisions with their reasons (a table); the speed rule against the
side-by-side times of a tuned-config file and against another backend; that a declined call reaches fla's own
function (spied: fla's Triton kernels need a GPU) and an accepted one does not; and that fla's public ops, routed to
dtune, agree with the float64 reference of the call with its options, forward and every gradient.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Iterator
from inspect import unwrap
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import fla.backends as fb
import pytest
import torch
from dtune.kernels.reference import reference_with_options
from fla.ops.delta_rule import chunk as fla_dn_chunk
from fla.ops.gated_delta_rule import chunk as fla_gdn_chunk
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.kda import chunk as fla_kda_chunk
from fla.ops.kda import chunk_kda, fused_recurrent_kda
from fla.ops.kda import fused_recurrent as fla_kda_recurrent

import dtune.store
from tests.conftest import rel_err

Args = tuple[tuple[Any, ...], dict[str, Any]]
B, T, H, HV, K, V = 1, 20, 1, 2, 16, 32


def _t(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


def gdn(**kw: Any) -> Args:
    """A chunk_gated_delta_rule call: HV = 2H, K != V, strong decays."""
    torch.manual_seed(0)
    args = (_t(B, T, H, K), _t(B, T, H, K), _t(B, T, HV, V), -torch.rand(B, T, HV) * 5, torch.rand(B, T, HV))
    return args, kw


def kda(**kw: Any) -> Args:
    torch.manual_seed(0)
    args = (_t(B, T, H, K), _t(B, T, H, K), _t(B, T, HV, V), -torch.rand(B, T, HV, K) * 5, torch.rand(B, T, HV))
    return args, kw


def recurrent(**kw: Any) -> Args:
    """A fused_recurrent_kda_fwd call as fla's fused_recurrent_kda makes it (one decode step, keywords)."""
    torch.manual_seed(0)
    x = {
        "q": _t(2, 1, H, K),
        "k": _t(2, 1, H, K),
        "v": _t(2, 1, HV, V),
        "g": -torch.rand(2, 1, HV, K),
        "beta": torch.rand(2, 1, HV),
        "initial_state": _t(2, HV, K, V),
        "inplace_final_state": False,
    }
    return (), {**x, **kw}


def delta(**kw: Any) -> Args:
    torch.manual_seed(0)
    return (_t(B, T, H, K), _t(B, T, H, K), _t(B, T, HV, V), torch.rand(B, T, HV)), kw


def with_args(make: Callable[..., Args], index: int, value: Any, **kw: Any) -> Args:
    args, kwargs = make(**kw)
    return (*args[:index], value, *args[index + 1 :]), kwargs


GATE_KW = {"use_gate_in_kernel": True, "A_log": torch.randn(HV), "dt_bias": torch.randn(HV)}
GDN_LAYER = {  # what fla's GatedDeltaNet layer passes
    "use_qk_l2norm_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "allow_neg_eigval": True,
    "state_v_first": True,
    **GATE_KW,
}
KDA_LAYER = {**GDN_LAYER, "dt_bias": torch.randn(HV * K), "safe_gate": True, "lower_bound": -5.0}
RECURRENT_LAYER = {n: value for n, value in KDA_LAYER.items() if n != "safe_gate"}  # fla's decode has none
CU = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
CU_CPU = CU.to(torch.int64)

# (id, entry point, call, None if dtune takes it, else a fragment of the reason)
VERIFIER_CASES: list[tuple[str, str, Args, str | None]] = [
    ("gdn-plain", "chunk_gated_delta_rule", gdn(), None),
    ("gdn-layer-options", "chunk_gated_delta_rule", gdn(**GDN_LAYER, initial_state=_t(1, HV, V, K)), None),
    ("gdn-varlen-int32-cpu-copy", "chunk_gated_delta_rule", gdn(cu_seqlens=CU, cu_seqlens_cpu=CU_CPU), None),
    ("gdn-fla-chunking", "chunk_gated_delta_rule", gdn(chunk_size=32, chunk_indices=torch.zeros(1, 2)), None),
    ("kda-layer-options", "chunk_kda", kda(**KDA_LAYER, initial_state=_t(1, HV, V, K)), None),
    ("kda-memory-knob", "chunk_kda", kda(disable_recompute=True, max_num_seqs=4), None),
    ("kda-bound-without-gate", "chunk_kda", kda(lower_bound=-5.0, A_log=torch.randn(HV)), None),  # fla ignores them
    (
        "recurrent-layer-options",
        "fused_recurrent_kda_fwd",
        recurrent(**{**RECURRENT_LAYER, "initial_state": _t(2, HV, V, K)}),
        None,
    ),
    ("recurrent-inplace", "fused_recurrent_kda_fwd", recurrent(inplace_final_state=True), None),
    ("delta-l2norm", "chunk_delta_rule", delta(use_qk_l2norm_in_kernel=True), None),
    (
        "gdn-bf16-interpreter",
        "chunk_gated_delta_rule",
        ((*(x.bfloat16() for x in gdn()[0][:3]), *gdn()[0][3:]), {}),
        "16-bit inputs under Triton's interpreter",
    ),
    (
        "gdn-fp16-interpreter",
        "chunk_gated_delta_rule",
        ((*(x.half() for x in gdn()[0][:3]), *gdn()[0][3:]), {}),
        "16-bit inputs under Triton's interpreter",
    ),
    (
        "gdn-value-heads-not-a-multiple",
        "chunk_gated_delta_rule",
        ((_t(B, T, 2, K), _t(B, T, 2, K), _t(B, T, 3, V), -torch.rand(B, T, 3), torch.rand(B, T, 3)), {}),
        "inconsistent shapes",
    ),
    ("gdn-K8", "chunk_gated_delta_rule", with_args(gdn, 0, _t(B, T, H, 8)), "inconsistent shapes"),
    ("gdn-K8-both", "chunk_gated_delta_rule", ((_t(B, T, H, 8), _t(B, T, H, 8), *gdn()[0][2:]), {}), "head dims K=8"),
    ("gdn-K512", "chunk_gated_delta_rule", ((_t(B, T, H, 512), _t(B, T, H, 512), *gdn()[0][2:]), {}), "K=512"),
    ("gdn-mixed-dtypes", "chunk_gated_delta_rule", with_args(gdn, 2, _t(B, T, HV, V).double()), "dtypes"),
    ("gdn-meta-device", "chunk_gated_delta_rule", (tuple(x.to("meta") for x in gdn()[0]), {}), "tensors on meta"),
    ("gdn-context-parallel", "chunk_gated_delta_rule", gdn(cp_context=object()), "context parallelism"),
    ("gdn-deprecated-layout", "chunk_gated_delta_rule", gdn(transpose_state_layout=True), "transpose_state_layout"),
    ("gdn-unknown-keyword", "chunk_gated_delta_rule", gdn(head_first=False), "keyword 'head_first'"),
    ("gdn-neg-eigval-alone", "chunk_gated_delta_rule", gdn(allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
    ("gdn-gate-without-A_log", "chunk_gated_delta_rule", gdn(use_gate_in_kernel=True), "without A_log"),
    (
        "gdn-dt_bias-per-channel",
        "chunk_gated_delta_rule",
        gdn(**{**GATE_KW, "dt_bias": torch.randn(HV * K)}),
        "dt_bias must have HV = 2",
    ),
    (
        "gdn-state-layout",
        "chunk_gated_delta_rule",
        gdn(state_v_first=True, initial_state=_t(1, HV, K, V)),
        "initial state of shape (1, 2, 16, 32), not (1, 2, 32, 16)",
    ),
    (
        "gdn-varlen-B2",
        "chunk_gated_delta_rule",
        ((*(torch.cat([x, x]) for x in gdn()[0]),), {"cu_seqlens": CU}),
        "B = 2",
    ),
    ("gdn-bad-cpu-copy", "chunk_gated_delta_rule", gdn(cu_seqlens=CU, cu_seqlens_cpu=CU_CPU[:2]), "cu_seqlens_cpu"),
    ("gdn-chunk-size", "chunk_gated_delta_rule", gdn(chunk_size=128), "chunk_size=128"),
    ("gdn-beta-shape", "chunk_gated_delta_rule", with_args(gdn, 4, torch.rand(B, T, H)), "inconsistent shapes"),
    ("gdn-kda-gate", "chunk_gated_delta_rule", with_args(gdn, 3, -torch.rand(B, T, HV, K)), "a gate g of shape"),
    ("kda-intermediate-states", "chunk_kda", kda(return_intermediate_states=True), "return_intermediate_states"),
    ("kda-graph", "chunk_kda", kda(use_graph=True), "use_graph"),
    ("kda-half-state", "chunk_kda", kda(initial_state=_t(1, HV, K, V).half()), "not float32"),
    ("kda-unsafe-bound", "chunk_kda", kda(**{**KDA_LAYER, "lower_bound": -7.0}), "outside [-5, 0)"),
    ("kda-dt_bias-per-head", "chunk_kda", kda(**{**GATE_KW}), "dt_bias must have HV * K = 32"),
    ("recurrent-grad", "fused_recurrent_kda_fwd", recurrent(q=_t(2, 1, H, K).requires_grad_()), "has no backward"),
    (
        "recurrent-batching",
        "fused_recurrent_kda_fwd",
        recurrent(ssm_state_indices=torch.arange(2)),
        "continuous batching",
    ),
    (
        "recurrent-beta-per-channel",
        "fused_recurrent_kda_fwd",
        recurrent(beta=torch.rand(2, 1, HV, V)),
        "per value channel",
    ),
    (
        "recurrent-inplace-no-state",
        "fused_recurrent_kda_fwd",
        recurrent(inplace_final_state=True, initial_state=None),
        "inplace_final_state without an initial state",
    ),
    ("delta-gate", "chunk_delta_rule", delta(use_gate_in_kernel=True), "keyword 'use_gate_in_kernel'"),
]


@pytest.mark.parametrize(("name", "entry", "call", "reason"), VERIFIER_CASES, ids=[c[0] for c in VERIFIER_CASES])
def test_verifier_accepts_what_dtune_computes_right(
    backend: ModuleType, name: str, entry: str, call: Args, reason: str | None
) -> None:
    backend.enable("always")  # the static checks alone (the speed rule is tested below)
    args, kwargs = call
    accepted, why = backend.DtuneBackend().verify(entry, *args, **kwargs)
    if reason is None:
        assert accepted and why is None, why
    else:
        assert not accepted and why is not None and reason in why, why


# ---- registration and the switch -------------------------------------------------------------------------------

FLA_FUNCTIONS = {
    "chunk_gated_delta_rule": fla_gdn_chunk.chunk_gated_delta_rule,
    "chunk_kda": fla_kda_chunk.chunk_kda,
    "fused_recurrent_kda_fwd": fla_kda_recurrent.fused_recurrent_kda_fwd,
    "chunk_delta_rule": fla_dn_chunk.chunk_delta_rule,
}


def test_registered_in_every_registry_before_fla_s_other_backends(backend: ModuleType) -> None:
    registries = {
        "gated_delta_rule": fb._operation_registries["gated_delta_rule"],
        "kda": fb._operation_registries["kda"],
        "chunk_kda": fb._function_registries[unwrap(chunk_kda)],
        "chunk_delta_rule": fb._function_registries[unwrap(fla_dn_chunk.chunk_delta_rule)],
    }
    for name, registry in registries.items():
        order = [b.backend_type for b in registry._get_sorted_backends() if b.priority >= 1]  # NPU's come first
        assert order[0] == "dtune", f"{name}: {order}"
    assert backend.DtuneBackend.env_var == "FLA_DTUNE" and not backend.DtuneBackend.default_enable
    assert backend.chunk_delta_rule is not fla_dn_chunk.chunk_delta_rule  # fla's own function behind its dispatch


@pytest.mark.parametrize("entry", sorted(FLA_FUNCTIONS))
def test_readers_mirror_fla_signatures(backend: ModuleType, entry: str) -> None:
    """Each entry point's reader takes fla 0.6.0's parameters in fla's order (positional calls bind the same way)."""
    theirs = list(inspect.signature(unwrap(FLA_FUNCTIONS[entry])).parameters)
    ours = list(inspect.signature(backend.READERS[entry]).parameters)
    assert ours == theirs


def test_switch(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    b = backend.DtuneBackend()
    assert not b.is_enabled() and backend.policy() is None  # off by default
    backend.enable()
    assert b.is_enabled() and backend.policy() == "measured"
    monkeypatch.setenv("FLA_DTUNE", "0")  # the environment wins over enable()
    assert not b.is_enabled()
    monkeypatch.setenv("FLA_DTUNE", "always")
    backend.disable()
    assert b.is_enabled() and backend.policy() == "always"
    with pytest.raises(ValueError, match="unknown policy"):
        backend.enable("fastest")


# ---- the speed rule ----------------------------------------------------------------------------------------------


def _entry(kernel: str, times: dict[str, float] | None, T: int = T, B: int = B, **bucket: int) -> dict[str, Any]:
    e: dict[str, Any] = {
        "kernel": kernel,
        "dtype": "fp32",
        "bucket": {"T": T, "B": B, "H": H, "HV": HV, "K": K, "V": V, **bucket},
        "config": {},
        "time_ms": 1.0,
    }
    if times is not None:
        e["side_by_side_ms"] = times
    return e


@pytest.fixture
def tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[dict[str, Any]]], None]:
    """Load a tuned-config file for a pretend GPU 'h200' that the CPU tensors resolve to."""

    def load(entries: list[dict[str, Any]]) -> None:
        doc = {"schema": 1, "gpu": "h200", "gpu_name": "x", "created": "now", "versions": {}, "entries": entries}
        path = tmp_path / "tuned.json"
        path.write_text(json.dumps(doc))
        dtune.store.load_configs(path, gpu="h200")

    monkeypatch.setattr(dtune.store, "gpu_key", lambda device: "h200")
    return load


FWD = "chunk_gated_delta_rule"
SPEED_CASES: list[tuple[str, list[dict[str, Any]], bool, str | None]] = [
    ("dtune-faster", [_entry(FWD, {"dtune": 1.0, "fla": 2.0})], False, None),
    ("dtune-tied", [_entry(FWD, {"dtune": 2.0, "fla": 2.0})], False, None),
    ("fla-faster", [_entry(FWD, {"dtune": 2.0, "fla": 1.0})], False, "fla is faster at chunk_gated_delta_rule B1"),
    ("no-times", [_entry(FWD, None)], False, "no chunk_gated_delta_rule bucket records a side-by-side forward time"),
    # the call's own bucket unmeasured: the nearest measured one speaks for it when near enough, else nothing does
    ("own-unmeasured", [_entry(FWD, None), _entry(FWD, {"dtune": 1.0, "fla": 2.0}, T=32)], False, None),
    ("own-unmeasured-far", [_entry(FWD, None), _entry(FWD, {"dtune": 1.0, "fla": 2.0}, T=64)], False, "not within"),
    ("own-unmeasured-slower", [_entry(FWD, None), _entry(FWD, {"dtune": 2.0, "fla": 1.0}, B=2)], False, "fla is"),
    # a near measured bucket decides even where a far one ranks nearer (the same T, 4x the sequences)
    (
        "near-over-far",
        [_entry(FWD, {"dtune": 2.0, "fla": 1.0}, B=4), _entry(FWD, {"dtune": 1.0, "fla": 2.0}, T=40)],
        False,
        None,
    ),
    # a measurement at other head dims never speaks, however near its bucket
    ("measured-other-dims", [_entry(FWD, None), _entry(FWD, {"dtune": 1.0, "fla": 2.0}, K=64)], False, "no chunk"),
    ("only-flashqla", [_entry(FWD, {"dtune": 1.0, "flash_qla": 2.0})], False, "records a side-by-side forward time"),
    ("far-bucket", [_entry(FWD, {"dtune": 1.0, "fla": 2.0}, T=4096)], False, "not within 2x"),
    ("near-bucket", [_entry(FWD, {"dtune": 1.0, "fla": 2.0}, T=32, H=2, HV=4)], False, None),
    ("other-head-dims", [_entry(FWD, {"dtune": 1.0, "fla": 2.0}, K=64)], False, "no tuned chunk_gated_delta_rule"),
    ("training-unmeasured", [_entry(FWD, {"dtune": 1.0, "fla": 2.0})], True, "no tuned chunk_gated_delta_rule_bwd"),
    ("training-faster", [_entry(FWD + "_bwd", {"dtune": 3.0, "fla": 4.0})], True, None),
    ("training-slower", [_entry(FWD + "_bwd", {"dtune": 5.0, "fla": 3.0})], True, "fla is faster"),
]


@pytest.mark.parametrize(("name", "entries", "train", "reason"), SPEED_CASES, ids=[c[0] for c in SPEED_CASES])
def test_speed_rule_reads_side_by_side_times(
    backend: ModuleType,
    tuned: Callable[[list[dict[str, Any]]], None],
    name: str,
    entries: list[dict[str, Any]],
    train: bool,
    reason: str | None,
) -> None:
    tuned(entries)
    backend.enable()
    (q, *rest), kw = gdn()
    accepted, why = backend.DtuneBackend().verify(FWD, q.requires_grad_(train), *rest, **kw)
    assert (accepted, why is None) == (reason is None, reason is None), why
    if reason is not None:
        assert why is not None and reason in why, why


def test_no_tuned_configs_means_fla_runs(backend: ModuleType) -> None:
    backend.enable()  # on the CPU no GPU key resolves: no file, no measurement
    args, kw = gdn()
    accepted, why = backend.DtuneBackend().verify(FWD, *args, **kw)
    assert not accepted and why is not None and "no tuned chunk_gated_delta_rule entry" in why


class FakePeer(fb.BaseBackend):
    """Another backend of 'gated_delta_rule' after dtune (FlashQLA's place), taking calls with K = 16 only."""

    backend_type = "fake_peer"
    priority = 3
    calls: ClassVar[list[str]] = []

    def chunk_gated_delta_rule_verifier(self, q: torch.Tensor, *args: Any, **kw: Any) -> tuple[bool, str | None]:
        return (True, None) if q.shape[-1] == 16 else (False, "K != 16")

    def chunk_gated_delta_rule(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        FakePeer.calls.append("run")
        return torch.zeros(1), None


@pytest.fixture
def peer() -> Iterator[type[FakePeer]]:
    registry = fb._operation_registries["gated_delta_rule"]
    registry.register(FakePeer())
    FakePeer.calls = []
    yield FakePeer
    registry._backends.pop(FakePeer.backend_type)


def test_dtune_yields_to_a_faster_backend(
    backend: ModuleType, tuned: Callable[[list[dict[str, Any]]], None], peer: type[FakePeer]
) -> None:
    """The peer that would run the call is the one compared against (here faster than dtune, fla slower)."""
    tuned([_entry(FWD, {"dtune": 1.0, "fla": 2.0, "fake_peer": 0.5})])
    backend.enable()
    args, kw = gdn()
    accepted, why = backend.DtuneBackend().verify(FWD, *args, **kw)
    assert not accepted and why is not None and "fake_peer is faster" in why
    chunk_gated_delta_rule(*args, **kw)  # through fla's dispatch: the peer runs it
    assert peer.calls == ["run"]


def test_dtune_takes_calls_the_faster_backend_declines(
    backend: ModuleType, tuned: Callable[[list[dict[str, Any]]], None], peer: type[FakePeer]
) -> None:
    """K = 32: the peer declines, so fla's Triton path would run, and dtune is faster than that."""
    entries = [_entry(FWD, {"dtune": 1.0, "fla": 2.0, "fake_peer": 0.5}, K=32, V=32)]
    tuned(entries)
    backend.enable()
    torch.manual_seed(0)
    q, k, v = _t(B, T, H, 32), _t(B, T, H, 32), _t(B, T, HV, 32)
    accepted, why = backend.DtuneBackend().verify(FWD, q, k, v, -torch.rand(B, T, HV), torch.rand(B, T, HV))
    assert accepted, why


@pytest.fixture
def fla_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla's flags as on an H100 with Triton 3.6: its Gated DeltaNet backward raises (fla issue 640)."""
    import fla.ops.common.chunk_o as chunk_o

    for name, value in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        monkeypatch.setattr(chunk_o, name, value)


class FakeCommon(fb.BaseBackend):
    """A backend of fla's 'common' operation serving chunk_bwd_dqkwg (TileLang's place): fla then does not raise."""

    backend_type = "fake_common"
    priority = 1

    def chunk_bwd_dqkwg(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("never run here")


REFUSAL_CASES: list[tuple[str, bool, bool, bool, str]] = [
    # (id, training, a 'common' backend serves fla's kernel, the K = 16 peer is registered, reason fragment)
    ("training", True, False, False, "fla issue 640"),
    ("forward", False, False, False, "no tuned chunk_gated_delta_rule entry"),
    ("tilelang-serves-fla", True, True, False, "no tuned chunk_gated_delta_rule_bwd entry"),
    ("another-backend-runs-it", True, False, True, "no tuned chunk_gated_delta_rule_bwd entry"),
]


@pytest.mark.parametrize(
    ("name", "train", "common", "with_peer", "reason"), REFUSAL_CASES, ids=[c[0] for c in REFUSAL_CASES]
)
def test_dtune_takes_the_training_step_fla_would_refuse(
    backend: ModuleType,
    fla_refuses: None,
    name: str,
    train: bool,
    common: bool,
    with_peer: bool,
    reason: str,
) -> None:
    """No measurement at the bucket, yet where fla's own function would raise, dtune takes the call (accepted, the
    reason kept in the decisions); not where fla hands its kernel to another backend or a peer runs the call."""
    registries = []
    if common:
        import fla.ops.common.chunk_o  # noqa: F401 (loads fla's 'common' registry)

        registries.append((fb._operation_registries["common"], FakeCommon()))
    if with_peer:
        registries.append((fb._operation_registries["gated_delta_rule"], FakePeer()))
    for registry, b in registries:
        registry.register(b)
    try:
        backend.enable()
        (q, *rest), kw = gdn()
        accepted, why = backend.DtuneBackend().verify(FWD, q.requires_grad_(train), *rest, **kw)
    finally:
        for registry, b in registries:
            registry._backends.pop(b.backend_type)
    assert accepted == (name == "training"), why
    assert why is not None and reason in why, why
    if accepted:
        assert backend.decisions()[-1]["accepted"] and "fla issue 640" in backend.decisions()[-1]["reason"]


def test_verdicts_are_cached_by_shape(
    backend: ModuleType, tuned: Callable[[list[dict[str, Any]]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned([_entry(FWD, {"dtune": 1.0, "fla": 2.0})])
    backend.enable()
    seen: list[int] = []
    rule = backend.measured_verdict
    spy = lambda call, p, grad: seen.append(call.q.shape[1]) or rule(call, p, grad)  # noqa: E731
    monkeypatch.setattr(backend, "measured_verdict", spy)
    b = backend.DtuneBackend()
    for _ in range(3):
        args, kw = gdn()
        assert b.verify(FWD, *args, **kw) == (True, None)
    args, kw = gdn()
    b.verify(FWD, *(x[:, :12] for x in args), **kw)  # another T: a verdict of its own
    assert seen == [T, 12]
    assert [d["q"][1] for d in backend.decisions()] == [T, 12]


# ---- routing: dtune, or fla's own function ---------------------------------------------------------------------


class Spy:
    """Stands in for fla's autograd Function or Triton kernel: records that fla's own path ran."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, *args: Any) -> tuple[torch.Tensor, None]:
        self.calls += 1
        return torch.zeros(1), None

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls += 1

        return launch


ROUTES: list[tuple[str, Callable[..., Any], tuple[ModuleType, str], str, Args]] = [
    # (id, fla op, what fla's own path calls (module, name), fla's log name, a call dtune takes)
    (
        "gdn",
        chunk_gated_delta_rule,
        (fla_gdn_chunk, "ChunkGatedDeltaRuleFunction"),
        "gated_delta_rule.chunk_gated_delta_rule",
        gdn(),
    ),
    ("kda", chunk_kda, (fla_kda_chunk, "ChunkKDAFunction"), "chunk_kda", kda()),
    ("delta", fla_dn_chunk.chunk_delta_rule, (fla_dn_chunk, "ChunkDeltaRuleFunction"), "chunk_delta_rule", delta()),
]


@pytest.mark.parametrize(("name", "op", "target", "log", "call"), ROUTES, ids=[r[0] for r in ROUTES])
def test_declined_calls_reach_fla_and_accepted_ones_do_not(
    backend: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    op: Callable[..., Any],
    target: tuple[ModuleType, str],
    log: str,
    call: Args,
) -> None:
    """The same call in float32 (dtune computes it) and in bfloat16 (under the interpreter dtune declines it, and
    fla's own function runs: its autograd Function, spied, is reached)."""
    spy = Spy()
    monkeypatch.setattr(*target, spy)
    backend.enable("always")
    if name == "delta":
        op = backend.chunk_delta_rule  # fla 0.6.0 dispatches no delta rule: the drop-in puts it behind fla's dispatch
    caplog.set_level(logging.INFO, logger="fla.backends")
    args, kw = call
    o, _ = op(*args, **kw)
    assert spy.calls == 0 and o.shape == args[2].shape and torch.isfinite(o).all()
    assert f"{log} -> dtune" in caplog.text
    op(*(x.bfloat16() if x.dim() == 4 else x for x in args), **kw)
    assert spy.calls == 1
    assert f"{log} -> dtune rejected: 16-bit inputs under Triton's interpreter" in caplog.text


def test_declined_decode_reaches_fla_s_kernel(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy()
    monkeypatch.setattr(fla_kda_recurrent, "fused_recurrent_kda_fwd_kernel", spy)
    backend.enable("always")
    _, x = recurrent()
    x.pop("inplace_final_state")  # the public fused_recurrent_kda passes False itself
    fused_recurrent_kda(**x)
    assert spy.calls == 0
    fused_recurrent_kda(**{**x, "q": x["q"].double(), "k": x["k"].double(), "v": x["v"].double()})  # declined
    assert spy.calls == 1


# ---- numerics through fla's public ops ----------------------------------------------------------------------------


def _grads(outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    weights = [torch.randn(o.shape, dtype=torch.float64) for o in outputs]
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights))
    return list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize(
    ("name", "op", "layer", "varlen"),
    [
        ("gdn-layer", chunk_gated_delta_rule, GDN_LAYER, False),
        ("kda-layer-varlen", chunk_kda, KDA_LAYER, True),
    ],
    ids=["gdn-layer", "kda-layer-varlen"],
)
def test_fla_ops_routed_to_dtune_agree_with_the_float64_reference(
    backend: ModuleType, name: str, op: Callable[..., Any], layer: dict[str, Any], varlen: bool
) -> None:
    """The layer's options (l2norm, raw gate with A_log/dt_bias, beta logits, negative eigenvalues, v-first states),
    an initial state, the final state; varlen with int32 offsets and their CPU copy: outputs and every gradient."""
    backend.enable("always")
    make = kda if op is chunk_kda else gdn
    args, _ = make()
    q, k, v, g, beta = args
    g = torch.randn_like(g) * 3  # raw gate values of both signs
    beta = torch.randn_like(beta) * 3  # logits
    N = 3 if varlen else B
    h0 = torch.randn(N, HV, V, K)
    A_log, dt_bias = torch.randn(HV), torch.randn(layer["dt_bias"].numel())
    leaves = [q, k, v, g, beta, h0, A_log, dt_bias]
    for t in leaves:
        t.requires_grad_()
    extra = {"cu_seqlens": CU, "cu_seqlens_cpu": CU_CPU} if varlen else {}
    opts = {**layer, "A_log": A_log, "dt_bias": dt_bias}
    o, ht = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **opts, **extra)
    assert ht.shape == (N, HV, V, K)
    ref_opts = {n: opts[n] for n in opts if n != "safe_gate"}
    o_ref, ht_ref = reference_with_options(q, k, v, g, beta, None, h0, True, CU if varlen else None, **ref_opts)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(ht, ht_ref) < 1e-4
    got, want = _grads((o, ht), leaves), _grads((o_ref, ht_ref), leaves)
    names = ["q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"]
    for n, a, b in zip(names, got, want):
        assert rel_err(a, b) < 1e-3, f"d{n}: {rel_err(a, b):.3g}"


def test_decode_routed_to_dtune_agrees_with_the_reference(backend: ModuleType) -> None:
    backend.enable("always")
    _, x = recurrent()
    h0 = torch.randn(2, HV, V, K)
    opts = RECURRENT_LAYER
    o, ht = fused_recurrent_kda(
        x["q"], x["k"], x["v"], -x["g"] * 2, x["beta"], initial_state=h0, output_final_state=True, **opts
    )
    o_ref, ht_ref = reference_with_options(x["q"], x["k"], x["v"], -x["g"] * 2, x["beta"], None, h0, True, **opts)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ht, ht_ref) < 1e-5


def test_drop_in_delta_rule_agrees_with_the_reference(backend: ModuleType) -> None:
    backend.enable("always")
    args, _ = delta()
    o, ht = backend.chunk_delta_rule(*args, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = reference_with_options(*args[:3], None, args[3], None, None, True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ht, ht_ref) < 1e-5


def test_cu_seqlens_cpu_saves_the_host_read_of_cu_seqlens(backend: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fla's cu_seqlens_cpu, dtune reads the host copy and never cu_seqlens itself (on a GPU: no sync)."""
    backend.enable("always")
    cu = torch.tensor([0, 5, 20], dtype=torch.int64)  # int64: a host read of it would share its storage
    read: list[int] = []
    tolist = torch.Tensor.tolist

    def spy(self: torch.Tensor) -> Any:
        read.append(self.data_ptr())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    args, _ = gdn()
    o, _ = chunk_gated_delta_rule(*args, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    assert o.shape == args[2].shape and read and cu.data_ptr() not in read
    other = cu.clone()
    chunk_gated_delta_rule(*args, cu_seqlens=other)  # without the copy: cu_seqlens is read (once)
    assert other.data_ptr() in read
