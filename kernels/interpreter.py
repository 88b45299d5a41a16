"""Triton's interpreter (``TRITON_INTERPRET=1``, the CPU path of ``--interpret`` and the test suite), without its
per-call cost for ``@triton.jit`` helpers and for its type objects.

The interpreter swaps ``triton.language``'s functions for interpreted ones while a kernel's grid runs, and restores
them after. It does the same swap again on *every call of a jit helper* inside the kernel (Triton 3.9), although
the kernel's swap is still in force: a backward test case makes about 2 800 such calls and runs in half the time
without them (3.8 -> 2.0 s). :func:`install` skips that repeat when the helper sees no language module the running
kernel's swap did not cover; any other call goes through Triton's own code unchanged.

Every interpreted operation also builds its result's type: a ``block_type`` (shape checks, a name string) and, for
its numpy data, a dtype looked up in a table rebuilt on every call. Both depend on their arguments alone, so
:func:`install` keeps one ``block_type`` per (element type, shape) and the numpy dtype per Triton dtype (the
segmented varlen KDA backward plan case: 28.6 -> 21.2 s; 136 forward cases 266 -> 204 s). Every ``tl.tensor`` also
rebuilt its shape's constexprs, a function of its type alone: they are kept on the type object; and the implicit
broadcast of two operands of the very same type returns at once (the same plan case 26.8 -> 21.3 s, 135 forward
cases 211 -> 162 s, on a 2-core machine). Each patch is a no-op where the interpreter's internals differ from the ones
it knows; all are applied once per process. A memoised ``block_type`` takes a Python tuple shape as a list: Triton
3.9's ``tl.split`` passes one, which its own constructor refuses, and a memo must not make that depend on which types
an earlier kernel in the process built.

:func:`reversed_programs` runs every grid's programs last first while in force: the interpreter runs them in order,
which hides a program's store that a later program overwrites (on a GPU they run in any order).
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any

_INSTALLED = False
# language swaps done and skipped since install() (the tests read them)
COUNTS = {"swapped": 0, "skipped": 0}


def installed() -> bool:
    """Whether :func:`install` is in force in this process."""
    return _INSTALLED


def install() -> bool:
    """Skip the interpreter's repeated language swap in nested jit calls. True when it is in force."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    patch_lang = getattr(ti, "_patch_lang", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    executor = getattr(ti, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None:
        return False
    languages = (tl, tl.core)
    seen: weakref.WeakKeyDictionary[Callable[..., Any], frozenset[int]] = weakref.WeakKeyDictionary()
    # one entry per running grid: [the language modules the swaps in force cover, whether its kernel's swap happened]
    running: list[list[Any]] = []

    def modules_of(fn: Callable[..., Any]) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[fn]

    def swap_once(fn: Callable[..., Any]) -> Any:
        if not running:
            COUNTS["swapped"] += 1
            return patch_lang(fn)
        top = running[-1]
        if top[1] and modules_of(fn) <= top[0]:
            COUNTS["skipped"] += 1
            return scope_type()  # a swap in force covers this helper: nothing to do, nothing to restore
        COUNTS["swapped"] += 1
        top[1] = True  # the grid's own swap for its kernel, or a helper's over more modules (triton.language.core
        top[0] = top[0] | modules_of(fn)  # for tl.sum's): Triton never restores a helper's swap, so it holds on
        return patch_lang(fn)

    grid_call = executor.__call__

    def run_grid(self: Any, *args: Any, **kwargs: Any) -> Any:
        running.append([modules_of(self.fn), False])
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    ti._patch_lang = swap_once
    executor.__call__ = run_grid
    _cache_types(tl, ti)
    _fast_tensors(tl)
    _same_type_shortcuts(ti)
    _INSTALLED = True
    return True


