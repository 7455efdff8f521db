"""A git repository made by a test, holding a tiny benchmark whose speed the test sets per commit.

Shared by the history and the schedule tests (not collected: no `test_` prefix).
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def bench_script(wobble: float) -> str:
    """A benchmark printing `[engine-bench]` decode tok/s from `speed.txt`, with a deterministic
    +-`wobble` relative variation driven by a call counter in `$COUNTER`."""
    return f"""#!/usr/bin/env bash
set -eu
n=$(cat "$COUNTER" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNTER"
awk -v s="$(cat speed.txt)" -v n="$n" 'BEGIN {{
  printf "[engine-bench] {{\\"decode_tok_s\\": %.3f, \\"text\\": \\"out\\"}}\\n", s * (1 + {wobble} * sin(n * 1.7)) }}'
"""


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` with a fixed identity and nothing of the user's configuration."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "HOME": str(repo.parent), "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()
