"""Configs for shapes nobody tuned (dtune.borrow): the segmentation rule against the shipped H200 entries, every
shipped bucket hidden in turn, head dims 32 to 256, grouped value heads, packed batches; every adjusted config legal
(the template's check, the search space's constraints, the resource model)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
import torch
from dtune.kernels import KERNELS, get_kernel
from dtune.kernels.chunk.call import check_structure

from dtune.borrow import (
    PROGRAMS_PER_SM,
    STATE_PASS,
    Choice,
    borrow,
    fit_head_dims,
    reverse_pass,
    segment_chunks,
    state_programs,
)
from dtune.gpu import get_profile
from dtune.shape import Gate, Shape
from dtune.store import Entry, TunedConfigs, read_configs
from dtune.tune import resource_model
from dtune.tune.space import load_space

SHIPPED = Path(__file__).resolve().parents[2] / "dtune" / "configs" / "h200.json"
H200 = get_profile("h200")
SMS = H200.sm_count


@pytest.fixture(scope="module")
def h200() -> TunedConfigs:
    return read_configs(SHIPPED)


def forward_chunk(t: TunedConfigs) -> list[Entry]:
    return [e for e in t.entries if get_kernel(e.kernel).family == "chunk" and not get_kernel(e.kernel).backward]


def bucket_shape(kernel: str, b: dict[str, int]) -> Shape:
    """The call a bucket stands for (a bucket of B sequences with T tokens each)."""
    return Shape(b["B"], b["T"], b["H"], b["HV"], b["K"], b["V"], b["B"], Gate(get_kernel(kernel).gate))


def assert_legal(kernel: str, shape: Shape, choice: Choice) -> None:
    """What every adjusted config must be: the template's check, its structure rules, the search space's constraints
    at the shape's bucket, and not dropped by the resource model (heavy spills, shared memory)."""
    spec = get_kernel(kernel)
    full = spec.check_config(shape.K, shape.V, choice.config)
    if spec.family == "chunk" and not spec.backward:
        check_structure(full)
    b = shape.lookup_bucket()
    at_bucket = Shape(b["B"], b["T"], b["H"], b["HV"], b["K"], b["V"], b["B"], shape.gate)
    assert load_space(kernel).violations(full, at_bucket, H200.constraint_fields()) == [], choice.describe()
    pred = resource_model.predict(kernel, full, shape.K, shape.V, "bf16")
    assert resource_model.drop_reason(pred, H200.smem_per_block) is None, choice.describe()


# ---- the segmentation rule ------------------------------------------------------------------------------------------


def test_rule_reproduces_the_shipped_entries(h200: TunedConfigs) -> None:
    """On every shipped forward chunk bucket, the rule (with that entry's BT and h_BV) segments exactly where the search
    did, within a factor 2 of the searched SEG_CHUNKS, equal on most (16 of 20 on the H200 file)."""
    exact = 0
    entries = forward_chunk(h200)
    assert len(entries) >= 20
    for e in entries:
        b, c = e.bucket, e.config
        got = segment_chunks(b["B"], b["HV"], b["V"], b["T"], c["BT"], c["h_BV"], SMS)
        tuned = c["SEG_CHUNKS"]
        assert (got > 0) == (tuned > 0), (e.kernel, b, got, tuned)
        if tuned:
            assert 0.5 <= got / tuned <= 2, (e.kernel, b, got, tuned)
        exact += got == tuned
    assert exact >= 0.75 * len(entries)


def test_programs_per_sm_is_the_median_of_the_shipped_segmented_entries(h200: TunedConfigs) -> None:
    per_sm = []
    for e in forward_chunk(h200):
        b, c = e.bucket, e.config
        if c["SEG_CHUNKS"]:
            segments = math.ceil(math.ceil(b["T"] / c["BT"]) / c["SEG_CHUNKS"])
            per_sm.append(b["B"] * segments * state_programs(1, b["HV"], b["V"], c["h_BV"]) / SMS)
    assert len(per_sm) >= 8
    assert 2 ** round(math.log2(statistics.median(per_sm))) == PROGRAMS_PER_SM


