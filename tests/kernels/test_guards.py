"""The kernel tests' guard regions (dtune.kernels.config.GUARDS, on for every test: tests/conftest.py): a store
outside an output buffer, before or after it, is named instead of corrupting memory; stores inside it are not."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dtune.kernels.config as kernel_config
import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _fill_range(o, start, n, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    tl.store(o + offs, tl.full([BLOCK], 1.0, tl.float32), mask=offs < start + n)


@contextmanager
def own_guards() -> Iterator[list[kernel_config.Guarded]]:
    """Guards of this block alone (the test's own stay clean, so the harness does not fail the test itself)."""
    outer, mine = kernel_config.GUARDS, []
    kernel_config.GUARDS = mine
    try:
        yield mine
    finally:
        kernel_config.GUARDS = outer


@pytest.mark.parametrize(
    ("start", "extra", "where"),
    [(0, 0, None), (0, 1, "after"), (-1, 1, "before"), (-3, 6, "before and after")],
    ids=["inside", "one-past", "one-before", "both"],
)
def test_stores_outside_an_output_are_named(start: int, extra: int, where: str | None) -> None:
    with own_guards() as guards:
        o = kernel_config.new_output(3, 5, 7, dtype=torch.float32, device=torch.device("cpu"))
        _fill_range[(1,)](o, start, o.numel() + extra, BLOCK=128)
    expected = [] if where is None else [f"[3, 5, 7] torch.float32 ({where})"]
    assert kernel_config.touched_guards(guards) == expected
    inside = o.view(-1)[max(start, 0) : start + o.numel() + extra]
    assert (inside == 1.0).all()  # the output itself is the buffer the kernel wrote


def test_guards_off_allocate_plainly() -> None:
    with own_guards():
        kernel_config.GUARDS = None
        o = kernel_config.new_output(4, 8, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert o.storage_offset() == 0 and o.untyped_storage().nbytes() == o.numel() * o.element_size()


def test_outputs_stay_aligned_and_untouched_ones_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_config, "KEEP_GUARDS", 4)
    with own_guards() as guards:
        for n in (1, 3, 100, 70000, 5, 6):
            o = kernel_config.new_output(n, dtype=torch.float16, device=torch.device("cpu"))
            assert o.data_ptr() % 16 == 0 and o.is_contiguous() and o.shape == (n,)
        assert len(guards) <= 4 and not kernel_config.touched_guards(guards)
