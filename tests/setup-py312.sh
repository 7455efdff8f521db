#!/usr/bin/env bash
# A Python 3.12+ environment with the fork server's own imports (.venv312), for the test that runs
# the fork server where CPython warns of a fork in a multi-threaded process (3.12 and later; the
# project's venv may be older). Uses the first python3.14/3.13/3.12 that runs, on PATH or under
# pyenv; where there is none, does nothing and that test says so when it skips. Versions are the
# pins of pyproject.toml. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv312
[[ -x $venv/bin/python && $venv/.installed -nt pyproject.toml ]] && exit 0
python=""
for cand in python3.14 python3.13 python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
  if "$cand" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then python=$cand; break; fi
done
[[ -n $python ]] || { echo "setup-py312: no Python 3.12+ here; the 3.12 fork test will skip"; exit 0; }
rm -rf "$venv"
"$python" -m venv "$venv"
pins=$("$venv/bin/python" - <<'PY'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
want = ("numpy", "pyarrow", "pydantic", "psutil")
print(" ".join(d for d in deps if re.split(r"[=<>\[ ]", d)[0] in want))
mlx = next(d for d in deps if d.startswith("mlx=="))
print(mlx.replace("mlx==", "mlx[cpu]==") if sys.platform == "linux" else mlx)
print(next(d for d in deps if d.startswith("mlx-lm==")))
PY
)
set -- $pins
lm=${!#}
"$venv/bin/pip" install -q --disable-pip-version-check "${@:1:$#-1}" 2>&1 | grep -v "^WARNING: Location" || true
# mlx-lm's model classes alone (kernels.mlx_lm_classes loads them without the package's start-up)
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$lm" 2>&1 | grep -v "^WARNING: Location" || true
"$venv/bin/python" -c 'import numpy, pyarrow, pydantic, psutil, mlx.core'
touch "$venv/.installed"
echo "setup-py312: $venv with $("$venv/bin/python" --version)"