@pytest.mark.parametrize(
    ("N", "HV", "V", "T", "h_BV", "want"),
    [
        (1, 16, 128, 32768, 64, 64),  # 32 programs: 16.5 segments of 1024 chunks -> 62 -> 64
        (2, 16, 64, 16384, 64, 32),  # the D = 64 search's winner (one V tile per head)
        (2, 16, 64, 16384, 32, 64),  # two V tiles per head: half as many segments
        (8, 16, 128, 4096, 64, 0),  # 256 programs fill 132 SMs
        (1, 16, 128, 4096, 64, 0),  # too short to segment
        (1, 1, 16, 8192, 16, 8),  # 1 program would want 528 segments of half a chunk: the searched minimum, 8
        (1, 16, 128, 262144, 64, 256),  # 8192 chunks / 16.5 segments = 496: the searched maximum, 256
        (1, 16, 128, 8192, 128, 8),  # 16 programs: 33 segments of 7.8 chunks -> 8
        (1, 132, 128, 65536, 128, 0),  # exactly one program per SM: off
    ],
    ids=lambda x: str(x),
)
def test_segment_chunks(N: int, HV: int, V: int, T: int, h_BV: int, want: int) -> None:
    assert segment_chunks(N, HV, V, T, 32, h_BV, SMS) == want


# ---- leave one out, and the shapes nobody tuned ---------------------------------------------------------------------


def test_every_shipped_bucket_hidden_gets_a_legal_config_of_its_regime(h200: TunedConfigs) -> None:
    """Hide each shipped bucket (every kernel): the lookup then borrows a legal config, segmented exactly where the
    hidden entry was (forward chunk kernels), or the default where nothing of that kernel is left (the backward's)."""
    for e in h200.entries:
        shape = bucket_shape(e.kernel, e.bucket)
        hidden = h200.without(e.kernel, e.dtype, e.bucket)
        choice = hidden.choose(e.kernel, e.dtype, shape)
        if not any(x.kernel == e.kernel for x in hidden.entries):
            assert choice is None
            continue
        assert choice is not None and choice.match == "borrowed" and choice.bucket != e.bucket
        assert_legal(e.kernel, shape, choice)
        if "SEG_CHUNKS" in e.config:
            assert (choice.config.get("SEG_CHUNKS", 0) > 0) == (e.config["SEG_CHUNKS"] > 0), choice.describe()
    exact = h200.choose(e.kernel, e.dtype, bucket_shape(e.kernel, e.bucket))
    assert exact is not None and exact.match == "exact" and exact.config == e.config  # verbatim


def test_kda_d64_long_prompts_take_a_segmented_state_pass(h200: TunedConfigs) -> None:
    """chunk_kda D = 64, B = 2, T = 16384 (not shipped): the D = 64 T = 4096 entry, unsegmented, ran 1.835 ms on the
    H200 against fla's 1.022; a 112 s search found 0.641 ms with the state pass of the segmented D = 128 entries
    (h_BV 64, "vk", 4 warps, 3 stages) and SEG_CHUNKS 32 (../shared/data/h200-2026-12-01/
    search_kda_B2_T16384_D64.trials.csv, trial 35). The lookup now gives that state pass."""
    shape = Shape(2, 16384, 16, 16, 64, 64, 2, Gate.CHANNEL)
    choice = h200.choose("chunk_kda", "bf16", shape)
    assert choice is not None and choice.match == "borrowed"
    assert choice.bucket == {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 64, "V": 64}  # same K, V first
    assert choice.state_bucket is not None and choice.state_bucket["T"] == 16384 and choice.state_bucket["K"] == 128
    c = choice.config
    assert (c["SEG_CHUNKS"], c["h_BV"], c["STATE_LAYOUT"], c["h_num_warps"], c["h_num_stages"]) == (32, 64, "vk", 4, 3)
    assert c["INTRA"] == "onepass" and c["intra_BK"] == 64  # stage 1 stays the D = 64 entry's
    assert_legal("chunk_kda", shape, choice)
    text = choice.describe()
    # (the D = 64 entry now ships the D = 128 anchor's state pass, the same as the segmented entries' bar its segments:
    # the description names the borrowed state pass only where it differs)
    assert text.startswith("borrowed: h200.json T4096-B8-H16-HV16-K64-V64 (")
    assert (
        "SEG_CHUNKS 0→32 (2 sequence(s) × 16 value heads of 16384 tokens: 32 state-pass programs for 132 SMs)" in text
    )


