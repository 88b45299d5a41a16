"""The sequence-parallel state pass (``SEG_CHUNKS``) against the float64 loop, under Triton's interpreter (fp32).

Small chunks (BT = 16) and short segments (2 chunks) so that a 70-token sequence has three segments: phase 1
(transitions), phase 2 (entering states) and phase 3 (the pass per segment) all take part. Gates are mild here (log
decay down to −0.1 per step): under the usual strong gates (down to −5) a segment's transition M decays to ~e^-70,
and a wrong M could not show; the strong gates have cases of their own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.language as tl
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.chunk.tables import build_tables
from dtune.kernels.reference import naive_recurrent

from dtune.inputs import Gate, Problem, make_inputs
from tests.conftest import rel_err
from tests.kernels.test_chunk import CHUNK, run

TOL = 1e-4
SEG = {"BT": 16, "BC": 16, "SEG_CHUNKS": 2, "h_BV": 16}


def check_loop(problem: Problem, x: dict[str, Any], config: dict[str, Any], final: bool = True) -> None:
    o, s = run(CHUNK[problem.gate], x, config, final=final)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o_ref, s_ref = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert rel_err(o, o_ref) < TOL, f"output rel err {rel_err(o, o_ref):.3g}"
    if final:
        assert s is not None and s_ref is not None
        assert rel_err(s, s_ref) < TOL, f"final state rel err {rel_err(s, s_ref):.3g}"
    else:
        assert s is None


CASES: list[tuple[str, Problem, list[int] | None, bool, dict[str, Any]]] = []
for gate in Gate:
    op = {"none": "dn", "scalar": "gdn", "channel": "kda"}[gate.value]
    for layout in ("kv", "vk"):
        for fused in (False, True):
            cfg = {**SEG, "STATE_LAYOUT": layout, "FUSE_OUTPUT": fused}
            tag = f"{op}-{layout}{'-fused' if fused else ''}"
            # odd T (5 chunks: segments of 2, 2, 1 chunks), grouped value heads, K != V
            CASES.append((f"B2-T70-H1-HV2-K16-V32-{tag}", Problem(2, 70, 1, 2, 16, 32, 2, gate), None, True, cfg))
            # packed: long and short sequences, an empty one, a 1-token one; K > V
            p = Problem(1, 0, 1, 2, 32, 16, 5, gate, True)
            CASES.append((f"varlen70-5-0-33-1-K32-V16-{tag}", p, [70, 5, 0, 33, 1], True, cfg))
    CASES.append(
        (f"B1-T70-{op}-noh0-seg1", Problem(1, 70, 1, 1, 16, 16, 1, gate), None, False, {**SEG, "SEG_CHUNKS": 1})
    )
    CASES.append((f"B2-T1-{op}", Problem(2, 1, 1, 1, 16, 16, 2, gate), None, True, SEG))  # one segment: plain pass
    # phase 2 as key tiles through memory (SEG_COMBINE = "tiles"; the cases above run "regs", the default), and
    # "regs" with V tiles of 16 over V = 32 (two programs per head), K != V both ways, packed with an empty sequence
    for combine, bv in (("tiles", 32), ("regs", 16)):
        cfg = {**SEG, "SEG_COMBINE": combine, "seg_BV": bv}
        p = Problem(1, 0, 1, 2, 16, 32, 4, gate, True)
        CASES.append((f"varlen70-0-40-9-K16-V32-{op}-{combine}{bv}", p, [70, 0, 40, 9], True, cfg))
        p = Problem(2, 67, 1, 2, 32, 16, 2, gate)
        CASES.append((f"B2-T67-H1-HV2-K32-V16-{op}-{combine}{bv}", p, None, True, {**cfg, "STATE_LAYOUT": "vk"}))
# phase 1 at its own tile and warps (tr_BV over V = 32 and K = 16: one N tile, one M tile), QK_DIRECT in all phases
for gate in (Gate.NONE, Gate.SCALAR):
    op = {"none": "dn", "scalar": "gdn"}[gate.value]
    cfg = {**SEG, "tr_BV": 32, "tr_num_warps": 2, "QK_DIRECT": True, "STATE_LAYOUT": "vk", "FUSE_OUTPUT": True}
    p = Problem(1, 0, 1, 2, 16, 32, 3, gate, True)
    CASES.append((f"varlen70-0-41-K16-V32-{op}-trBV32-qkdirect", p, [70, 0, 41], True, cfg))
CASES.append(("B2-T70-K16-V32-kda-trBV16-hBV32", Problem(2, 70, 1, 1, 16, 32, 2, Gate.CHANNEL), None, True,
              {**SEG, "h_BV": 32, "tr_BV": 16, "tr_num_warps": 4}))  # fmt: skip
# K = 256: phase 2's "regs" (M_s [K, K] in shared memory up to K = 128) falls back to "tiles"
CASES.append(("B1-T40-K256-V16-dn-regs-fallback", Problem(1, 40, 1, 1, 256, 16, 1, Gate.NONE), None, True, SEG))
# the rows intra variant, BT = 32 and K = V = 48 (padded tiles; M columns over two V-sized tiles)
CASES.append(("B1-T150-K48-V48-kda-rows", Problem(1, 150, 1, 1, 48, 48, 1, Gate.CHANNEL), None, True,
              {"BT": 32, "BC": 16, "INTRA": "rows", "SEG_CHUNKS": 2, "h_BV": 32}))  # fmt: skip


# segments started by burn-in (SEG_START = "burnin", Gated DeltaNet): phase 3 alone, every segmented case above; under
# these mild gates each segment walks back to its sequence's start (exact), under strong ones a chunk or two
CASES += [
    (f"{tag}-burnin", p, lens, h0, {**cfg, "SEG_START": "burnin"})
    for tag, p, lens, h0, cfg in list(CASES)
    if p.gate is Gate.SCALAR and cfg.get("SEG_CHUNKS")
]


@pytest.mark.parametrize(("problem", "seq_lens", "h0", "config"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_segmented_state_pass_matches_loop(
    problem: Problem, seq_lens: list[int] | None, h0: bool, config: dict[str, Any]
) -> None:
    x = make_inputs(problem, seed=31, seq_lens=seq_lens, initial_state=h0, gate_min=-0.1)
    check_loop(problem, x, config)


@pytest.mark.parametrize("gate", [Gate.SCALAR, Gate.CHANNEL], ids=["scalar", "channel"])
def test_segmented_under_strong_gates(gate: Gate) -> None:
    p = Problem(1, 0, 1, 2, 32, 16, 3, gate, True)
    x = make_inputs(p, seed=34, seq_lens=[70, 0, 41], gate_min=-5.0)
    check_loop(p, x, {**SEG, "STATE_LAYOUT": "vk"})


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_segmented_without_final_state(gate: Gate) -> None:
    p = Problem(1, 70, 1, 1, 16, 16, 1, gate)
    x = make_inputs(p, seed=32, gate_min=-0.1)
    check_loop(p, x, SEG, final=False)


def test_segmented_plan_has_the_phases() -> None:
    """Three segments: the transitions and segment-starts launches appear, and the stages alone give the result."""
    p = Problem(1, 70, 1, 2, 16, 32, 1, Gate.CHANNEL)
    x = make_inputs(p, seed=33, gate_min=-0.1)
    cfg = KERNELS["chunk_kda"].check_config(16, 32, {**SEG, "FUSE_OUTPUT": False})
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], "channel", 16**-0.5, x["initial_state"], True, None, cfg)
    stages, (o, s) = chunk_mod.plan(*args)
    assert [st.name for st in stages] == ["intra", "transitions", "segment-starts", "state", "output"]
    assert all(st.flops > 0 and st.bytes > 0 for st in stages)
    for st in stages:
        st.run()
    kw = {"initial_state": x["initial_state"], "output_final_state": True}
    o_ref, s_ref = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert s is not None and s_ref is not None
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_segment_table() -> None:
    """Segments never cross sequences, start on chunk boundaries and keep the global chunk numbering."""
    t = build_tables([0, 70, 75, 75, 108, 109], 1, 109, 16, 2, torch.device("cpu"))
    seg = t.segments
    assert seg is not None and t.NC == 5 + 1 + 0 + 3 + 1
    assert seg.bounds.tolist() == [0, 32, 64, 70, 75, 107, 108, 109]
    assert seg.chunk_offsets.tolist() == [0, 2, 4, 5, 6, 8, 9, 10]
    assert seg.last.tolist() == [-1, -1, 0, 1, -1, 3, 4]
    assert seg.seq_segments.tolist() == [0, 3, 4, 4, 6, 7]
    assert seg.inner_tokens == 32 + 32 + 32
    assert t.chunk_info is not None and t.chunk_info[5].tolist() == [70, 75]
    # no sequence longer than one segment: the plain pass (no segment table)
    assert build_tables([0, 20, 40], 1, 40, 16, 2, torch.device("cpu")).segments is None
    assert build_tables(None, 2, 70, 16, 0, torch.device("cpu")).segments is None
    fixed = build_tables(None, 2, 70, 16, 2, torch.device("cpu")).segments
    assert fixed is not None and fixed.bounds.tolist() == [0, 32, 64, 70, 102, 134, 140]
    assert fixed.chunk_offsets.tolist() == [0, 2, 4, 5, 7, 9, 10]


@pytest.fixture
def representable_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skip's threshold at −40 instead of −104 (kernels.config.SEG_SKIP_LOG), read by the interpreter at run time:
    a skipped transition is then still representable in float32 (about e^-48), so the tests can tell a skip (exact
    zeros) from a computed one."""
    from dtune.kernels.chunk import common

    monkeypatch.setattr(common, "SEG_SKIP_LOG", tl.constexpr(-40.0))


