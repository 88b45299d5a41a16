"""dtune: autotuned, correctness-gated Triton kernels for delta-rule linear attention."""

from __future__ import annotations

__version__ = "0.1.0"
