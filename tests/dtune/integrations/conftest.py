"""Fixtures of the fla-backend tests: fla-core must be importable (it is in the dev extra), the backend's switch and
caches are reset around every test, and fla's once-per-process log lines are re-armed."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

pytest.importorskip(
    "fla.backends", reason="flash-linear-attention's fla-core >= 0.6.0 is not installed (pip install 'dtune[fla]')"
)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """dtune.integrations.fla, switched off and with empty caches (FLA_DTUNE unset) before and after the test."""
    import fla.backends as fb

    import dtune.integrations.fla as module

    monkeypatch.delenv(module.ENV, raising=False)
    module.disable()
    registries = [*fb._operation_registries.values(), *fb._function_registries.values()]
    for r in registries:
        r._logged.clear()  # fla logs each routing and rejection once per process
    yield module
    module.disable()
