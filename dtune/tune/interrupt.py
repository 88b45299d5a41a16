"""Ctrl-C during a search: a flag the trial loop checks, and a block that holds the KeyboardInterrupt back while a
trial is created in storage (so no trial is left RUNNING)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Set by Ctrl-C. The KeyboardInterrupt raised with it can be swallowed when the signal lands in a finaliser
# ("Exception ignored in ..."), so the trial loop also checks this flag and the run still stops and says so.
INTERRUPTED = threading.Event()


# Set by Ctrl-C inside a `sigint_deferred()` block: the KeyboardInterrupt is raised when the block ends.
_DEFERRING = threading.Event()
_DEFERRED = threading.Event()


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold back the KeyboardInterrupt of a Ctrl-C inside the block; it is raised when the block ends.

    ``study.ask()`` creates the trial in storage before it returns; a KeyboardInterrupt raised in between would
    leave that trial RUNNING forever, since the loop never learnt its number. (Masking the signal would not do:
    the OS may hand a process-directed SIGINT to another thread, and Python still runs the handler at once.)
    """
    if threading.current_thread() is not threading.main_thread() or _DEFERRING.is_set():
        yield  # Python runs signal handlers on the main thread only; an outer block already defers
        return
    _DEFERRED.clear()
    _DEFERRING.set()
    try:
        yield
    finally:
        _DEFERRING.clear()
    if _DEFERRED.is_set():
        _DEFERRED.clear()
        raise KeyboardInterrupt


def on_sigint(signum: int, frame: Any) -> None:
    INTERRUPTED.set()
    if _DEFERRING.is_set():
        _DEFERRED.set()
        return
    raise KeyboardInterrupt
