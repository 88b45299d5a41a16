"""The models of ``dtune/models.toml`` (dtune.tune.models) and their plan (``dtune tune-gpu --models``): heads per
tensor-parallel degree, the calls each kernel is tuned for, the packed batch, the interpreter's tiny plan, and the
file's problems named."""

from __future__ import annotations

import pytest

from dtune.shape import Gate
from dtune.tune import grid, models
from dtune.tune.transfer import bucket_distance

GOOD = """
[models.m]
family = "gated_delta_rule"
layer = "GatedDeltaNet"
hidden_size = 64
heads = 4
v_heads = 8
head_dim = 32

[buckets]
tensor_parallel = [1, 4]
prefill_seq_lens = [100, 300]
packed_prefill = [5, 7]
train_tokens = 64
train_seq_len = 16
decode_batch = [1, 3]
"""


def test_the_shipped_models_are_qwen3_next_and_kimi_linear_with_their_heads() -> None:
    data = models.load()
    qwen, kimi = data.get(["qwen3_next", "kimi_linear"])
    assert (qwen.heads, qwen.v_heads, qwen.head_dim, qwen.family) == (16, 32, 128, "gated_delta_rule")
    assert (kimi.heads, kimi.v_heads, kimi.head_dim, kimi.family) == (32, 32, 128, "kda")
    assert qwen.heads_at(8) == (2, 4) and kimi.heads_at(8) == (4, 4)
    assert kimi.kernels == ("chunk_kda", "chunk_kda_bwd", "fused_recurrent_kda")
    assert [m.name for m in data.get(["all"])] == ["qwen3_next", "kimi_linear"]
    assert data.calls.tensor_parallel == (1, 2, 4, 8) and data.calls.train_batch == 8


def test_each_kernel_gets_its_calls_at_every_degree() -> None:
    data = models.load(GOOD)
    (m,) = data.get(["m"])
    plain, packed = data.shapes(m, "chunk_gated_delta_rule", (1, 4), Gate.SCALAR)
    # prefill B = 1 at each length, the training step's forward at B = 64 / 16; heads 4 / 8 and 1 / 2
    assert [s.key for s in plain] == [
        "T100-B1-H4-HV8-K32-V32", "T300-B1-H4-HV8-K32-V32", "T16-B4-H4-HV8-K32-V32",
        "T100-B1-H1-HV2-K32-V32", "T300-B1-H1-HV2-K32-V32", "T16-B4-H1-HV2-K32-V32",
    ]  # fmt: skip
    assert all(s.gate == Gate.SCALAR for s in plain)
    assert [(s.B, s.N, s.T, s.H, s.HV) for s in packed] == [(2, 2, 6, 4, 8), (2, 2, 6, 1, 2)]  # as cu_seqlens look up
    bwd, none = data.shapes(m, "chunk_gated_delta_rule_bwd", (1,), Gate.SCALAR)
    assert [s.key for s in bwd] == ["T16-B4-H4-HV8-K32-V32"] and none == []
    dec, _ = data.shapes(m, "fused_recurrent_gated_delta_rule", (4,), Gate.SCALAR)
    assert [s.key for s in dec] == ["T1-B1-H1-HV2-K32-V32", "T1-B3-H1-HV2-K32-V32"]
    assert data.shapes(m, "chunk_kda", (1,), Gate.CHANNEL) == ([], [])  # not the model's family


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (("heads = 4", "heads = 3"), "v_heads 8 is not a multiple of heads 3"),
        (("tensor_parallel = [1, 4]", "tensor_parallel = [1, 8]"), "4 heads do not divide by the tensor-parallel"),
        (('family = "gated_delta_rule"', 'family = "mamba"'), "family 'mamba' is not one of"),
        (("head_dim = 32", "head_dim = 0"), "head_dim must be a positive integer"),
        (("hidden_size = 64\n", ""), r"\[models.m\] must have exactly"),
        (("decode_batch = [1, 3]", "decode_batch = [1, -3]"), "decode_batch must be a list of positive"),
        (("tensor_parallel = [1, 4]", "tensor_parallel = []"), "tensor_parallel must be a list"),
        (("train_seq_len = 16", "train_seq_len = 1.5"), "train_seq_len must be a positive integer"),
        (("train_tokens = 64\n", ""), r"\[buckets\] must have exactly"),
        (("[buckets]", "[bucket]"), "expected the tables"),
        (("heads = 4", "heads = "), "not valid TOML"),
    ],
)
def test_a_bad_models_file_names_the_problem(edit: tuple[str, str], match: str) -> None:
    assert edit[0] in GOOD
    with pytest.raises(ValueError, match=match):
        models.load(GOOD.replace(*edit, 1))


