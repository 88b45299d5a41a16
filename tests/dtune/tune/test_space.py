from __future__ import annotations

from pathlib import Path

import pytest
from dtune.kernels import get_kernel

from dtune import _toml as toml
from dtune.gpu import get_profile
from dtune.shape import Shape
from dtune.tune.space import SpaceError, load_space, load_space_file, parse_space, shipped_spaces

FUSED = ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]
CHUNK = ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda"]

GOOD = """
kernel = "fused_recurrent_kda"
description = "test"
[params]
BV = [8, 16, 32]
num_warps = [1, 2, 4]
[constraints]
bv_le_v = "BV <= max(8, next_power_of_2(V))"
smem = "num_warps * 1024 <= smem_per_block and cc_major >= 0"
[seeds]
configs = [ { BV = 16, num_warps = 2 } ]
[tolerance]
fp32 = 1e-4
fp16 = 5e-3
bf16 = 2e-2
[shapes]
seq_lens = [1, 64]
head_dims = [64, 128]
heads = [16]
batch = [1, 32]
"""


def parse(text: str) -> object:
    return parse_space(toml.loads(text), "test.toml")


@pytest.mark.parametrize("kernel", FUSED)
def test_shipped_spaces_are_legal(kernel: str) -> None:
    assert kernel in shipped_spaces()
    space = load_space(kernel)
    legal = get_kernel(kernel).legal_params()
    assert space.kernel == kernel and space.size() > 1
    for name, choices in space.params.items():
        assert set(choices) <= set(legal[name])
    assert set(space.tolerance) == {"fp32", "fp16", "bf16"}
    shapes = space.shapes.shapes()
    assert {s.T for s in shapes} == {1, 64}
    # the default config of every default shape satisfies the constraints (the baseline is never pruned)
    h100 = get_profile("h100").constraint_fields()
    for s in shapes:
        assert space.violations(get_kernel(kernel).default_config(s.K, s.V), s, h100) == []


@pytest.mark.parametrize("kernel", CHUNK)
def test_chunk_seeds_build_and_reach_their_shapes(kernel: str) -> None:
    """Every seed of a chunk space is a buildable config (legal values, structure); the default is never pruned on
    the default grid; at one long prompt (B = 1, T = 32768, H = 16, D = 128) the segmented seeds survive the
    constraints, at B = 8, T = 4096 they are pruned (seg_underfilled), so they cost the grid no trials."""
    from dtune.kernels.chunk.call import check_structure

    space, spec = load_space(kernel), get_kernel(kernel)
    h200 = get_profile("h200").constraint_fields()
    for s in space.shapes.shapes():
        assert space.violations(spec.default_config(s.K, s.V), s, h200) == []
    alive: dict[int, list[dict]] = {}
    for B, T in ((1, 32768), (8, 4096)):
        shape = Shape(B, T, 16, 16, 128, 128)
        default = spec.default_config(128, 128)
        configs = [spec.check_config(128, 128, {**default, **seed}) for seed in space.seeds]
        for cfg in configs:
            check_structure(cfg)
        alive[B] = [c for c in configs if not space.violations(c, shape, h200)]
    assert any(c["SEG_CHUNKS"] > 0 for c in alive[1])
    assert all(c["SEG_CHUNKS"] == 0 or c["h_BV"] == 128 for c in alive[8])


def test_good_space_and_constraints() -> None:
    space = parse(GOOD)
    shape = Shape(B=1, T=1, H=16, HV=16, K=64, V=64)
    gpu = get_profile("h100").constraint_fields()
    assert space.violations({"BV": 32, "num_warps": 4, "num_stages": 1}, shape, gpu) == []
    small = Shape(B=1, T=1, H=16, HV=16, K=16, V=4)
    assert space.violations({"BV": 32, "num_warps": 4, "num_stages": 1}, small, gpu) == ["bv_le_v"]
    tiny_gpu = {**gpu, "smem_per_block": 2048}
    assert space.violations({"BV": 8, "num_warps": 4, "num_stages": 1}, shape, tiny_gpu) == ["smem"]
    assert len(space.shapes.shapes()) == 2 * 2 * 1 * 2
    assert space.shapes.shapes()[0].key == "T1-B1-H16-HV16-K64-V64"


