"""Test plugin (loaded through DTUNE_PLUGINS, in the test process and in every worker): trials of backward configs
with ``SAVE = "all"`` report a time 100x shorter, so that an interpreter search (host-clock times, which say nothing
about configs) has a known winner."""

from __future__ import annotations

import dataclasses
from typing import Any

import dtune.tune.trials as trials
from dtune.measure.harness import OpRun

_last: dict[str, Any] = {}
_call = OpRun.call
_time_call = trials.time_call


def call(self: OpRun, config: dict[str, Any] | None) -> Any:
    _last["config"] = config or {}
    return _call(self, config)


def time_call(*args: Any, **kwargs: Any) -> Any:
    t = _time_call(*args, **kwargs)
    favoured = _last.get("config", {}).get("SAVE") == "all"
    return dataclasses.replace(t, median_ms=t.median_ms / 100) if favoured else t


OpRun.call = call  # type: ignore[method-assign]
trials.time_call = time_call