def test_an_unknown_model_or_degree_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model llama: dtune/models\.toml has qwen3_next, kimi_linear"):
        grid.model_plan(["llama"], None, {})
    with pytest.raises(ValueError, match="32 heads do not divide by the tensor-parallel degree 3"):
        grid.model_plan(["kimi_linear"], None, {"chunk_kda": "bf16"}, degrees=[3])
    with pytest.raises(ValueError, match="none of chunk_delta_rule is called by kimi_linear"):
        grid.model_kernels(["kimi_linear"], ["chunk_delta_rule"])
    with pytest.raises(ValueError, match="--budget"):
        grid.model_plan(["kimi_linear"], None, {}, budget=0)


def test_the_model_plan_tunes_every_call_of_every_degree_nearest_first() -> None:
    kernels = grid.model_kernels(["all"])
    assert kernels == [
        "chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda",
        "chunk_gated_delta_rule_bwd", "chunk_kda_bwd",
    ]  # fmt: skip
    plan = grid.model_plan(["all"], kernels, dict.fromkeys(kernels, "bf16"), budget=90)
    steps = {(s.kernel, s.name): s for s in plan.steps}
    kda = steps["chunk_kda", "kimi_linear"]
    # 4 degrees x (3 prompts + the training step's forward), heads 32 / 16 / 8 / 4
    assert len(kda.buckets) == 16 and {b.shape.H for b in kda.buckets} == {32, 16, 8, 4}
    assert "T131072-B1-H4-HV4-K128-V128" in {b.shape.key for b in kda.buckets} and kda.seconds == round(90 * 0.34)
    anchor = grid.anchor_shape(grid.load_space("chunk_kda"), [], Gate.CHANNEL)
    distances = [bucket_distance(b.shape, anchor.bucket()) for b in kda.buckets]
    assert distances == sorted(distances)
    packed = steps["chunk_gated_delta_rule", "qwen3_next-packed"]
    assert [b.shape.HV // b.shape.H for b in packed.buckets] == [2] * 4 and packed.packed is not None
    assert sum(packed.packed) == 17252 and all(b.key.endswith(":packed") for b in packed.buckets)
    bwd = steps["chunk_gated_delta_rule_bwd", "qwen3_next"]
    assert bwd.buckets[0].shape.key == "T4096-B8-H16-HV32-K128-V128" and len(bwd.buckets) == 4
    assert len(steps["fused_recurrent_kda", "kimi_linear"].buckets) == 12
    assert len(plan.buckets()) == 72
    only = grid.model_plan(["qwen3_next"], ["chunk_gated_delta_rule_bwd"], {"chunk_gated_delta_rule_bwd": "bf16"},
                           degrees=[1, 8])  # fmt: skip
    assert [b.shape.key for b in only.buckets()] == ["T4096-B8-H16-HV32-K128-V128", "T4096-B8-H2-HV4-K128-V128"]


def test_the_interpreter_model_plan_keeps_the_grouped_heads_at_tiny_shapes() -> None:
    plan = grid.model_plan(["qwen3_next"], ["chunk_gated_delta_rule"], {"chunk_gated_delta_rule": "fp32"}, 10,
                           interpret=True)  # fmt: skip
    plain, packed = plan.steps
    assert {b.shape.key for b in plain.buckets} == {"T20-B1-H1-HV2-K16-V16", "T9-B2-H1-HV2-K16-V16"}
    assert [b.packed for b in packed.buckets] == [grid.TINY_PACKED] and packed.buckets[0].shape.HV == 2
