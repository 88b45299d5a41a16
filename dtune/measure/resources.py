"""The one resource capture: registers, spills and shared memory of the Triton kernels a call launches.

:func:`capture_launches` collects the ``CompiledKernel`` that Triton's ``JITFunction.run`` returns for every launch
inside the block (the search's trials and ``dtune profile`` both use it); :func:`resources_of` reads them: the
maximum registers per thread and shared memory, and the total spills, over the launches. Under Triton's
interpreter nothing is compiled: every figure is None.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple


class Resources(NamedTuple):
    """What the compiled kernels of one call use (None: unknown, e.g. under the interpreter)."""

    registers: int | None  # per thread, the largest of the launches
    spills: int | None  # the launches' spills, summed
    shared_mem: int | None  # bytes per block, the largest of the launches


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _shared(kernel: Any) -> int | None:
    meta = getattr(kernel, "metadata", None)
    return _int(meta.get("shared") if isinstance(meta, dict) else getattr(meta, "shared", None))


def resources_of(launched: Iterable[Any]) -> Resources:
    """(max registers per thread, total spills, max shared memory bytes) of compiled Triton kernels."""
    kernels = list(launched)
    regs = [r for r in (_int(getattr(k, "n_regs", None)) for k in kernels) if r is not None]
    spills = [s for s in (_int(getattr(k, "n_spills", None)) for k in kernels) if s is not None]
    shared = [m for m in (_shared(k) for k in kernels) if m is not None]
    return Resources(max(regs) if regs else None, sum(spills) if spills else None, max(shared) if shared else None)


@contextmanager
def capture_launches() -> Iterator[list[Any]]:
    """Collect the CompiledKernel of every Triton launch inside the block (none under the interpreter)."""
    launched: list[Any] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        yield launched
        return
    original = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = original(self, *args, **kwargs)
        launched.append(kernel)
        return kernel

    JITFunction.run = run
    try:
        yield launched
    finally:
        JITFunction.run = original