def _cache_types(tl: Any, ti: Any) -> None:
    """One ``block_type`` object per (element type, shape), and the numpy dtype of each Triton dtype, memoised."""
    to_np = getattr(ti, "_get_np_dtype", None)
    if callable(to_np) and list(inspect.signature(to_np).parameters) == ["tt_dtype"]:
        np_dtypes: dict[Any, Any] = {}

        def np_dtype(tt_dtype: Any) -> Any:
            try:
                return np_dtypes[tt_dtype]
            except KeyError:
                found = np_dtypes[tt_dtype] = to_np(tt_dtype)
                return found
            except TypeError:  # unhashable: as Triton does it
                return to_np(tt_dtype)

        ti._get_np_dtype = np_dtype
    block = getattr(tl.core, "block_type", None)
    constexpr = getattr(tl.core, "constexpr", None)
    if block is None or constexpr is None or "__new__" in vars(block):
        return
    if list(inspect.signature(block.__init__).parameters) != ["self", "element_ty", "shape"]:
        return
    init = block.__init__
    blocks: dict[tuple[Any, ...], Any] = {}

    def key(element_ty: Any, shape: Any) -> tuple[Any, ...]:
        return (element_ty, tuple([d.value if isinstance(d, constexpr) else d for d in shape]))

    def new(cls: type, element_ty: Any = None, shape: Any = None) -> Any:
        if cls is block:
            try:
                found = blocks.get(key(element_ty, shape))
            except TypeError:  # no shape (copy, pickle), or an unhashable one: a fresh object
                found = None
            if found is not None:
                return found  # __init__ runs on it again and returns at once
        return object.__new__(cls)

    def init_once(self: Any, element_ty: Any, shape: Any) -> None:
        if "numel" in vars(self):
            return
        if type(shape) is builtins.tuple:
            # Triton 3.9's split passes its input's shape, a Python tuple, where block_type asserts a list or
            # *Triton's* tuple (the name shadows the builtin in triton.language.core): a list, as every other caller
            # passes (else whether tl.split works would depend on whether the memo already holds its result type)
            shape = list(shape)
        init(self, element_ty, shape)  # raises on a bad shape: nothing is kept
        if type(self) is block:
            with contextlib.suppress(TypeError):  # an unhashable shape: not kept
                blocks[key(element_ty, shape)] = self

    block.__new__ = new
    block.__init__ = init_once


def _fast_tensors(tl: Any) -> None:
    """``tl.tensor``'s constructor without rebuilding its shape's constexprs: they are a function of its type alone
    (a memoised ``block_type`` object, or a scalar dtype), so they are built once per type and shared."""
    tensor = getattr(tl.core, "tensor", None)
    constexpr = getattr(tl.core, "constexpr", None)
    base = getattr(tl.core, "base_value", None)
    if tensor is None or constexpr is None or base is None or "__init__" in vars(base):
        return  # base_value.__init__ (object's) does nothing here; anything else: leave Triton's code alone
    if list(inspect.signature(tensor.__init__).parameters) != ["self", "handle", "type"]:
        return
    import math

    def init(self: Any, handle: Any, type: Any) -> None:
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        found = getattr(type, "_dtune_tensor_shape", None)  # kept on the type object, which owns it
        if found is None:
            dims = tuple(type.shape) if type.is_block() else ()
            found = (constexpr(math.prod(dims)), tuple(constexpr(d) for d in dims))
            with contextlib.suppress(AttributeError):  # a type without a __dict__: built each time
                type._dtune_tensor_shape = found
        self.numel, self.shape = found

    tensor.__init__ = init


def _same_type_shortcuts(ti: Any) -> None:
    """The interpreter's implicit broadcast returns at once when both operands have the very same type object (the
    same memoised block type, or the same scalar dtype): Triton's code would compare the shapes, find them equal
    and return the operands unchanged. Its cast likewise, when the target's scalar type is the input's own object."""
    semantic: Any = getattr(ti, "interpreter_semantic", None)
    broadcast = getattr(semantic, "broadcast_impl_value", None)
    if broadcast is None:
        return

    def broadcast_same(lhs: Any, rhs: Any) -> Any:
        left = getattr(lhs, "type", None)
        if left is not None and left is getattr(rhs, "type", None):
            return lhs, rhs
        return broadcast(lhs, rhs)

    semantic.broadcast_impl_value = broadcast_same
    cast = getattr(semantic, "cast", None)
    if cast is None or list(inspect.signature(cast).parameters) != ["input", "dst_ty", "fp_downcast_rounding"]:
        return

    def cast_same(input: Any, dst_ty: Any, fp_downcast_rounding: Any = None) -> Any:
        # Triton's cast returns its input whenever the scalar types are equal; here the same object says so at once
        scalar = getattr(getattr(input, "type", None), "scalar", None)
        if scalar is not None and scalar is getattr(dst_ty, "scalar", None):
            return input
        return cast(input, dst_ty, fp_downcast_rounding)

    semantic.cast = cast_same


@contextlib.contextmanager
def reversed_programs() -> Any:
    """Under Triton's interpreter, run every grid's programs in reverse order (the last program id first) while in force:
    a test of a kernel whose programs must not depend on running after one another (on a GPU they run in any order and
    at once). The interpreter runs them in order otherwise, which can hide a program's store that a later one
    overwrites. A no-op where the interpreter's builder differs from the one this knows."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:  # pragma: no cover - triton is a dependency
        yield
        return
    builder = getattr(ti, "interpreter_builder", None)
    if builder is None or not hasattr(builder, "set_grid_idx"):
        yield
        return
    forward = builder.set_grid_idx

    def backward(x: int, y: int, z: int) -> Any:
        nx, ny, nz = builder.grid_dim
        return forward(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    builder.set_grid_idx = backward
    try:
        yield
    finally:
        builder.set_grid_idx = forward