def test_batch_tokens_grid() -> None:
    text = GOOD.replace("batch = [1, 32]", "batch_tokens = 128")
    shapes = parse(text).shapes.shapes()  # type: ignore[attr-defined]
    assert {(s.T, s.B) for s in shapes} == {(1, 128), (64, 2)}


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ("BV = [8, 16, 32]", "BQ = [8]", "'BQ' is not a parameter of the"),
        ("BV = [8, 16, 32]", "BV = [8, 24]", "BV = 24 is not legal"),
        ("BV = [8, 16, 32]", "BV = []", "non-empty list"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', 'bv_le_v = "BV <="', "not a valid expression"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', "bv_le_v = \"__import__('os')\"", "only next_power_of_2"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', 'bv_le_v = "BV.__class__ == 1"', "Attribute"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', 'bv_le_v = "BV ** 99 > 1"', "Pow"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', 'bv_le_v = "[x for x in (1,)]"', "ListComp"),
        ('bv_le_v = "BV <= max(8, next_power_of_2(V))"', 'bv_le_v = "BV <= VV"', "unknown 'VV'"),
        ("configs = [ { BV = 16, num_warps = 2 } ]", "configs = [ { BV = 64 } ]", "not among the choices"),
        ('kernel = "fused_recurrent_kda"', 'kernel = "nope"', "unknown kernel 'nope'"),
        ("fp16 = 5e-3", "", r"\[tolerance\] lacks \['fp16'\]"),
        ("fp16 = 5e-3", "fp16 = 2.0", "fp16 must be a number in"),
        ("[shapes]", "[accuracy]\nbf16 = 0.9\n[shapes]", r"\[accuracy\] bf16 must be a ratio of at least 1"),
        ("[shapes]", "[accuracy]\nfp8 = 1.2\n[shapes]", r"\[accuracy\] names unknown dtype 'fp8'"),
        ("batch = [1, 32]", "", "exactly one of batch"),
        ("seq_lens = [1, 64]", "seq_lens = [0]", "positive integers"),
    ],
    ids=[
        "unknown-param",
        "illegal-value",
        "empty-choices",
        "bad-syntax",
        "unsafe-call",
        "attribute",
        "pow",
        "comprehension",
        "unknown-name",
        "seed-outside",
        "unknown-kernel",
        "tolerance-missing-dtype",
        "tolerance-range",
        "accuracy-below-1",
        "accuracy-dtype",
        "no-batch",
        "bad-seq-len",
    ],
)
def test_bad_spaces(old: str, new: str, match: str) -> None:
    assert old in GOOD
    with pytest.raises(SpaceError, match=match):
        parse(GOOD.replace(old, new))


def test_accuracy_ratios() -> None:
    assert parse_space(toml.loads(GOOD)).accuracy == {}  # optional: no criterion
    space = parse_space(toml.loads(GOOD.replace("[shapes]", "[accuracy]\nbf16 = 1.15\nfp16 = 1\n[shapes]")))
    assert space.accuracy == {"bf16": 1.15, "fp16": 1.0}


@pytest.mark.parametrize("kernel", sorted(shipped_spaces()))
def test_shipped_accuracy_ratios_fail_a_config_1_3x_worse(kernel: str) -> None:
    """Every shipped space bounds 16-bit configs to less than 1.3x the default's error (and fp32 by tolerance only)."""
    accuracy = load_space(kernel).accuracy
    assert set(accuracy) == {"bf16", "fp16"} and all(1.0 <= r < 1.3 for r in accuracy.values())


def test_empty_space_and_missing_tolerance() -> None:
    start, end = GOOD.index("[params]"), GOOD.index("[constraints]")
    with pytest.raises(SpaceError, match="empty search space"):
        parse(GOOD[:start] + "[params]\n" + GOOD[end:].replace("configs = [ { BV = 16, num_warps = 2 } ]", ""))
    start, end = GOOD.index("[tolerance]"), GOOD.index("[shapes]")
    with pytest.raises(SpaceError, match=r"missing \[tolerance\]"):
        parse(GOOD[:start] + GOOD[end:])


