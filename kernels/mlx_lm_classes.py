"""mlx-lm's model classes without mlx-lm's package start-up.

`import mlx_lm.models.cache` runs `mlx_lm/__init__.py` first, which imports its converter,
generator and tokenizer utilities and through them transformers, which imports torch when it finds
it: seconds of every fresh process, many more where torch is installed (BENCHMARKS.md), against
a tenth of a second for the model classes a sample needs. `install()` registers the `mlx_lm`
package unexecuted, so its submodules import on their own; the first use of anything else of the
package (`mlx_lm.load`, `from mlx_lm import generate`, `mlx_lm.__version__`) runs mlx-lm's real
`__init__` then, once, so code that wants the whole package still gets it.

`import_full(name)` is for the parts that do need transformers (mlx-lm's loader of a real
checkpoint): it keeps transformers from importing torch (`USE_TORCH=0`, unless the caller's
environment set it), which no sample uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

PACKAGE = "mlx_lm"


def install() -> None:
    """Make `import mlx_lm.<submodule>` cheap in this process (no-op when mlx-lm is imported already).

    Raises:
        ImportError: mlx-lm is not installed.
    """
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None:
        raise ImportError(f"{PACKAGE} is not installed")
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def finish(name: str) -> Any:
        # Any attribute the unexecuted package lacks: run mlx-lm's own __init__, then look again.
        vars(package).pop("__getattr__", None)
        loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = finish  # type: ignore[method-assign]  # PEP 562: only for missing names
    sys.modules[PACKAGE] = package


def is_light() -> bool:
    """Whether this process's mlx-lm is still the unexecuted package (its start-up not paid)."""
    package = sys.modules.get(PACKAGE)
    return package is not None and "__getattr__" in vars(package)


def import_models(name: str) -> ModuleType:
    """`mlx_lm.models.<name>` (e.g. "gemma3_text", "cache") without mlx-lm's package start-up."""
    install()
    return importlib.import_module(f"{PACKAGE}.models.{name}")


def import_full(name: str) -> ModuleType:
    """`mlx_lm.<name>` for the parts that import transformers, with torch kept out of the process."""
    os.environ.setdefault("USE_TORCH", "0")
    install()
    return importlib.import_module(f"{PACKAGE}.{name}")
