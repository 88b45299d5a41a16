"""kernels/interpreter.py: under Triton's interpreter a jit helper called inside a kernel reuses the kernel's language
swap instead of redoing it per call, and a helper that needs a swap the kernel's did not cover still gets it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from dtune.kernels import interpreter

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="the interpreter's path (TRITON_INTERPRET=1)"
)


@triton.jit
def _scaled(x, s: tl.constexpr):
    return x * s


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros([N], dtype=tl.float32)
    for i in tl.static_range(CALLS):
        acc += _scaled(x, i + 1)
    tl.store(out_ptr + offs, acc)
    tl.store(out_ptr + N + offs, tl.sum(acc, axis=0) + tl.zeros([N], dtype=tl.float32))


def test_helpers_reuse_the_kernels_language_swap() -> None:
    assert interpreter.installed()  # by the kernels' import under the interpreter
    x = torch.randn(16)
    out = torch.empty(32)
    before = dict(interpreter.COUNTS)
    _helpers_kernel[(2,)](x, out, N=16, CALLS=12)
    swapped = interpreter.COUNTS["swapped"] - before["swapped"]
    skipped = interpreter.COUNTS["skipped"] - before["skipped"]
    expect = x * sum(range(1, 13))
    torch.testing.assert_close(out[:16], expect)
    torch.testing.assert_close(out[16:], expect.sum().expand(16))
    # per program: the kernel's own swap and tl.sum's first (it sees triton.language.core); twelve _scaled calls, two
    # tl.zeros and later tl.sum calls reuse them
    assert swapped <= 2 * 2, (swapped, skipped)
    assert skipped >= 2 * 12, (swapped, skipped)


def test_a_helper_over_other_language_modules_is_still_swapped() -> None:
    """tl.sum lives in a module that sees triton.language.core, not triton.language: in a fresh process (where no
    earlier swap left core patched) a kernel whose module sees only triton.language must still run it."""
    code = textwrap.dedent(
        """
        import torch, triton, triton.language as tl
        import dtune.kernels
        from dtune.kernels import interpreter
        assert interpreter.install()

        @triton.jit
        def k(x_ptr, out_ptr, N: tl.constexpr):
            offs = tl.arange(0, N)
            tl.store(out_ptr + offs, tl.sum(tl.load(x_ptr + offs), axis=0) + tl.zeros([N], dtype=tl.float32))

        x = torch.randn(8)
        out = torch.empty(8)
        k[(1,)](x, out, N=8)
        torch.testing.assert_close(out, x.sum().expand(8))
        print("ok", interpreter.COUNTS["swapped"])
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "ok"


def test_block_types_are_kept_one_per_element_type_and_shape() -> None:
    """The interpreter's type objects, memoised by install(): the same object for the same element type and shape
    (constexpr dims or ints), another for any other; a bad shape still raises and is not kept."""
    bt = tl.core.block_type
    a = bt(tl.float32, [16, 32])
    assert bt(tl.float32, [tl.constexpr(16), 32]) is a
    assert (a.shape, a.numel, a.element_ty) == ((16, 32), 512, tl.float32)
    for other in (bt(tl.float16, [16, 32]), bt(tl.float32, [32, 16]), bt(tl.float32, [16, 32, 1])):
        assert other is not a and other != a
    assert bt(tl.pointer_type(tl.float32), [16]).element_ty == tl.pointer_type(tl.float32)
    assert bt(tl.pointer_type(tl.float16), [16]) is not bt(tl.pointer_type(tl.float32), [16])
    with pytest.raises(TypeError, match="0d"):
        bt(tl.float32, [])
    with pytest.raises(TypeError, match="0d"):
        bt(tl.float32, [])  # raised again: the failed object was never kept


def test_numpy_dtypes_of_triton_dtypes_are_triton_s() -> None:
    import numpy as np
    from triton.runtime import interpreter as ti

    for t, want in [(tl.float32, np.float32), (tl.float16, np.float16), (tl.int32, np.int32), (tl.int1, np.bool_)]:
        assert ti._get_np_dtype(t) == np.dtype(want)
        assert ti._get_np_dtype(t) == np.dtype(want)  # the kept one
    assert ti._get_np_dtype(tl.pointer_type(tl.float32)) == np.dtype(np.uint64)
