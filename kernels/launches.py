"""A call's launches recorded once and replayed: the host cost of a repeated call without the per-launch Python.

A chunk op's call spends most of its host time (about 290 µs for four launches on an H100's host, where the kernels
run 180 µs) building launch arguments and in Triton's per-launch path: binding ~30 arguments, specialising each,
keying the compiled-kernel cache. For a call with the same *signature* as an earlier one (the same shapes, dtypes,
config, options, input alignment: everything the launchers read except the data pointers), all of that comes out the
same; only the pointers differ. :func:`run` therefore lets a call's launchers run once with Triton's ``run``
intercepted, records each launch (the compiled kernel, its grid, its arguments in the kernel's parameter order) with
every pointer expressed as *which of the call's tensors, at which byte offset*, and on the next call of that signature
replays the record: the compiled kernels launched directly with the new call's pointers. Outside a recording the
launchers' ``kernel[grid](...)`` is Triton's own, untouched.

What the caller guarantees: ``key`` covers everything its launchers read that is not a data pointer of a tensor in
``tensors`` (the call's inputs, its index tables, every buffer it allocated), and the tensors come in the same order,
shapes and dtypes for equal keys. A launch that cannot be recorded safely (a pointer into a tensor that is not in
``tensors``, an argument of an unknown kind, a grid function, a kernel with pre-run hooks) makes the signature
*uncacheable*: its calls keep Triton's path. On by default; ``DTUNE_LAUNCH_CACHE=0`` when dtune is imported, or
:func:`set_mode`, turns it off. Never replayed: under Triton's interpreter, while a
launch hook is set (``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``: profilers) or
``JITFunction.run`` is patched (:func:`dtune.measure.resources.capture_launches`). ``DTUNE_LAUNCH_CACHE=check``
verifies every replay: the launchers run again without launching, Triton's own lookup picks each compiled kernel,
and the replay must match it launch for launch (kernel, grid, every argument) or raise (the GPU tests run so).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tensor = torch.Tensor

CACHE_SIZE = 256  # signatures kept (least recently used dropped)
_PLANS: OrderedDict[Hashable, _Plan | None] = OrderedDict()  # None: the signature is uncacheable
_WHY: dict[Hashable, str] = {}  # why an uncacheable signature is


class _Local(threading.local):
    recording: list[_Launch] | None = None  # the launches of the call being recorded (this thread's)
    dry = False  # check mode: the launchers' launches are looked up, not run


_LOCAL = _Local()


def parse_mode(value: str | None) -> str:
    """``DTUNE_LAUNCH_CACHE``'s value as a mode: ``on`` (unset, ``1``; any value not below), ``off`` (``0``, ``off``,
    ``false``, ``no``) or ``check`` (every replay verified against Triton's own launch). On by default since every
    replay of ``tests/kernels/test_hot_path_gpu.py`` (all six ops; fixed length, grouped value heads, a packed batch
    with an empty sequence) passed in check mode on an H100."""
    value = (value or "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "check" if value == "check" else "on"


MODE = parse_mode(os.environ.get("DTUNE_LAUNCH_CACHE"))  # read once, when dtune is imported; set_mode changes it


def mode() -> str:
    return MODE


def set_mode(value: str) -> str:
    """Set the mode (``off``, ``on``, ``check``, or an environment value); returns the one it replaces."""
    global MODE
    before, MODE = MODE, parse_mode(value)
    return before


@dataclass
class _Launch:
    """One launch as a launcher made it: the kernel (a ``JITFunction``), its grid, its arguments, the compiled kernel."""

    kernel: Any
    grid: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    compiled: Any


def _kernel_classes() -> list[type]:
    """The classes whose ``run`` every ``kernel[grid](...)`` goes through: Triton's ``JITFunction``."""
    from triton.runtime.jit import JITFunction

    return [JITFunction]


_RECORD_LOCK = threading.Lock()  # one recording at a time: each swaps the kernels' run() for its own while it lasts


@contextlib.contextmanager
def _intercepted() -> Iterator[None]:
    """Inside, this thread's launches (``kernel[grid](...)``) go through :func:`_launch_one` and are recorded in
    ``_LOCAL.recording``; another thread's pass through unchanged. Outside, Triton's launch path is untouched: the
    launchers call ``kernel[grid](...)`` and the cache costs them nothing."""
    with _RECORD_LOCK:
        classes = _kernel_classes()
        originals = [(cls, cls.__dict__["run"]) for cls in classes]

        def intercepting(original: Any) -> Any:
            def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
                local = _LOCAL
                if local.recording is None or warmup:  # another thread's launch, or a warm-up (compile only)
                    return original(self, *args, grid=grid, warmup=warmup, **kwargs)
                compiled = _launch_one(original, self, grid, args, kwargs, local.dry)
                local.recording.append(_Launch(self, grid, args, kwargs, compiled))
                return compiled

            return run

        for cls, original in originals:
            cls.run = intercepting(original)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for cls, original in originals:
                cls.run = original  # type: ignore[attr-defined]


def _launch_one(run: Any, kernel: Any, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dry: bool) -> Any:
    """Triton's launch through its own ``run`` (``dry``: Triton's lookup of the compiled kernel alone, compiling it if
    need be, no launch)."""
    return run(kernel, *args, grid=grid, warmup=dry, **kwargs)


class _Ptr(int):
    """A device address where Triton's launcher takes a tensor: an ``int`` (read as the pointer) that also answers
    ``data_ptr()`` (a tensor descriptor's base)."""

    def data_ptr(self) -> int:
        return int(self)


class _Desc:
    """A host tensor descriptor as Triton's launcher reads one (``base``, ``shape``, ``strides``, ``block_shape``,
    ``padding``), its base a replayed pointer: built without ``TensorDescriptor``'s checks, which the recorded
    descriptor of the same shape passed."""

    __slots__ = ("base", "block_shape", "padding", "shape", "strides")

    def __init__(self, base: _Ptr, shape: list[int], strides: list[int], block_shape: list[int], padding: str) -> None:
        self.base = base
        self.shape = shape
        self.strides = strides
        self.block_shape = block_shape
        self.padding = padding


@dataclass
class _Slot:
    """Argument ``pos`` of a recorded launch is a pointer: tensor ``index`` of the call's tensors plus ``offset``
    bytes; ``desc``: a tensor descriptor around it (shape, strides, block shape, padding)."""

    pos: int
    index: int
    offset: int
    desc: tuple[list[int], list[int], list[int], str] | None = None


@dataclass
class _Replay:
    """One recorded launch: the compiled kernel, its grid and its arguments with the pointers left as slots."""

    kernel: Any  # the JITFunction (check mode compares Triton's lookup with ``compiled``)
    compiled: Any
    grid: tuple[int, int, int]
    args: list[Any]
    slots: list[_Slot]

    def arguments(self, ptrs: Sequence[int]) -> list[Any]:
        args = list(self.args)
        for s in self.slots:
            p = _Ptr(ptrs[s.index] + s.offset)
            args[s.pos] = p if s.desc is None else _Desc(p, *s.desc)
        return args


@dataclass
class _Plan:
    launches: list[_Replay]
    keep: Any  # objects whose identity the key names (held so that it cannot be recycled while the plan lives)


class Uncacheable(Exception):
    """A launch that cannot be replayed safely (the reason in the message)."""


def run(key: Hashable | None, tensors: Sequence[Tensor | None], launch_all: Callable[[], Any], keep: Any = None) -> Any:
    """Run ``launch_all()`` (the call's launches, each a ``kernel[grid](...)``) or replay what it launched for an
    earlier call of signature ``key`` with the pointers of ``tensors``. ``key`` None: no caching (launch_all runs).
    ``keep``: objects the key names by identity, held by the cached plan. Returns ``launch_all()``'s result, or None
    when replayed."""
    if key is None or _LOCAL.recording is not None or not _replayable(tensors):
        return launch_all()  # (inside another call's recording: its launches are that call's)
    try:
        plan = _PLANS.get(key, _MISSING)
    except TypeError:  # an unhashable key (a list in a config): no caching
        return launch_all()
    if plan is None:  # uncacheable signature
        return launch_all()
    if plan is _MISSING:
        return _record(key, tensors, launch_all, keep)
    assert isinstance(plan, _Plan)
    with contextlib.suppress(KeyError):  # dropped meanwhile by another thread: the plan in hand still serves
        _PLANS.move_to_end(key)
    ptrs = [0 if t is None else t.data_ptr() for t in tensors]
    if mode() == "check":
        _check(plan, ptrs, launch_all)
    _replay(plan, ptrs)
    return None


_MISSING: Any = object()


def active(t: Tensor) -> bool:
    """Whether a call on ``t``'s device would be recorded or replayed (callers skip building the key and the tensor
    list when not: the cache costs nothing while off)."""
    return MODE != "off" and t.is_cuda and _replayable((t,))


def _replayable(tensors: Sequence[Tensor | None]) -> bool:
    """On a CUDA device, Triton's own launch path in force (no interpreter, no patched ``JITFunction.run``, no launch
    hooks) and the cache not turned off."""
    first = next((t for t in tensors if t is not None), None)
    if first is None or not first.is_cuda or mode() == "off":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover (a Triton without knobs: never replay)
        return False
    run_ = JITFunction.run
    if getattr(run_, "__qualname__", "") != "JITFunction.run" or run_.__module__ != "triton.runtime.jit":
        return False  # patched (a launch capture): let every launch through it
    return _unhooked(knobs.runtime.launch_enter_hook) and _unhooked(knobs.runtime.launch_exit_hook)


def _unhooked(hook: Any) -> bool:
    """No launch hook: None, or Triton's hook chain (3.6 on) with nothing in it."""
    return hook is None or not getattr(hook, "calls", True)


def _record(key: Hashable, tensors: Sequence[Tensor | None], launch_all: Callable[[], Any], keep: Any) -> Any:
    local = _LOCAL
    outer, local.recording = local.recording, []
    try:
        with _intercepted():
            result = launch_all()
        recorded = local.recording
    finally:
        local.recording = outer
    try:
        index = _storages(tensors)  # (once for all the call's launches)
        plan: _Plan | None = _Plan([_replay_of(launch, index) for launch in recorded], keep)
    except Exception as exc:  # Uncacheable, or anything unforeseen: this signature keeps Triton's path, the call stands
        plan = None
        _WHY[key] = str(exc) if isinstance(exc, Uncacheable) else f"{type(exc).__name__}: {exc}"
    _PLANS[key] = plan
    while len(_PLANS) > CACHE_SIZE:
        _WHY.pop(_PLANS.popitem(last=False)[0], None)
    return result


def _replay_of(rec: _Launch, index: list[tuple[int, int, int, int]]) -> _Replay:
    """The replay of one recorded launch: every argument in the kernel's parameter order, pointers as slots located
    in the call's tensors (``index``: :func:`_storages`)."""
    compiled = rec.compiled
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        raise Uncacheable("no compiled kernel")
    if getattr(rec.kernel, "pre_run_hooks", None):
        raise Uncacheable("the kernel has pre-run hooks")
    if callable(rec.grid):
        raise Uncacheable("a grid function")
    grid = _grid3(rec.grid)
    values = _bound(rec.kernel, rec.args, rec.kwargs)
    args: list[Any] = []
    slots: list[_Slot] = []
    for pos, value in enumerate(values):
        if isinstance(value, Tensor):
            slots.append(_Slot(pos, *_locate(value.data_ptr(), index)))
            args.append(None)
        elif type(value).__name__ == "TensorDescriptor":
            if hasattr(value, "layout"):  # Gluon's (a shared-memory layout with it): its replay not yet run on a GPU
                raise Uncacheable(f"argument {pos}: a Gluon tensor descriptor")
            base = value.base
            desc = (list(value.shape), list(value.strides), list(value.block_shape), value.padding)
            slots.append(_Slot(pos, *_locate(base.data_ptr(), index), desc=desc))
            args.append(None)
        elif value is None or isinstance(value, (bool, int, float, str)) or _is_triton_constant(value):
            args.append(value)
        else:
            raise Uncacheable(f"argument {pos} of kind {type(value).__name__}")
    return _Replay(rec.kernel, compiled, grid, args, slots)


def _grid3(grid: Any) -> tuple[int, int, int]:
    """A launch grid as Triton's launcher takes it: three ints, 1 where not given."""
    g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    return g[0], g[1], g[2]


def _is_triton_constant(value: Any) -> bool:
    return type(value).__module__.startswith("triton.") and not isinstance(value, (list, tuple, dict))


def _bound(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """``args`` and ``kwargs`` in the kernel's parameter order, defaults filled (Triton's binder does the same);
    launch options (``num_warps`` ...) left out."""
    fn = getattr(kernel, "fn", None)
    if fn is None:
        raise Uncacheable(f"not a JIT kernel: {type(kernel).__name__}")
    sig = inspect.signature(fn)
    params = {k: v for k, v in kwargs.items() if k in sig.parameters}
    bound = sig.bind(*args, **params)
    bound.apply_defaults()
    return list(bound.arguments.values())


def _storages(tensors: Sequence[Tensor | None]) -> list[tuple[int, int, int, int]]:
    """``(index, data_ptr, storage start, storage end)`` of each tensor (exact pointers first when located)."""
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        st = t.untyped_storage()
        out.append((i, t.data_ptr(), st.data_ptr(), st.data_ptr() + st.nbytes()))
    return out


def _locate(ptr: int, index: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    """The tensor and byte offset of a pointer: a tensor starting there, else one whose storage holds it."""
    for i, p, _, _ in index:
        if p == ptr:
            return i, 0
    for i, p, lo, hi in index:
        if lo <= ptr < hi:
            return i, ptr - p
    raise Uncacheable("a pointer into none of the call's tensors")


def _device_stream() -> int:
    from triton.runtime import driver

    return int(driver.active.get_current_stream(driver.active.get_current_device()))


def _replay(plan: _Plan, ptrs: Sequence[int]) -> None:
    stream = _device_stream()
    for r in plan.launches:
        c = r.compiled
        c.run(*r.grid, stream, c.function, c.packed_metadata, None, None, None, *r.arguments(ptrs))


def _check(plan: _Plan, ptrs: Sequence[int], launch_all: Callable[[], Any]) -> None:
    """Check mode: the launchers' launches for this call, looked up by Triton (no launch), against the plan's."""
    local = _LOCAL
    outer, local.recording, local.dry = local.recording, [], True
    try:
        with _intercepted():
            launch_all()
        fresh = local.recording
    finally:
        local.recording, local.dry = outer, False
    if len(fresh) != len(plan.launches):
        raise RuntimeError(f"launch cache: {len(plan.launches)} launches replayed where the call makes {len(fresh)}")
    for i, (rec, r) in enumerate(zip(fresh, plan.launches, strict=True)):
        if rec.kernel is not r.kernel or rec.compiled is not r.compiled:
            raise RuntimeError(f"launch cache: launch {i} replays another compiled kernel than Triton's lookup")
        grid = _grid3(rec.grid)
        if grid != r.grid:
            raise RuntimeError(f"launch cache: launch {i} grid {r.grid}, the call's {grid}")
        got, exp = _plain(r.arguments(ptrs)), _plain(_bound(rec.kernel, rec.args, rec.kwargs))
        if got != exp:
            diff = [j for j, (a, b) in enumerate(zip(got, exp, strict=True)) if a != b]
            raise RuntimeError(f"launch cache: launch {i} ({_name(r.kernel)}) differs in arguments {diff}")


def _plain(args: list[Any]) -> list[Any]:
    """Arguments as comparable values: a tensor its address, a descriptor its base address and layout."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a.data_ptr())
        elif isinstance(a, _Desc) or type(a).__name__ == "TensorDescriptor":
            layout = (list(a.shape), list(a.strides), list(a.block_shape), a.padding)
            out.append(("desc", a.base.data_ptr(), *layout))
        else:
            out.append(a)
    return out


def _name(kernel: Any) -> str:
    return str(getattr(getattr(kernel, "fn", None), "__name__", kernel))


def layout(tensors: Sequence[Tensor | None]) -> tuple[Any, ...]:
    """What a launch cache key needs of a call's input tensors: dtype, shape and 16-byte alignment (Triton specialises
    a pointer on it) of each, None for an absent one (the inputs are contiguous: strides follow from shapes)."""
    return tuple(None if t is None else (t.dtype, t.shape, t.data_ptr() % 16) for t in tensors)


def device_key(t: Tensor) -> tuple[int, torch.device]:
    """The device Triton compiles for (the current one) and the tensors'."""
    return (torch.cuda.current_device() if t.is_cuda else -1, t.device)


def clear() -> None:
    """Forget every recorded plan (tests; a kernel recompiled under a changed environment)."""
    _PLANS.clear()
    _WHY.clear()


def cached() -> int:
    """Signatures with a replayable plan."""
    return sum(p is not None for p in _PLANS.values())


def summary() -> str:
    """One line: the signatures with a plan, and those kept on Triton's path with why (benchmarks print it)."""
    why: dict[str, int] = {}
    for reason in _WHY.values():
        why[reason] = why.get(reason, 0) + 1
    uncached = "; ".join(f"{n} x {reason}" for reason, n in sorted(why.items()))
    return f"{cached()} replayable" + (f", uncacheable: {uncached}" if uncached else "")
