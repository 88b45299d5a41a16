"""Shared test helpers. Kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
from collections.abc import Generator

import dtune.kernels.config as _kernel_config
import pytest
import torch

from dtune.measure.error import rel_rms_error as rel_err

__all__ = ["rel_err"]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launcher NaN-fills its outputs first: an element a kernel fails to write fails the test."""
    monkeypatch.setattr(_kernel_config, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def launch_arguments_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch's keyword arguments are the kernel's parameters or Triton's launch options: the interpreter drops any
    other silently, where a GPU launch raises (a misnamed or misrouted argument fails here, not first on a GPU)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return
    options = set(CUDAOptions.__dataclass_fields__)
    launch = InterpretedFunction.run

    def checked(self: InterpretedFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        unknown = set(kwargs) - set(self.arg_names) - options
        assert not unknown, f"{self.fn.__name__} launched with unknown arguments {sorted(unknown)}"
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", checked)


@pytest.fixture
def no_option_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla's options as separate passes (``dtune.options``' l2norm, gate and beta activations) raise: a test using it
    checks that the kernels applied them."""
    import dtune.options as options_module

    def no_pass(*_: object, **__: object) -> None:
        raise AssertionError("a separate option pass ran")

    for name in ("l2norm", "gate_activation", "beta_activation"):
        monkeypatch.setattr(options_module, name, no_pass)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Every output a launcher allocates sits between two guard regions filled with a sentinel
    (``dtune.kernels.config.GUARDS``): a test whose kernels stored outside an output fails here, naming the output,
    instead of passing on corrupted memory or crashing the process."""
    guards: list[_kernel_config.Guarded] = []
    _kernel_config.GUARDS = guards
    try:
        result = yield
    finally:
        _kernel_config.GUARDS = None
    touched = _kernel_config.touched_guards(guards)
    if touched:
        pytest.fail(f"a kernel stored outside its output buffer: {'; '.join(touched)}", pytrace=False)
    return result


GPU_SKIP = (
    "needs a CUDA GPU and compiled kernels (no TRITON_INTERPRET): a GPU machine runs `python -m pytest -m gpu` "
    "(scripts/gpu_tests.sh)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, with the reason shown, without a CUDA GPU or under the interpreter."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that reads "gpu"
            item.add_marker(skip)
