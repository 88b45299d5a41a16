"""Extension hook: modules named in ``DTUNE_PLUGINS`` are imported by the search and by every worker.

A plugin may register extra kernels in :data:`dtune.kernels.KERNELS` (tests use it for planted fake kernels
that crash, hang or compute wrong results). Entries are comma-separated module names or ``.py`` file paths.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

ENV = "DTUNE_PLUGINS"


def load_plugins(spec: str | None = None) -> list[ModuleType]:
    """Import every plugin (once); ImportError naming the entry that failed."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    modules = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.endswith(".py"):
            name = "dtune_plugin_" + os.path.splitext(os.path.basename(entry))[0]
            if name in sys.modules:
                modules.append(sys.modules[name])
                continue
            file_spec = importlib.util.spec_from_file_location(name, entry)
            if file_spec is None or file_spec.loader is None:
                raise ImportError(f"{ENV}: cannot load plugin file {entry!r}")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(entry)
        modules.append(module)
    return modules
