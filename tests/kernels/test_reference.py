"""The references agree with each other and with hand-computed steps of docs/DESIGN.md §1."""

from __future__ import annotations

import pytest
import torch
from dtune.kernels.reference import chunk_reference, naive_recurrent

from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

CASES = [
    # (id, problem, seq_lens, chunk_size)
    ("B2-T37-H2-HV4-K24-V40-none-C16", Shape(2, 37, 2, 4, 24, 40, 2, Gate.NONE), None, 16),
    ("B2-T37-H2-HV4-K24-V40-scalar-C16", Shape(2, 37, 2, 4, 24, 40, 2, Gate.SCALAR), None, 16),
    ("B2-T37-H2-HV4-K24-V40-channel-C16", Shape(2, 37, 2, 4, 24, 40, 2, Gate.CHANNEL), None, 16),
    ("B1-T1-H1-HV1-K8-V8-channel-C32", Shape(1, 1, 1, 1, 8, 8, 1, Gate.CHANNEL), None, 32),
    ("B3-T64-H1-HV1-K16-V8-channel-C64", Shape(3, 64, 1, 1, 16, 8, 3, Gate.CHANNEL), None, 64),
    ("varlen-1-16-5-0-9-channel-C8", Shape(1, 0, 2, 2, 16, 12, 5, Gate.CHANNEL, True), [1, 16, 5, 0, 9], 8),
    ("varlen-3-30-scalar-C32", Shape(1, 0, 1, 2, 8, 8, 2, Gate.SCALAR, True), [3, 30], 32),
]


@pytest.mark.parametrize("windows", ["whole", "one-chunk"])
@pytest.mark.parametrize(("problem", "seq_lens", "chunk"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunk_reference_matches_loop(
    problem: Shape, seq_lens: list[int] | None, chunk: int, windows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk form equals the loop; "one-chunk": a working set too small for more than one chunk at a time, every
    sequence computed one chunk after another, the state carried across windows (long prompts at real sizes take
    this path: a T = 128K prompt of 32 heads needs about 70 GB of float64 intermediates at once)."""
    if windows == "one-chunk":
        import dtune.kernels.reference as reference

        monkeypatch.setattr(reference, "WORKING_SET_BYTES", 1)
        assert reference.window_tokens(problem.B, problem.HV, problem.K, problem.V, chunk, torch.float64) == chunk
    x = make_inputs(problem, seed=3, seq_lens=seq_lens)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o_ref, s_ref = naive_recurrent(*args, **kw)
    o, s = chunk_reference(*args, chunk_size=chunk, **kw)
    assert s is not None and s_ref is not None
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(s, s_ref) < 1e-12


def test_loop_follows_the_contract_step_by_step() -> None:
    """Two tokens of KDA by hand: decay -> predict -> correct -> write -> read (not the Hadamard slip)."""
    torch.manual_seed(0)
    K, V = 3, 2
    q, k = torch.randn(1, 2, 1, K), torch.nn.functional.normalize(torch.randn(1, 2, 1, K), dim=-1)
    v, beta = torch.randn(1, 2, 1, V), torch.tensor([[[0.7], [0.4]]])
    g = -torch.rand(1, 2, 1, K) * 3
    S = torch.randn(1, 1, K, V).double()
    o, s_fin = naive_recurrent(q, k, v, g, beta, scale=0.5, initial_state=S.float(), output_final_state=True)
    S = S.float().double()[0, 0]
    for t in range(2):
        S = torch.diag(g[0, t, 0].double().exp()) @ S
        u = beta[0, t, 0].double() * (v[0, t, 0].double() - S.T @ k[0, t, 0].double())
        S = S + torch.outer(k[0, t, 0].double(), u)
        torch.testing.assert_close(o[0, t, 0], S.T @ (0.5 * q[0, t, 0].double()))
    assert s_fin is not None
    torch.testing.assert_close(s_fin[0, 0], S)


def test_beta_one_recalls_the_value_just_written() -> None:
    """With β = 1 and a unit key, reading with the same key returns exactly the value written (delta rule)."""
    p = Shape(1, 5, 1, 1, 8, 4, 1, Gate.NONE)
    x = make_inputs(p, seed=1)
    beta = torch.ones_like(x["beta"])
    o, _ = naive_recurrent(x["k"], x["k"], x["v"], None, beta, scale=1.0, initial_state=x["initial_state"])
    torch.testing.assert_close(o, x["v"].double(), rtol=1e-5, atol=1e-6)  # k is unit norm to float32 rounding


def test_grouped_heads_read_their_group() -> None:
    """HV = 2H: value head hv reads query/key head hv // 2, checked head by head against single-head runs built by
    indexing (not by the reference's own head expansion)."""
    p = Shape(1, 9, 2, 4, 8, 8, 1, Gate.SCALAR)
    x = make_inputs(p, seed=2)
    o, s = naive_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    assert s is not None
    for hv in range(4):
        h = (0, 0, 1, 1)[hv]  # the group, written out
        one = slice(hv, hv + 1)
        o1, s1 = naive_recurrent(
            x["q"][:, :, h : h + 1], x["k"][:, :, h : h + 1], x["v"][:, :, one], x["g"][:, :, one],
            x["beta"][:, :, one], initial_state=x["initial_state"][:, one], output_final_state=True,
        )  # fmt: skip
        assert s1 is not None
        torch.testing.assert_close(o[:, :, one], o1)
        torch.testing.assert_close(s[:, one], s1)
    # reading the wrong group would differ: head 1's values with head 0's keys are not head 1's result
    wrong, _ = naive_recurrent(
        x["q"][:, :, :1], x["k"][:, :, :1], x["v"][:, :, 2:3], x["g"][:, :, 2:3], x["beta"][:, :, 2:3],
        initial_state=x["initial_state"][:, 2:3],
    )  # fmt: skip
    assert not torch.allclose(o[:, :, 2:3], wrong)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_reference_refuses_gates_past_exp_range(dtype: torch.dtype) -> None:
    """A chunk whose cumulative log gate is past what exp(-γ) holds (chunk 16 at -60 a step: -960 nats) would give
    NaN: refused with a ValueError naming chunk_size; a smaller chunk computes it as the loop does."""
    p = Shape(1, 32, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=3)
    x["g"] = x["g"] * 12.0 - 55.0  # every step below -55
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="chunk_size=16"):
        chunk_reference(*args, chunk_size=16, dtype=dtype)
    if dtype is torch.float64:
        o, _ = chunk_reference(*args, chunk_size=4)  # 4 · 115 nats at most
        o_loop, _ = naive_recurrent(*args)
        assert torch.isfinite(o).all() and rel_err(o, o_loop) < 1e-10
    x["g"][0, 5] = float("-inf")  # a full forget: exp(-γ) is inf at any chunk
    with pytest.raises(ValueError, match="chunk_reference"):
        chunk_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=2)


def test_chunk_reference_window_fits_the_working_set() -> None:
    """The window of the T = 128K, 32-head prompt that once ran a search's gate out of an H100's memory (66 GiB of
    float64 intermediates) is a whole number of chunks and its intermediates fit the working set."""
    from dtune.kernels.reference import WORKING_SET_BYTES, window_tokens

    tokens = window_tokens(1, 32, 128, 128, 32, torch.float64)
    assert tokens % 32 == 0 and 32 <= tokens < 131072
    assert 1 * 32 * tokens * (16 * 128 + 4 * 32) * 8 <= WORKING_SET_BYTES
    assert window_tokens(1, 1, 8, 8, 32, torch.float64) >= 131072  # small problems stay one window
