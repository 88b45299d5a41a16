"""bf16 chunk backward on a CUDA GPU against float64 autograd (``pytest -m gpu``, run by scripts/gpu_tests.sh).

Triton's interpreter computes ``tl.dot`` on bfloat16 operands wrongly, so the backward's bf16 gradients are only checked
here, compiled, at sizes that exercise the real tiles: the searches' first seeds at D = 128 (chunk 64, the transposed
reverse pass on the whole value width, KDA's pairwise blocks), the sequence-parallel reverse pass with the segmented
forward under autograd, grouped value heads, K != V, packed sequences with an empty one. Every gradient (q, k, v, g,
beta, initial state) is compared by relative RMS error with the backward search space's bf16 tolerance (the gate's).
Skipped, with the reason shown, where there is no CUDA GPU or the interpreter is on (CI).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtune.measure.grad import op_step, reference_step, with_output_grads
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from dtune.tune.space import load_space
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

CHUNK = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
VK = {"BT": 64, "BC": 16, "fh_num_stages": 2, "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "dh_num_stages": 1}
KDA = {"dqk_BK": 32, "dqk_BC": 64}
SEG_FWD = {"SEG_CHUNKS": 16}  # the forward under autograd sequence-parallel too (segments of 16 chunks of 64)
# id -> (shape, seq_lens, backward config, forward config or None: the tuned/default one)
CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any], dict[str, Any] | None]] = {}
for gate in Gate:
    tag = CHUNK[gate]
    vk = {**VK, **(KDA if gate is Gate.CHANNEL else {})}
    CASES[f"{tag}-B2-T1000-H4-HV8-K128-vk128"] = (Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, vk, None)
    CASES[f"{tag}-B2-T777-H2-HV4-K128-V64-vk64-all"] = (
        Shape(2, 777, 2, 4, 128, 64, 2, gate), None, {**vk, "dh_BV": 64, "SAVE": "all"}, None,
    )  # fmt: skip
    CASES[f"{tag}-B2-T777-H2-K128-kv-unfused"] = (
        Shape(2, 777, 2, 2, 128, 128, 2, gate), None, {**vk, "dh_LAYOUT": "kv", "dh_BV": 32, "FUSE_DV": False}, None,
    )  # fmt: skip
    CASES[f"{tag}-B1-T5000-H2-HV4-K128-seg"] = (
        Shape(1, 5000, 2, 4, 128, 128, 1, gate), None, {**vk, "dh_SEG_CHUNKS": 16}, SEG_FWD,
    )  # fmt: skip
    # the training forward's chunk states and V_new stored through TMA descriptors (fh_STORE_TMA), its loads by TMA and
    # its state pass transposed at value tiles of 64 (the forward config's "vk"), every intermediate kept; odd T
    CASES[f"{tag}-B2-T777-H2-HV4-K128-fhSTORE"] = (
        Shape(2, 777, 2, 4, 128, 128, 2, gate), None, {**vk, "fh_STORE_TMA": True, "fh_TMA": True, "SAVE": "all"},
        {"STATE_LAYOUT": "vk", "h_BV": 64},
    )  # fmt: skip
    # stage 1 under autograd inverting its diagonal blocks by repeated squaring (fi_SOLVE; BC 16), odd T, grouped heads
    CASES[f"{tag}-B2-T777-H2-HV4-K128-squaring"] = (
        Shape(2, 777, 2, 4, 128, 128, 2, gate), None, {**vk, "fi_SOLVE": "squaring"}, None,
    )  # fmt: skip
    if (
        gate is Gate.SCALAR
    ):  # dA decayed by the value side (dqk_DECAY = "value"), as the shipped B8 entry with it; varlen
        dgr = {**vk, "REVERSE_DV": True, "dqk_BK": 128, "dqk_BV": 64, "dqk_num_stages": 3, "dqk_DECAY": "value"}
        CASES[f"{tag}-B2-T777-H2-HV4-K128-dgrows"] = (Shape(2, 777, 2, 4, 128, 128, 2, gate), None, dgr, None)
        CASES[f"{tag}-varlen-K96-V64-dgrows-kloop"] = (
            Shape(1, 0, 2, 4, 96, 64, 5, gate, True), [1, 2100, 0, 1333, 64],
            {**vk, "dh_BV": 64, "dqk_BK": 32, "dqk_KLOOP": True, "dqk_DECAY": "value"}, None,
        )  # fmt: skip
    # grouped value heads' dq/dk partials in bf16 (dqk_GROUP = "input": each rounded before the group sum), HV = 4H
    CASES[f"{tag}-B2-T1000-H2-HV8-K128-group-bf16"] = (
        Shape(2, 1000, 2, 8, 128, 128, 2, gate), None, {**vk, "dqk_GROUP": "input"}, None,
    )  # fmt: skip
    # the reverse pass's last chain product in the form that is not the gate's default (dh_ACC; on for Gated DeltaNet),
    # with W read, and (DeltaNet, Gated DeltaNet) formed from K as the shipped B8 entries do (fh_W)
    flip = {"dh_ACC": gate is not Gate.SCALAR}
    CASES[f"{tag}-B2-T1000-H4-HV8-K128-vk128-acc"] = (
        Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, {**vk, **flip}, None,
    )  # fmt: skip
    if gate is not Gate.CHANNEL:
        nw = {"REVERSE_DV": True, "fh_U": "recomputed", "fh_W": "recomputed", "SAVE": "all"}
        CASES[f"{tag}-B2-T777-H2-K128-fhW-acc"] = (
            Shape(2, 777, 2, 2, 128, 128, 2, gate), None, {**vk, **nw, **flip}, None,
        )  # fmt: skip
    if gate is not Gate.CHANNEL:  # the dq/dk work inside the reverse pass (REVERSE_DQK), plain and segmented, varlen
        dqk = {"REVERSE_DV": True, "REVERSE_DQK": True}
        CASES[f"{tag}-B2-T1000-H4-HV8-K128-revdqk"] = (
            Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, {**vk, **dqk, "SAVE": "all"}, None,
        )  # fmt: skip
        CASES[f"{tag}-B2-T1000-H4-HV8-K128-revdqk-tiled"] = (
            Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, {**vk, **dqk, "dh_BV": 32, "dh_LAYOUT": "kv"}, None,
        )  # fmt: skip
        CASES[f"{tag}-varlen-K96-V64-revdqk-seg"] = (
            Shape(1, 0, 2, 4, 96, 64, 5, gate, True), [1, 2100, 0, 1333, 64],
            {**vk, **dqk, "dh_BV": 64, "dh_SEG_CHUNKS": 8}, SEG_FWD,
        )  # fmt: skip
    CASES[f"{tag}-varlen-K96-V64-seg"] = (
        Shape(1, 0, 2, 4, 96, 64, 5, gate, True), [1, 2100, 0, 1333, 64], {**vk, "dh_BV": 64, "dh_SEG_CHUNKS": 8},
        SEG_FWD,
    )  # fmt: skip
    if gate is Gate.SCALAR:  # both sequence-parallel passes' segments by burn-in (strong gates), the shipped B1 tiles
        CASES[f"{tag}-B1-T5000-H2-HV4-K128-seg-burnin"] = (
            Shape(1, 5000, 2, 4, 128, 128, 1, gate), None,
            {**vk, "dh_SEG_CHUNKS": 16, "dh_SEG_START": "burnin", "REVERSE_DV": True, "dh_TMA": True},
            {**SEG_FWD, "SEG_START": "burnin"},
        )  # fmt: skip
    if gate is Gate.SCALAR:  # both sequence-parallel passes' phase 1 skipping negligible transitions (strong gates)
        CASES[f"{tag}-B1-T5000-H2-HV4-K128-seg-decay"] = (
            Shape(1, 5000, 2, 4, 128, 128, 1, gate), None, {**vk, "dh_SEG_CHUNKS": 16, "dh_SEG_DECAY": True},
            {**SEG_FWD, "SEG_DECAY": True},
        )  # fmt: skip


def assert_step_matches(got: Any, ref: Any, tol: float) -> None:
    """A training step's output and every gradient within ``tol`` of the float64 reference's, finite."""
    assert rel_err(got.o, ref.o) < tol, f"output rel err {rel_err(got.o, ref.o):.3g} (tolerance {tol})"
    for name, grad in got.grads.items():
        want = ref.grads[name]
        if want is None:
            assert grad is None, name
            continue
        assert grad is not None and torch.isfinite(grad).all(), name
        assert rel_err(grad, want) < tol, f"d{name} rel err {rel_err(grad, want):.3g} (tolerance {tol})"


@pytest.mark.parametrize(("shape", "seq_lens", "bwd", "fwd"), list(CASES.values()), ids=list(CASES))
def test_bf16_gradients_match_float64(
    shape: Shape, seq_lens: list[int] | None, bwd: dict[str, Any], fwd: dict[str, Any] | None
) -> None:
    kernel = CHUNK[shape.gate]
    tol = load_space(kernel + "_bwd").tolerance["bf16"]
    x = make_inputs(shape, torch.bfloat16, "cuda", seed=7, seq_lens=seq_lens, gate_min=-5.0)
    x = with_output_grads({**x, "scale": shape.K**-0.5, "output_final_state": True})
    got = op_step(kernel, x, bwd, fwd)()
    ref = reference_step(x)
    assert_step_matches(got, ref, tol)


# the training forward's state pass in Gluon (fh_LOOP = "gluon", kernels/chunk/state_ws.py): its chunk states and
# V_new stored by TMA for the backward (a sequence's partial last chunk of V_new by pointers); sm_90 only
GLUON_FH = {**VK, "fh_LOOP": "gluon", "fh_U": "recomputed", "fh_BV": 64, "fh_maxnreg": 128, "SAVE": "all"}
GLUON_CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any]]] = {}
for gate in (Gate.NONE, Gate.SCALAR):
    tag = CHUNK[gate]
    GLUON_CASES[f"{tag}-B2-T777-H2-HV4-K128"] = (Shape(2, 777, 2, 4, 128, 128, 2, gate), None, GLUON_FH)
    GLUON_CASES[f"{tag}-varlen-K64-V128"] = (Shape(1, 0, 2, 4, 64, 128, 5, gate, True), [1, 700, 0, 333, 64], GLUON_FH)
    GLUON_CASES[f"{tag}-B2-T1000-H4-fhW-aqk"] = (
        Shape(2, 1000, 4, 4, 128, 128, 2, gate), None,
        {**GLUON_FH, "REVERSE_DV": True, "fh_W": "recomputed", "fh_AQK": "recomputed", "fh_maxnreg": 0},
    )  # fmt: skip


@pytest.mark.parametrize(("shape", "seq_lens", "bwd"), list(GLUON_CASES.values()), ids=list(GLUON_CASES))
def test_gluon_training_forward_gradients_match_float64(
    shape: Shape, seq_lens: list[int] | None, bwd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon state pass is sm_90 only")
    from dtune.kernels.chunk import state_ws

    stored: list[bool] = []
    real = state_ws.launch_state_ws

    def spy(call: Any, inter: Any, out: Any) -> Any:
        stored.append(inter.h is not None)
        return real(call, inter, out)

    monkeypatch.setattr(state_ws, "launch_state_ws", spy)
    kernel = CHUNK[shape.gate]
    tol = load_space(kernel + "_bwd").tolerance["bf16"]
    x = make_inputs(shape, torch.bfloat16, "cuda", seed=9, seq_lens=seq_lens, gate_min=-5.0)
    x = with_output_grads({**x, "scale": shape.K**-0.5, "output_final_state": True})
    got = op_step(kernel, x, bwd, None)()
    torch.cuda.synchronize()
    assert True in stored, "the training forward's Gluon pass (storing the chunk states) did not run"
    ref = reference_step(x)
    assert_step_matches(got, ref, tol)


# the reverse state pass in Gluon (dh_LOOP = "gluon", kernels/chunk/bwd_state_ws.py): with REVERSE_DV and stage 1's T
# zero above its diagonal (fh_U = "recomputed"); W's product from k (fh_W = "recomputed") or W read, A_qk read or
# formed in the pass, rings of 1 to 3 buffers, value tiles of 64 and 128, a register cap, with the training forward's
# Gluon pass
GLUON_DH = {**VK, "REVERSE_DV": True, "fh_U": "recomputed", "fh_W": "recomputed", "dh_LOOP": "gluon", "dh_BV": 64}
GLUON_DH_CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any]]] = {}
for gate in (Gate.NONE, Gate.SCALAR):
    tag = CHUNK[gate]
    GLUON_DH_CASES[f"{tag}-B2-T777-H2-HV4-K128"] = (Shape(2, 777, 2, 4, 128, 128, 2, gate), None, GLUON_DH)
    GLUON_DH_CASES[f"{tag}-varlen-K64-V128-bv128"] = (
        Shape(1, 0, 2, 4, 64, 128, 5, gate, True), [1, 700, 0, 333, 64], {**GLUON_DH, "dh_BV": 128},
    )  # fmt: skip
    GLUON_DH_CASES[f"{tag}-B2-T1000-H4-W-read-1buf"] = (
        Shape(2, 1000, 4, 4, 128, 128, 2, gate), None, {**GLUON_DH, "fh_W": "stored", "dh_num_stages": 1},
    )  # fmt: skip
    GLUON_DH_CASES[f"{tag}-B2-T1000-H4-aqk-3buf-cap"] = (
        Shape(2, 1000, 4, 4, 128, 128, 2, gate), None,
        {**GLUON_DH, "fh_AQK": "recomputed", "dh_num_stages": 3, "dh_maxnreg": 128, "SAVE": "all"},
    )  # fmt: skip
    GLUON_DH_CASES[f"{tag}-B1-T4096-H4-bv128-fh-gluon"] = (
        Shape(1, 4096, 4, 4, 128, 128, 1, gate), None,
        {**GLUON_DH, "dh_BV": 128, "fh_LOOP": "gluon", "fh_BV": 64, "fh_maxnreg": 128, "SAVE": "all"},
    )  # fmt: skip
GLUON_DH_CASES["chunk_gated_delta_rule-B2-T1"] = (Shape(2, 1, 2, 2, 128, 128, 2, Gate.SCALAR), None, GLUON_DH)
for gate in (Gate.NONE, Gate.SCALAR):  # phase 3 of the sequence-parallel pass in Gluon, the forward segmented too
    GLUON_DH_CASES[f"{CHUNK[gate]}-B1-T5000-H2-HV4-seg"] = (
        Shape(1, 5000, 2, 4, 128, 128, 1, gate), None, {**GLUON_DH, "dh_BV": 128, "dh_SEG_CHUNKS": 16},
    )  # fmt: skip
# ... and the dq/dk stage in Gluon (dqk_LOOP = "gluon", kernels/chunk/bwd_dqk_ws.py: one key tile, chunks of 64)
GLUON_DQK = {**VK, "REVERSE_DV": True, "fh_U": "recomputed", "dqk_LOOP": "gluon", "dqk_BK": 128, "dqk_BV": 64}
GLUON_DQK_CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any]]] = {}
for gate in (Gate.NONE, Gate.SCALAR):
    tag = CHUNK[gate]
    GLUON_DQK_CASES[f"{tag}-B2-T777-H2-HV4-K128"] = (Shape(2, 777, 2, 4, 128, 128, 2, gate), None, GLUON_DQK)
    GLUON_DQK_CASES[f"{tag}-varlen-K64-V128-bv128-1buf"] = (
        Shape(1, 0, 2, 4, 64, 128, 5, gate, True), [1, 700, 0, 333, 64],
        {**GLUON_DQK, "dqk_BK": 64, "dqk_BV": 128, "dqk_num_stages": 1},
    )  # fmt: skip
    GLUON_DQK_CASES[f"{tag}-B1-T4096-H4-all-gluon"] = (
        Shape(1, 4096, 4, 4, 128, 128, 1, gate), None,
        {**GLUON_DQK, "fh_W": "recomputed", "dh_LOOP": "gluon", "dh_BV": 128, "fh_LOOP": "gluon", "fh_BV": 64,
         "fh_maxnreg": 128, "SAVE": "all", "dqk_GROUP": "input"},
    )  # fmt: skip
GLUON_DQK_CASES["chunk_gated_delta_rule-B2-T1"] = (Shape(2, 1, 2, 2, 128, 128, 2, Gate.SCALAR), None, GLUON_DQK)


def check_gluon_step(
    module: Any, launcher: str, what: str, shape: Shape, seq_lens: list[int] | None, bwd: dict[str, Any], seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A bf16 training step with ``bwd`` against float64, its Gluon kernel (``module.launcher``) seen to run."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the Gluon {what} is sm_90 only")
    ran: list[bool] = []
    real = getattr(module, launcher)

    def spy(**kwargs: Any) -> Any:
        ran.append(True)
        return real(**kwargs)

    monkeypatch.setattr(module, launcher, spy)
    kernel = CHUNK[shape.gate]
    tol = load_space(kernel + "_bwd").tolerance["bf16"]
    x = make_inputs(shape, torch.bfloat16, "cuda", seed=seed, seq_lens=seq_lens, gate_min=-5.0)
    x = with_output_grads({**x, "scale": shape.K**-0.5, "output_final_state": True})
    got = op_step(kernel, x, bwd, None)()
    torch.cuda.synchronize()
    assert ran, f"the Gluon {what} did not run"
    assert_step_matches(got, reference_step(x), tol)


@pytest.mark.parametrize(("shape", "seq_lens", "bwd"), list(GLUON_DH_CASES.values()), ids=list(GLUON_DH_CASES))
def test_gluon_reverse_pass_gradients_match_float64(
    shape: Shape, seq_lens: list[int] | None, bwd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtune.kernels.chunk import bwd_state_ws

    check_gluon_step(bwd_state_ws, "launch_reverse_ws", "reverse pass", shape, seq_lens, bwd, 11, monkeypatch)


@pytest.mark.parametrize(("shape", "seq_lens", "bwd"), list(GLUON_DQK_CASES.values()), ids=list(GLUON_DQK_CASES))
def test_gluon_dqk_stage_gradients_match_float64(
    shape: Shape, seq_lens: list[int] | None, bwd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dtune.kernels.chunk import bwd_dqk_ws

    check_gluon_step(bwd_dqk_ws, "launch_dqk_ws", "dq/dk stage", shape, seq_lens, bwd, 13, monkeypatch)