def _captured_scratch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The segment scratch of every forward call from now on (phase 1's ``[N_s | M_s]`` in ``.transitions``)."""
    from dtune.kernels.chunk import pipeline

    got: list[Any] = []
    real = pipeline.allocate_segments

    def capture(call: Any) -> Any:
        got.append(real(call))
        return got[-1]

    monkeypatch.setattr(pipeline, "allocate_segments", capture)
    return got


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_seg_decay_skips_only_negligible_transitions(
    layout: str, monkeypatch: pytest.MonkeyPatch, representable_threshold: None
) -> None:
    """``SEG_DECAY``: three heads, segments of 32 tokens. Head 0 decays by 1.5 per token (its transitions' bound e^-48
    lies below e^-40: skipped, M stored as zeros), head 1 by at most 0.1 (kept), head 2 by 1.5 with keys of norm 3
    (β‖k‖² up to 9: the bound's key factor, up to e^2.1 per token, keeps it). Outputs and final states equal the
    float64 loop's; phase 1's M columns show which transitions were skipped; without SEG_DECAY none is."""
    p = Problem(1, 96, 3, 3, 16, 32, 1, Gate.SCALAR)  # 6 chunks of 16: 3 segments, 2 of them with a transition
    x = make_inputs(p, seed=35, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][..., 0] = -1.5
    x["g"][..., 2] = -1.5
    x["k"][:, :, 2] *= 3.0
    got = _captured_scratch(monkeypatch)
    cfg = {**SEG, "SEG_DECAY": True, "STATE_LAYOUT": layout}
    check_loop(p, x, cfg)
    check_loop(p, x, {**cfg, "SEG_DECAY": False})
    (on, off) = (s.transitions[:2, :, :, p.V :] for s in got)  # [segments with a transition, HV, K, K]
    assert torch.all(on[:, 0] == 0), "head 0's transitions are negligible: stored as zeros"
    assert 0 < off[:, 0].abs().max() < 1e-18, "computed without SEG_DECAY: tiny, not zero"
    for h in (1, 2):
        assert torch.equal(on[:, h], off[:, h]), f"head {h}'s transitions are not negligible: computed"
        assert off[:, h].abs().max() > 0


def test_seg_decay_keeps_nan_gates() -> None:
    """A NaN gate in the second segment fails its bound (NaN compares false): its transition is computed and the NaN
    reaches the outputs from its chunk on, as in the plain pass; the first segment (strong decays) is skipped."""
    p = Problem(1, 96, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=36, gate_min=-5.0)
    assert x["g"] is not None
    x["g"][0, 40, 0] = float("nan")  # chunk 2: segment 1 (tokens 32..63)
    o, s = run(CHUNK[p.gate], x, {**SEG, "SEG_DECAY": True})
    o_plain, _ = run(CHUNK[p.gate], x, {**SEG, "SEG_CHUNKS": 0})
    assert torch.equal(o.isnan(), o_plain.isnan())
    assert o[0, 32:].isnan().all() and not o[0, :32].isnan().any()
    assert s is not None and s.isnan().any()


def test_seg_decay_bound_reads_the_whole_segment(
    monkeypatch: pytest.MonkeyPatch, representable_threshold: None
) -> None:
    """Segments of 256 tokens, the bound read in blocks of 128. Head 0: mild gates (−0.01) in each segment's first
    128 tokens, strong (−0.5) in its last 128: the bound, about −65, skips only if both blocks count. Head 1: −0.2 per
    token (−51 over a segment) with keys of norm 3 in each segment's last 128 tokens (the key factor, up to +2.1 per
    token there, keeps it) and unit keys before."""
    p = Problem(1, 600, 2, 2, 16, 16, 1, Gate.SCALAR)  # segments of 16 chunks of 16: 256, 256, 88 tokens
    x = make_inputs(p, seed=37, gate_min=-0.1)
    assert x["g"] is not None
    late = (torch.arange(600) % 256) >= 128
    x["g"][0, :, 0] = torch.where(late, -0.5, -0.01)
    x["g"][0, :, 1] = -0.2
    x["k"][0, late, 1] *= 3.0
    got = _captured_scratch(monkeypatch)
    cfg = {"BT": 16, "BC": 16, "SEG_CHUNKS": 16, "h_BV": 16, "SEG_DECAY": True}
    check_loop(p, x, cfg)
    check_loop(p, x, {**cfg, "SEG_DECAY": False})
    on, off = (s.transitions[:2, :, :, p.V :] for s in got)
    assert torch.all(on[:, 0] == 0) and off[:, 0].abs().max() > 0
    assert torch.equal(on[:, 1], off[:, 1]) and off[:, 1].abs().max() > 0


def test_seg_decay_at_its_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the real threshold (−104): head 0 decays by 3.5 per token (a segment's bound −112: skipped), head 1 by at most
    0.1 (kept); outputs and final states equal the float64 loop's, and the skipped transitions are zeros where the
    full product's are zero to float32 (under 1e-44)."""
    p = Problem(1, 96, 1, 2, 16, 32, 1, Gate.SCALAR)
    x = make_inputs(p, seed=38, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][..., 0] = -3.5
    got = _captured_scratch(monkeypatch)
    cfg = {**SEG, "SEG_DECAY": True}
    check_loop(p, x, cfg)
    check_loop(p, x, {**cfg, "SEG_DECAY": False})
    on, off = (s.transitions[:2, :, :, p.V :] for s in got)
    assert torch.all(on[:, 0] == 0) and off[:, 0].abs().max() < 1e-44
    assert torch.equal(on[:, 1], off[:, 1]) and off[:, 1].abs().max() > 0


@pytest.mark.parametrize("combine", ["regs", "tiles"])
def test_seg_decay_keeps_a_non_finite_state(combine: str) -> None:
    """An initial state with an inf and a NaN in head 0 (strong gates: every transition skipped): the plain pass carries
    them (0 · inf, NaN) into every later state, and so does the segmented pass, its phase 2's product with the zero
    transitions included (the same NaN pattern in the outputs and the final state)."""
    p = Problem(1, 96, 1, 2, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=39, gate_min=-0.1)
    assert x["g"] is not None and x["initial_state"] is not None
    x["g"][..., 0] = -3.5
    x["initial_state"][0, 0, 3, 5] = float("inf")
    x["initial_state"][0, 0, 7, 9] = float("nan")
    o, s = run(CHUNK[p.gate], x, {**SEG, "SEG_DECAY": True, "SEG_COMBINE": combine})
    o_plain, s_plain = run(CHUNK[p.gate], x, {**SEG, "SEG_CHUNKS": 0})
    assert s is not None and s_plain is not None
    assert torch.equal(o.isnan(), o_plain.isnan()) and o[0, -1, 0].isnan().any()
    assert torch.equal(s.isfinite(), s_plain.isfinite()) and not s[0, 0].isfinite().all()


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_burn_in_under_strong_gates(layout: str) -> None:
    """Burn-in under strong gates (a segment's walk starts a chunk or two before it), varlen with an empty sequence and
    a 1-token one, K != V, grouped heads, fused and unfused output: equal to the float64 loop."""
    p = Problem(1, 0, 2, 4, 32, 16, 5, Gate.SCALAR, True)
    x = make_inputs(p, seed=41, seq_lens=[70, 5, 0, 33, 1], gate_min=-5.0)
    for fused in (True, False):
        check_loop(p, x, {**SEG, "SEG_START": "burnin", "STATE_LAYOUT": layout, "FUSE_OUTPUT": fused})


def test_burn_in_starts_near_the_segment() -> None:
    """What burn-in is: under strong gates a segment's walk starts where the transition up to it is negligible, so a
    NaN in an earlier segment's values does not reach it (it does reach it with phases 1 and 2, and in the plain
    pass: the walk from the sequence's start carries it, times a decay of e^-100 or less). This is why burn-in is
    opt-in and not in the search spaces (docs/parameters.md)."""
    p = Problem(1, 96, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=42, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][...] = -4.0
    x["v"][0, 3, 0, 0] = float("nan")  # the first segment's (tokens 0..31)
    o_burn, _ = run(CHUNK[p.gate], x, {**SEG, "SEG_START": "burnin"})
    o_full, _ = run(CHUNK[p.gate], x, {**SEG, "SEG_START": "transitions"})
    assert o_full[0, 32:, 0, 0].isnan().all() and o_burn[0, 3:32, 0, 0].isnan().any()  # (value channel 0's)
    assert not o_burn[0, 64:].isnan().any(), "the third segment walks from token 32, after the NaN"


def test_burn_in_keeps_a_nan_gate_it_meets() -> None:
    """Burn-in under strong gates with a NaN gate at token 40 (the second segment): the third segment's scan meets it
    in its bound and starts its walk at that chunk, so the NaN reaches its outputs, as in the plain pass."""
    p = Problem(1, 96, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=43, gate_min=-0.1)
    assert x["g"] is not None
    x["g"][...] = -4.0
    x["g"][0, 40, 0] = float("nan")
    o_burn, _ = run(CHUNK[p.gate], x, {**SEG, "SEG_START": "burnin"})
    o_plain, _ = run(CHUNK[p.gate], x, {**SEG, "SEG_CHUNKS": 0})
    assert torch.equal(o_burn.isnan(), o_plain.isnan()) and o_burn[0, 64:].isnan().all()
