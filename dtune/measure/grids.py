"""The shapes ``dtune bench`` and ``dtune profile`` measure when none are asked for.

On a GPU, the anchors' grid (docs/anchors/fla-0.6.0_h200.md): chunk kernels at B·T = 32768 tokens, T in {1024, 4096,
16384}, D in {64, 128}, H = 16; fused-recurrent decode (T = 1) at B in {1, 32, 256}. Under the interpreter, tiny
shapes that run in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtune.shape import Gate, Shape, ShapeGrid

BATCH_TOKENS = 32768


def _decode(kernel: str) -> bool:
    return kernel.startswith("fused_recurrent")


def default_grid(kernel: str, on_gpu: bool) -> ShapeGrid:
    """The benchmark's grid on a GPU; tiny shapes under the interpreter."""
    decode = _decode(kernel)
    if on_gpu:
        if decode:
            return ShapeGrid(seq_lens=(1,), head_dims=(64, 128), heads=(16,), batch=(1, 32, 256))
        return ShapeGrid(seq_lens=(1024, 4096, 16384), head_dims=(64, 128), heads=(16,), batch_tokens=BATCH_TOKENS)
    if decode:
        return ShapeGrid(seq_lens=(1,), head_dims=(16,), heads=(2,), batch=(1, 2))
    return ShapeGrid(seq_lens=(16, 32), head_dims=(16,), heads=(2,), batch=(1,))


def make_grid(
    kernel: str,
    on_gpu: bool,
    seq_lens: Sequence[int] | None = None,
    head_dims: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    batch_tokens: int | None = None,
) -> ShapeGrid:
    """The default grid with any of its axes replaced; ``batches`` wins over ``batch_tokens``."""
    return default_grid(kernel, on_gpu).replace(
        tuple(seq_lens or ()), tuple(head_dims or ()), tuple(heads or ()), tuple(batches or ()), batch_tokens
    )


def bench_shapes(grid: ShapeGrid, gate: Gate) -> list[Shape]:
    """The grid's shapes in the benchmark's order: by head dim, then heads (explicit shapes as they are)."""
    shapes = grid.shapes(gate)
    return shapes if grid.explicit else sorted(shapes, key=lambda s: (s.K, s.H))


def profile_shape(
    kernel: str,
    gate: Gate,
    on_gpu: bool,
    seq_len: int | None = None,
    head_dim: int | None = None,
    heads: int | None = None,
    batch: int | None = None,
    hv_ratio: int = 1,
) -> Shape:
    """The profiled shape: what is given, else T = 4096, D = 128, H = 16, B = 32768 // T on a GPU (decode: T = 1,
    B = 32); T = 32 (decode 1), D = 16, H = 2, B = 1 under the interpreter; HV = ``hv_ratio`` x H."""
    decode = _decode(kernel)
    T = seq_len or ((1 if decode else 4096) if on_gpu else (1 if decode else 32))
    D = head_dim or (128 if on_gpu else 16)
    H = heads or (16 if on_gpu else 2)
    B = batch or ((32 if decode else max(1, BATCH_TOKENS // T)) if on_gpu else 1)
    return Shape(B=B, T=T, H=H, HV=H * hv_ratio, K=D, V=D, gate=gate)
