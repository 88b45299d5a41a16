"""Test plugin (loaded through DTUNE_PLUGINS, in the test process and in every worker): trials of any config other
than the template's default report a time 100x shorter, so that an interpreter search (host-clock times, which say
nothing about configs) exports a winner that is not the default: a donor run whose winners transfer."""

from __future__ import annotations

import dataclasses
from typing import Any

from dtune.kernels import get_kernel

import dtune.tune.trials as trials
from dtune.measure.harness import OpRun

_last: dict[str, bool] = {}
_call = OpRun.call
_time_call = trials.time_call


def call(self: OpRun, config: dict[str, Any] | None) -> Any:
    default = get_kernel(self.kernel).default_config(self.shape.K, self.shape.V)
    _last["favoured"] = bool(config) and {**default, **(config or {})} != default
    return _call(self, config)


def time_call(*args: Any, **kwargs: Any) -> Any:
    t = _time_call(*args, **kwargs)
    return dataclasses.replace(t, median_ms=t.median_ms / 100) if _last.get("favoured") else t


OpRun.call = call  # type: ignore[method-assign]
trials.time_call = time_call
