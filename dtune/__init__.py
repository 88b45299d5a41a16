"""dtune: autotuned, correctness-gated Triton kernels for delta-rule linear attention."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# In a source checkout, kernels/ and search_spaces/ sit beside dtune/ (an install puts them inside it, as
# dtune.kernels and dtune.search_spaces): let the package find them there, so `python -m dtune ...` and the scripts
# run from the checkout with or without an install.
_here = Path(__file__).resolve().parent
if not (_here / "kernels").is_dir() and (_here.parent / "kernels" / "__init__.py").is_file():
    __path__.append(str(_here.parent))
