"""Which Triton kernels a block of code built and which it found in Triton's on-disk cache.

:func:`watch_builds` listens to Triton's compiler (``triton.knobs.compilation.listener``, Triton >= 3.4): every
``triton.compile`` reports its kernel's name and whether it was a cache hit. The search records both per trial: the
compile pool should build each new specialisation once, and the timing worker should then build nothing (it loads
the pool's binaries: both share Triton's cache directory). Under the interpreter nothing is compiled. With an older
Triton (no listener) the figures are unknown (``known`` is False).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Builds:
    """Kernel names compiled fresh (``built``) and loaded from the cache (``cached``) inside a :func:`watch_builds`."""

    built: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    known: bool = True


def _listener_slot() -> Any:
    try:
        import triton

        compilation = triton.knobs.compilation
    except (ImportError, AttributeError):
        return None
    return compilation if hasattr(compilation, "listener") else None


@contextmanager
def watch_builds() -> Iterator[Builds]:
    """Record every Triton compile inside the block (chains any listener already installed)."""
    builds = Builds()
    slot = _listener_slot()
    if slot is None:
        builds.known = False
        yield builds
        return
    previous = slot.listener

    def listen(*args: Any, **kw: Any) -> None:  # keywords src, metadata, ..., cache_hit (Triton 3.4-3.9)
        name = str(getattr(kw.get("src", args[0] if args else None), "name", "?"))
        (builds.cached if kw.get("cache_hit") else builds.built).append(name)
        if previous is not None:
            previous(*args, **kw)

    slot.listener = listen
    try:
        yield builds
    finally:
        slot.listener = previous