def test_a_packed_batch_is_looked_up_by_its_sequences_and_mean_length(h200: TunedConfigs) -> None:
    packed = Shape(1, 52640, 16, 16, 128, 128, 16, Gate.SCALAR, varlen=True)  # 16 prompts, mean 3290 tokens
    exact = h200.choose("chunk_gated_delta_rule", "bf16", packed)
    assert exact is not None and exact.match == "exact" and exact.bucket["T"] == 3290 and exact.bucket["B"] == 16
    few_long = Shape(1, 65536, 16, 16, 128, 128, 2, Gate.SCALAR, varlen=True)  # 2 prompts of 32768 tokens on average
    choice = h200.choose("chunk_gated_delta_rule", "bf16", few_long)
    assert choice is not None and choice.match == "borrowed"
    assert choice.config["SEG_CHUNKS"] == segment_chunks(2, 16, 128, 32768, 32, 64, SMS) == 128
    assert_legal("chunk_gated_delta_rule", few_long, choice)
    many_short = Shape(1, 65536, 16, 16, 128, 128, 64, Gate.SCALAR, varlen=True)  # 64 prompts of 1024 tokens
    choice = h200.choose("chunk_gated_delta_rule", "bf16", many_short)
    assert choice is not None and choice.config["SEG_CHUNKS"] == 0


def test_grouped_value_heads_borrow_the_ratio_and_refit_the_segments(h200: TunedConfigs) -> None:
    """HV = 2H at B = 8, T = 4096: only B = 1 T = 32768 is tuned at that ratio (segmented, 64 state-pass programs);
    at B = 8 the plain pass has 512 programs, so no segments, and the state pass of the nearest unsegmented entry."""
    shape = Shape(8, 4096, 16, 32, 128, 128, 8, Gate.SCALAR)
    choice = h200.choose("chunk_gated_delta_rule", "bf16", shape)
    assert choice is not None and choice.bucket["HV"] == 32 and choice.bucket["T"] == 32768
    assert choice.config["SEG_CHUNKS"] == 0 and choice.state_bucket is not None and choice.state_bucket["HV"] == 16
    assert_legal("chunk_gated_delta_rule", shape, choice)
    tuned = h200.choose("chunk_gated_delta_rule", "bf16", Shape(1, 32768, 16, 32, 128, 128, 1, Gate.SCALAR))
    assert tuned is not None and tuned.match == "exact"


