"""Fixtures of the tuner tests: the planted fake kernel (a plugin, so worker subprocesses load it too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import dtune.store
from dtune.plugins import ENV, load_plugins

FAKE = Path(__file__).with_name("fake_kernels.py")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake kernel registered here and, through DTUNE_PLUGINS, in every worker."""
    monkeypatch.setenv(ENV, str(FAKE))
    (module,) = load_plugins(str(FAKE))
    return module


@pytest.fixture(autouse=True)
def fresh_store() -> Iterator[None]:
    dtune.store.reset()
    yield
    dtune.store.reset()
