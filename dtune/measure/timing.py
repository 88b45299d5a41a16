"""The one timing function: CUDA events around each call, warm-up first, L2 flushed between repeats, median of
many; CUDA-graph replays for decode-sized calls, where the host's launch overhead would hide the kernel.

:func:`time_call` is what every measurement uses (trials, ``dtune bench``, ``dtune profile``, the scripts): mode
``"events"`` (:func:`time_fn`) or ``"graph"`` (:func:`time_graph`, falling back to events when the call cannot be
captured); :func:`timing_mode` resolves ``"auto"`` (graph for T <= 16). On the CPU (Triton's interpreter) the
same API times with the host clock; such timings only exercise the pipeline and are marked ``meaningful=False``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TIMINGS = ("auto", "events", "graph")
GRAPH_MAX_T = 16  # auto timing: CUDA-graph replays up to this sequence length
WARMUP = 5
REPEATS = 50
MAX_SECONDS = 2.0  # per timed call: stop sampling early after this long (slow configs in a search)


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    iqr_ms: float  # spread: 75th minus 25th percentile
    repeats: int
    meaningful: bool  # False under the interpreter / on the CPU

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "iqr_ms": self.iqr_ms,
            "repeats": self.repeats,
            "meaningful": self.meaningful,
        }


_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer larger than any L2 (256 MiB): writing it evicts the inputs of the last call."""
    if device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)
    return _L2_FLUSH[device]


def _summary(times: list[float], meaningful: bool) -> Timing:
    qs = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return Timing(statistics.median(times), min(times), qs[2] - qs[0], len(times), meaningful)


def time_fn(
    fn: Callable[[], Any],
    device: torch.device | str = "cuda",
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    flush_l2: bool = True,
    max_seconds: float = MAX_SECONDS,
) -> Timing:
    """Median time of ``fn()`` in milliseconds.

    On CUDA: ``warmup`` untimed calls, then up to ``repeats`` calls each between two events, the L2 flushed
    before each (so a small problem is not timed out of the cache), stopping early after ``max_seconds``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(min(warmup, 1)):
            fn()
        times = []
        for _ in range(max(1, min(repeats, 3))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return _summary(times, meaningful=False)

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    flush = _flush_buffer(device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    deadline = time.perf_counter() + max_seconds
    n = 0
    for i in range(repeats):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
        n += 1
        if i % 8 == 7 and time.perf_counter() > deadline:
            break
    torch.cuda.synchronize(device)
    return _summary([s.elapsed_time(e) for s, e in zip(starts[:n], ends[:n])], meaningful=True)


def time_graph(fn: Callable[[], Any], device: torch.device | str = "cuda", replays: int = 200) -> Timing:
    """Median time of ``fn`` captured in a CUDA graph and replayed (as serving engines run decode steps).

    Each sample is the mean over a batch of 20 back-to-back replays, so it measures the GPU time without
    the Python launch overhead that :func:`time_fn` includes (the host's share is the difference).
    """
    device = torch.device(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize(device)
    batch = 20
    times = []
    for _ in range(max(1, replays // batch)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(batch):
            graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / batch)
    return _summary(times, meaningful=True)


def timing_mode(timing: str, T: int) -> str:
    """``"events"`` or ``"graph"``: ``"auto"`` is graph replays for sequences of at most GRAPH_MAX_T tokens."""
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; use one of {', '.join(TIMINGS)}")
    if timing == "auto":
        return "graph" if T <= GRAPH_MAX_T else "events"
    return timing


def time_call(
    fn: Callable[[], Any],
    device: torch.device | str,
    mode: str = "events",
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    max_seconds: float = MAX_SECONDS,
) -> Timing:
    """Median time of ``fn``: CUDA events with the L2 flushed (``"events"``), or CUDA-graph replays (``"graph"``).

    Graph replays measure the kernel without Python's launch overhead, which otherwise hides the differences
    between configs at decode sizes; if the call cannot be captured, events are used.
    """
    device = torch.device(device)
    if mode == "graph" and device.type == "cuda":
        try:
            return time_graph(fn, device, replays=max(repeats, 20) * 4)
        except Exception:
            torch.cuda.synchronize(device)
    return time_fn(fn, device, warmup=warmup, repeats=repeats, max_seconds=max_seconds)


def ceilings(device: torch.device | str = "cuda") -> dict[str, float]:
    """Measured ceilings of this GPU: device-copy bandwidth (GB/s, read + write) and bf16 matmul (TFLOP/s)."""
    device = torch.device(device)
    src = torch.randn(1 << 28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    t_copy = time_fn(lambda: dst.copy_(src), device, warmup=3, repeats=20, flush_l2=False)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_mm = time_fn(lambda: a @ b, device, warmup=3, repeats=20, flush_l2=False)
    return {
        "copy_gbs": 2 * (1 << 28) * 4 / (t_copy.median_ms * 1e-3) / 1e9,
        "bf16_tflops": 2 * 8192**3 / (t_mm.median_ms * 1e-3) / 1e12,
    }