def _grid(kernel: str) -> list[Shape]:
    spec = get_kernel(kernel)
    gate = Gate(spec.gate)
    out: list[Shape] = []
    for D in (32, 64, 128, 256):
        if spec.family == "fused_recurrent":
            out += [Shape(B, 1, 16, 16, D, D, B, gate) for B in (1, 32, 256)]
            continue
        out += [Shape(32768 // T, T, 16, 16, D, D, 32768 // T, gate) for T in (1024, 4096, 16384)]
        out += [Shape(1, T, 16, 16, D, D, 1, gate) for T in (8192, 32768, 65536)]
        out += [Shape(8, 4096, 16, 32, D, D, 8, gate), Shape(1, 32768, 16, 32, D, D, 1, gate)]
        out += [Shape(1, 52640, 16, 16, D, D, 16, gate, True), Shape(1, 20000, 4, 8, D, 2 * D, 3, gate, True)]
    return out


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_adjusted_config_is_legal_from_d32_to_d256(h200: TunedConfigs, kernel: str) -> None:
    """The default grid at D = 32, 64, 128, 256 (K != V too), long prompts, HV = 2H, packed: every config the lookup
    builds passes the template's check, the space's constraints and the resource model."""
    for shape in _grid(kernel):
        choice = h200.choose(kernel, "bf16", shape)
        assert choice is not None, shape
        assert_legal(kernel, shape, choice)


def test_head_dims_cut_tiles_and_keep_the_state_tile(h200: TunedConfigs) -> None:
    spec = get_kernel("chunk_kda")
    anchor = h200.choose("chunk_kda", "bf16", bucket_shape("chunk_kda", _b(128)))
    assert anchor is not None and anchor.match == "exact"
    d128 = spec.check_config(128, 128, anchor.config)
    assert d128["intra_BK"] == 128 and d128["h_BV"] == 64 and d128["h_num_stages"] == 3
    down = {c.param: c.new for c in fit_head_dims("chunk_kda", d128, 128, 128, 32, 32)}
    assert down["intra_BK"] == 32 and down["intra_BV"] == 32 and down["h_BV"] == 32  # cut to the padded dim
    assert "o_BK" not in down  # fused output: the output stage's tiles are unused
    up = {c.param: c.new for c in fit_head_dims("chunk_kda", d128, 128, 128, 256, 256)}
    assert up == {"h_BV": 32, "h_num_stages": 1}  # [K, h_BV] state and [BT, K] rows: the donor's size
    assert fit_head_dims("chunk_kda", d128, 128, 128, 100, 100) == []  # same padded dims
    fr = {"BV": 32, "num_warps": 2, "num_stages": 2}
    assert {c.param: c.new for c in fit_head_dims("fused_recurrent_kda", fr, 128, 128, 256, 256)} == {
        "BV": 16,
        "num_stages": 1,
    }
    bwd = get_kernel("chunk_kda_bwd").check_config(128, 128, {"dh_BV": 64, "dqk_BK": 128})
    assert {c.param: c.new for c in fit_head_dims("chunk_kda_bwd", bwd, 128, 128, 64, 64)} == {"dqk_BK": 64}


def _b(D: int, T: int = 4096, B: int = 8) -> dict[str, int]:
    return {"T": T, "B": B, "H": 16, "HV": 16, "K": D, "V": D}


# ---- the donor ------------------------------------------------------------------------------------------------------


def test_same_head_dims_come_before_the_nearest_length() -> None:
    def e(T: int, D: int, SEG: int, **cfg: Any) -> Entry:
        return Entry("chunk_kda", "bf16", _b(D, T, 32768 // T), {"SEG_CHUNKS": SEG, "h_BV": 64, **cfg})

    entries = [e(4096, 64, 0, intra_BK=64), e(16384, 128, 64, intra_BK=128), e(1024, 64, 0, BT=64, BC=32)]
    shape = bucket_shape("chunk_kda", _b(64, 16384, 2))
    choice = borrow(entries, "chunk_kda", "bf16", shape, SMS)
    assert choice is not None and choice.bucket == _b(64, 4096, 8)  # D = 64 at T = 4096, not D = 128 at T = 16384
    assert choice.config["SEG_CHUNKS"] == 32  # 32 programs at h_BV 64: segmented by the rule
    assert borrow(entries, "chunk_kda", "fp32", shape, SMS) is None  # no entry of that dtype: the default
    kept = borrow(entries, "chunk_kda", "bf16", shape, None)  # a GPU without a profile: the donor's SEG_CHUNKS
    assert kept is not None and kept.config["SEG_CHUNKS"] == 0 and kept.changes == ()


def test_the_state_pass_comes_whole_from_one_entry() -> None:
    """When the rule turns segments on for an unsegmented donor, every state-pass parameter comes from the segmented
    entry (not a mix), and the segment-only parameters go back to the template's default when turned off."""
    plain = Entry("chunk_kda", "bf16", _b(64), {"h_BV": 32, "STATE_LAYOUT": "kv", "h_num_stages": 2})
    seg = Entry(
        "chunk_kda", "bf16", _b(128, 16384, 2),
        {"h_BV": 64, "STATE_LAYOUT": "vk", "h_num_stages": 3, "SEG_CHUNKS": 64, "seg_BV": 16, "tr_BV": 64},
    )  # fmt: skip
    on = borrow([plain, seg], "chunk_kda", "bf16", bucket_shape("chunk_kda", _b(64, 16384, 2)), SMS)
    assert on is not None and on.state_bucket == seg.bucket
    full = get_kernel("chunk_kda").check_config(64, 64, on.config)
    want = get_kernel("chunk_kda").check_config(128, 128, seg.config)
    assert {n: full[n] for n in STATE_PASS} == {n: want[n] for n in STATE_PASS}
    off = borrow([seg], "chunk_kda", "bf16", bucket_shape("chunk_kda", _b(128)), SMS)  # B = 8: fills the GPU
    assert off is not None and off.config["SEG_CHUNKS"] == 0
    assert (off.config["seg_BV"], off.config["tr_BV"]) == (32, 0)  # unused without segments: the defaults


# ---- borrowed configs compute the right answer ----------------------------------------------------------------------

BORROWED_CASES = {
    # kernel, the call's shape (the lookup's key), the small shape it runs at here
    "kda-D64-T16384-segmented": ("chunk_kda", Shape(2, 16384, 16, 16, 64, 64, 2, Gate.CHANNEL), (64, 64, 1)),
    "kda-D256-B8": ("chunk_kda", Shape(8, 4096, 16, 16, 256, 256, 8, Gate.CHANNEL), (256, 256, 1)),
    "gdn-HV2H-D32": ("chunk_gated_delta_rule", Shape(8, 4096, 16, 32, 32, 32, 8, Gate.SCALAR), (32, 32, 2)),
    "dn-K64-V128-long": ("chunk_delta_rule", Shape(1, 65536, 16, 16, 64, 128, 1, Gate.NONE), (64, 128, 1)),
    "fr-kda-D256-B1": ("fused_recurrent_kda", Shape(1, 1, 16, 16, 256, 256, 1, Gate.CHANNEL), (256, 256, 1)),
}


@pytest.mark.parametrize("name", sorted(BORROWED_CASES))
def test_borrowed_configs_pass_the_gate(h200: TunedConfigs, name: str) -> None:
    """Configs the lookup builds for untuned shapes (other head dims, K != V, HV = 2H, segmented) run right: the
    search's correctness gate (strong decays, both states, the packed edge case) in fp32 under the interpreter, on a
    short odd-length sequence with SEG_CHUNKS cut to one chunk so that a segmented state pass runs its phases here."""
    from dtune.tune.gate import gate

    kernel, call, (K, V, ratio) = BORROWED_CASES[name]
    choice = h200.choose(kernel, "bf16", call)
    assert choice is not None and choice.match == "borrowed", name
    spec = get_kernel(kernel)
    cfg = spec.check_config(K, V, choice.config)
    if cfg.get("SEG_CHUNKS"):
        cfg["SEG_CHUNKS"] = 1
    T = 3 * int(cfg.get("BT", 16)) + 5 if spec.family == "chunk" else 1
    p = Shape(1, T, 1, ratio, K, V, 1, Gate(spec.gate))
    result = gate(spec, p, torch.float32, "cpu", cfg, load_space(kernel).tolerance["fp32"], edge=spec.family == "chunk")
    assert result.passed, f"{choice.describe()}: {result.reason}"


@pytest.mark.gpu
def test_borrowed_configs_are_right_in_bf16_at_real_sizes(h200: TunedConfigs) -> None:
    """On a GPU, bf16, at the shapes themselves: every borrowed config above against the float64 chunked reference,
    within the bf16 gate tolerance (benchmarks/leave_one_out.py checks every shipped bucket's leave-one-out config
    the same way, ``err_lookup``)."""
    from dtune.kernels.reference import chunk_reference

    from dtune.measure.error import rel_rms_error
    from dtune.measure.inputs import make_inputs
    from dtune.ops import run_kernel

    for kernel, p, _ in BORROWED_CASES.values():
        choice = h200.choose(kernel, "bf16", p)
        assert choice is not None and choice.match == "borrowed"
        x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=3, gate_min=-5.0)
        x.pop("cu_seqlens")
        o, _ = run_kernel(kernel, **x, output_final_state=True, config=choice.config, check_gate=False)
        ref, _ = chunk_reference(**x, scale=p.K**-0.5, output_final_state=False, dtype=torch.float64)
        err = rel_rms_error(o, ref)
        assert err < load_space(kernel).tolerance["bf16"], f"{kernel} {p.key}: {err:.2e} ({choice.describe()})"


def test_reverse_pass_follows_the_shape() -> None:
    """The backward's reverse pass borrowed: segments off for many or short sequences, on (64 chunks) for one long one
    whose plain pass leaves SMs idle, always at least two per sequence; the transposed layout only on 64 value rows."""
    seg64 = {"BT": 64, "dh_BV": 128, "dh_LAYOUT": "vk", "dh_SEG_CHUNKS": 64}
    plain = {**seg64, "dh_SEG_CHUNKS": 0}
    b8 = {"B": 8, "T": 4096}
    b1 = {"B": 1, "T": 32768}
    assert reverse_pass(seg64, b8, 16, 128, 132) == {"dh_SEG_CHUNKS": (0, ANY)}  # 4096 tokens: never segmented
    assert reverse_pass(seg64, {"B": 16, "T": 16384}, 16, 128, 132)["dh_SEG_CHUNKS"][0] == 0  # 256 programs fill it
    assert reverse_pass(plain, b1, 16, 128, 132) == {"dh_SEG_CHUNKS": (64, ANY)}
    assert reverse_pass(seg64, b1, 16, 128, 132) == {}
    assert reverse_pass({**seg64, "dh_SEG_CHUNKS": 256}, {"B": 1, "T": 8192}, 16, 128, 132)["dh_SEG_CHUNKS"][0] == 64
    assert reverse_pass(seg64, b1, 16, 128, None) == {}  # no GPU facts: the donor's, where it splits
    assert reverse_pass({**plain, "dh_BV": 32}, b8, 16, 32, 132) == {"dh_LAYOUT": ("kv", ANY)}
    assert reverse_pass({**plain, "dh_LAYOUT": "kv", "dh_BV": 32}, b8, 16, 32, 132) == {}
    # the decay-driven skip of phase 1 is unused without segments: its default (off) there
    assert reverse_pass({**seg64, "dh_SEG_DECAY": True}, b8, 16, 128, 132)["dh_SEG_DECAY"] == (False, "no segments")
    assert reverse_pass({**seg64, "dh_SEG_DECAY": True}, b1, 16, 128, 132) == {}


def test_reverse_pass_keeps_the_donors_programs() -> None:
    """A segmented donor's segment length scaled to the shape's sequences x value heads: the donor (B1 T32768 HV16,
    64-chunk segments: 8 segments x 16 heads = 128 programs) gives HV 32 segments of 128 chunks, a 65536-token prompt
    128, two sequences of 16384 tokens 64, one of 8192 tokens 16; the same bucket keeps its own."""
    seg64 = {"BT": 64, "dh_BV": 128, "dh_LAYOUT": "vk", "dh_SEG_CHUNKS": 64}
    donor = {"B": 1, "T": 32768, "HV": 16}

    def seg(target: dict[str, int], HV: int) -> int:
        return reverse_pass(seg64, target, HV, 128, 132, donor).get("dh_SEG_CHUNKS", (64,))[0]

    assert seg({"B": 1, "T": 32768}, 32) == 128
    assert seg({"B": 1, "T": 32768}, 16) == 64
    assert seg({"B": 1, "T": 65536}, 16) == 128
    assert seg({"B": 2, "T": 16384}, 16) == 64
    assert seg({"B": 1, "T": 8192}, 16) == 16
    assert seg({"B": 1, "T": 32768}, 8) == 32  # tensor parallelism: half the heads, segments half as long
    assert seg({"B": 1, "T": 32768}, 64) == 256  # four times the heads: the longest segment the spaces try
