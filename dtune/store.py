"""Tuned-config store and run-time dispatch (filled in by the tuner work: see issue 4).

:func:`tuned_config` is what :mod:`dtune.ops` asks for when the caller passes no ``config``.
"""

from __future__ import annotations

from typing import Any

import torch

from dtune.inputs import Problem


def tuned_config(kernel: str, problem: Problem, dtype: torch.dtype, device: torch.device) -> dict[str, Any] | None:
    """The tuned config for this kernel, GPU, dtype and nearest shape bucket, or None for the default."""
    return None
