"""mlx-lm's model classes without its package start-up (transformers, torch), in fresh processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_model_classes_import_without_transformers() -> None:
    out = _python(
        """
        import sys
        from kernels import mlx_lm_classes
        gemma = mlx_lm_classes.import_models("gemma3_text")
        cache = mlx_lm_classes.import_models("cache")
        print(gemma.Model.__name__, callable(cache.make_prompt_cache), mlx_lm_classes.is_light(),
              [m for m in ("transformers", "torch") if m in sys.modules])
        """
    )
    assert out == "Model True True []"


def test_the_whole_package_is_still_there_for_code_that_wants_it() -> None:
    out = _python(
        """
        import sys
        from kernels import mlx_lm_classes
        mlx_lm_classes.import_models("llama")
        from mlx_lm import load  # mlx-lm's own __init__ runs now
        import mlx_lm
        print(load.__module__, bool(mlx_lm.__version__), mlx_lm_classes.is_light(), "transformers" in sys.modules)
        """
    )
    assert out == "mlx_lm.utils True False True"


def test_an_already_imported_mlx_lm_is_left_as_it_is() -> None:
    out = _python(
        """
        import mlx_lm
        from kernels import mlx_lm_classes
        mlx_lm_classes.install()
        print(mlx_lm_classes.is_light(), callable(mlx_lm.generate))
        """
    )
    assert out == "False True"