def test_space_files(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(GOOD)
    assert load_space_file(path).source == str(path)
    path.write_text("kernel = [")
    with pytest.raises(SpaceError, match="not valid TOML"):
        load_space_file(path)
    with pytest.raises(SpaceError, match="cannot read"):
        load_space_file(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="unknown kernel"):
        load_space("nope")


CHUNK = ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda"]


@pytest.mark.parametrize("kernel", CHUNK)
def test_chunk_spaces_map_every_stage(kernel: str) -> None:
    """The stage map is data: the chunk spaces name each stage's own parameters and its launches."""
    space = load_space(kernel)
    assert space.stages.names() == ["intra", "state", "output"]
    assert space.stages.coupling(space.params)[:2] == ["BT", "BC"]
    assert {"INTRA", "FUSE_OUTPUT", "STATE_LAYOUT"} <= set(space.stages.coupling(space.params))
    assert space.stages.stage_of("h_BV") == "state" and space.stages.stage_of("o_num_warps") == "output"
    assert space.stages.stage_of_launch("state+output") == "state"
    assert space.stages.stage_of_launch("transitions") == "state"  # the sequence-parallel pass's phase 1
    assert space.stages.stage_of_launch("a-new-launch") == "a-new-launch"  # unmapped: a stage of its own
    assert space.stages.group(["intra", "state", "output"]) == {
        "intra": ["intra"],
        "state": ["state"],
        "output": ["output"],
    }
    assert load_space("fused_recurrent_kda").stages.names() == []  # one launch: no stage map


@pytest.mark.parametrize("kernel", [k + "_bwd" for k in CHUNK])
def test_backward_spaces_map_the_training_step(kernel: str) -> None:
    """The backward's stages are the training step's launches (plan_step): the forward under autograd's two, the
    reverse pass, the dv stage, the dq/dk stage with the launches it shapes; what changes what is saved couples."""
    space = load_space(kernel)
    assert space.stages.names() == ["intra", "state", "reverse", "dv", "dqk"]
    assert space.stages.coupling(space.params)[:5] == ["BT", "BC", "SAVE", "FUSE_DV", "REVERSE_DV"]
    assert space.stages.stage_of("dh_SEG_CHUNKS") == "reverse" and space.stages.stage_of("fh_TMA") == "state"
    assert space.stages.stage_of("fi_num_warps") == "intra" and space.stages.stage_of("dqk_BK") == "dqk"
    assert space.stages.group(["fwd-intra", "fwd-state", "re-state", "reverse", "dqk", "finish"]) == {
        "intra": ["fwd-intra"],
        "state": ["fwd-state", "re-state"],
        "reverse": ["reverse"],
        "dqk": ["dqk", "finish"],
    }


STAGED = (
    GOOD
    + """
[stages]
tiles = { params = ["BV"], launches = ["main"] }
"""
)


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ('params = ["BV"]', 'params = ["BQ"]', "not a parameter of the space"),
        ('params = ["BV"]', "params = []", "non-empty list of parameter names"),
        ('launches = ["main"]', "launches = []", "non-empty list of launch names"),
        ('launches = ["main"] }', 'launches = ["main"], warps = 1 }', "must be a table with"),
        (
            'tiles = { params = ["BV"], launches = ["main"] }',
            'a = { params = ["BV"] }\nb = { params = ["BV"] }',
            "listed by both 'a' and 'b'",
        ),
        (
            'tiles = { params = ["BV"], launches = ["main"] }',
            'a = { params = ["BV"], launches = ["x"] }\nb = { params = ["num_warps"], launches = ["x"] }',
            "launch 'x' is claimed by both",
        ),
    ],
    ids=["unknown-param", "empty-params", "empty-launches", "unknown-key", "param-twice", "launch-twice"],
)
def test_bad_stage_maps(old: str, new: str, match: str) -> None:
    assert parse(STAGED).stages.names() == ["tiles"]  # type: ignore[attr-defined]
    assert old in STAGED
    with pytest.raises(SpaceError, match=match):
        parse(STAGED.replace(old, new))
