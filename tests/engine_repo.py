"""A small mlxcel-like engine repository made by a test: a real Cargo workspace, built by `cargo`.

It is what the built-in `mlxcel-*` sweeps expect of the engine, in miniature: the binaries
`target/release/mlxcel` (`generate`) and `target/release/mlxcel-bench-decode`, the crates' tests
`--test rocm_nvfp4_quant` and `-p mlxcel-core --lib nvfp4`, a `[profile.test-fast]`, the features
`rocm`/`metal`, and `scripts/bench_decode.sh` and `scripts/rocm_gpu_guard.sh`. Each prints the
engine's real output formats (`workers/command/mlxcel.py` quotes them). What the programs report
depends on the environment overrides of the seeds (`MLXCEL_NVFP4_DENSE_REPACK=1`: the affine
fallback, `MLX_ROCM_GATHER_QMV_EXPERT_BATCHED=0`: the MoE opt-out, ...) and on the commit: each
commit writes its `Knobs` (speeds, greedy text, whether the tests pass, the MLX pin and ROCm
overlay it reports, whether its guard knows `--hold` yet) into the core crate and the scripts.
The formats are today's: mlxcel-bench-decode's `[Memory] <phase>:` and `Decode path:` lines, and
bench_decode.sh's header and 17-column rows, 19 where the build is `--features rocm` (the script
probes the backend as the real one does).

The speeds are reported, not timed: this machine has no GPU, and the point is the orchestration
(builds, gate, arms, commits, parsing, criteria), with numbers that differ by known factors plus
about 1 % noise. The guard script keeps the real one's lock and nesting logic (an flock(1) on
`$ROCM_GPU_GUARD_LOCK`, skipped when `ROCM_GPU_GUARD_LOCK_HELD` names an ancestor) and leaves out
its idle gate and KFD contention monitor (no ROCm here); it appends each decision to
`$ROCM_GPU_GUARD_TRACE` when set, so a test can see which way it went.

Not collected (no `test_` prefix).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from orchestrator.specs.sweep import builtin_sweeps

REAL_HOME = Path.home()  # at import, before the tests' isolated HOME
CARGO = shutil.which("cargo")


def cargo_env() -> dict[str, str]:
    """What cargo (a rustup proxy) needs when HOME points elsewhere: its toolchain homes and PATH."""
    assert CARGO is not None
    return {
        "RUSTUP_HOME": os.environ.get("RUSTUP_HOME", str(REAL_HOME / ".rustup")),
        "CARGO_HOME": os.environ.get("CARGO_HOME", str(REAL_HOME / ".cargo")),
        "PATH": f"{Path(CARGO).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


@dataclass(frozen=True)
class Knobs:
    """What one commit of the engine does."""

    prefill: float = 120.0  # native prefill tok/s at 512 prompt tokens
    decode: float = 13.1  # native decode tok/s
    affine_prefill: float = 1.06  # the affine fallback's prefill over native's (the seed's 3-9 % gap)
    route_speedup: float = 1.0  # the expert-batched MoE route's prefill over the opt-out's
    greedy: str = "Paris. It is the largest city in France, on the Seine."
    route_greedy: str | None = None  # the route's text where it differs from the opt-out's
    tests_pass: bool = True
    builds: bool = True  # False: the core crate does not compile at this commit
    noise: float = 0.01  # each reported speed's relative noise: uniform within ±noise
    guard_hold: bool = True  # False: a commit older than `rocm_gpu_guard.sh --hold`
    mlx_commit: str = "81ba1c6a"  # the MLX pin the engine reports in bench_decode.sh's rows
    rocm_overlay: str = "75915908"  # the MLX ROCm overlay commit (its ROCm rows' column)


CARGO_TOML = """[workspace]
members = ["src/lib/mlxcel-core"]

[package]
name = "mlxcel"
version = "0.1.0"
edition = "2021"

[features]
rocm = []
metal = []
accelerate = []

[dependencies]
mlxcel-core = { path = "src/lib/mlxcel-core" }

[[bin]]
name = "mlxcel"
path = "src/main.rs"

[[bin]]
name = "mlxcel-bench-decode"
path = "src/bin/bench_decode.rs"

[profile.test-fast]
inherits = "dev"
"""

CORE_TOML = """[package]
name = "mlxcel-core"
version = "0.1.0"
edition = "2021"
"""

CORE_LIB = r"""//! The engine's speed model and greedy text; `knobs.rs` is what a commit changes.
mod knobs;
pub use knobs::*;
use std::time::{SystemTime, UNIX_EPOCH};

fn env_is(name: &str, values: &[&str]) -> bool {
    std::env::var(name).map(|v| values.contains(&v.trim().to_lowercase().as_str())).unwrap_or(false)
}
pub fn on(name: &str) -> bool { env_is(name, &["1", "true", "on", "yes"]) }
pub fn off(name: &str) -> bool { env_is(name, &["0", "false", "off", "no"]) }

pub struct Speed { pub prefill: f64, pub decode: f64, pub peak_gb: f64, pub load_s: f64 }

/// Uniform noise within ±NOISE, different in every process.
fn noise() -> f64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() as u64;
    let mut x = nanos ^ ((std::process::id() as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    1.0 + ((x % 2001) as f64 / 1000.0 - 1.0) * NOISE
}

pub fn speed(prompt_tokens: usize) -> Speed {
    let length = (prompt_tokens.max(1) as f64 / 512.0).log2().max(0.0);
    let affine = on("MLXCEL_NVFP4_DENSE_REPACK");
    let mut s = Speed { prefill: PREFILL * (1.0 - 0.012 * length), decode: DECODE,
                        peak_gb: 37.17 + 0.4 * length, load_s: 82.6 };
    if affine {
        s.prefill *= AFFINE_PREFILL; s.decode /= 2.65; s.peak_gb += 3.3 + 2.0 * length; s.load_s *= 2.75;
    }
    if off("MLXCEL_COMPILED_QGELU_MLP") { s.prefill *= 0.976; s.decode *= 0.97; }
    if !off("MLX_ROCM_GATHER_QMV_EXPERT_BATCHED") { s.prefill *= ROUTE_SPEEDUP; }
    s.prefill *= noise(); s.decode *= noise(); s.load_s *= noise();
    s
}

pub fn greedy_text() -> &'static str {
    if on("MLXCEL_NVFP4_DENSE_REPACK") { AFFINE_GREEDY }
    else if off("MLX_ROCM_GATHER_QMV_EXPERT_BATCHED") { GREEDY }
    else { ROUTE_GREEDY }
}

#[cfg(test)]
mod tests {
    #[test]
    fn nvfp4_dequant_matches_reference() {
        assert!(super::TESTS_PASS, "NVFP4 dequantization differs from the reference");
    }
}
"""

MAIN = r"""//! `mlxcel generate`, as far as the greedy-output check uses it.
use std::io::Write;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("generate") {
        eprintln!("usage: mlxcel generate -m MODEL -p PROMPT");
        std::process::exit(2);
    }
    let get = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let model = get("-m").unwrap_or_default();
    if !std::path::Path::new(&model).join("config.json").exists() {
        eprintln!("Error: failed to load model {model}");
        std::process::exit(1);
    }
    if std::env::var("MLXCEL_DEBUG_KERNEL_BACKEND").as_deref() == Ok("1") {
        let backend = if cfg!(feature = "rocm") { "rocm" } else if cfg!(feature = "metal") { "metal" } else { "cpu" };
        eprintln!("[mlxcel] custom kernel backend: {backend}");
    }
    let prompt = get("-p").unwrap_or_default();
    let text = mlxcel_core::greedy_text();
    let tokens = text.split_whitespace().count();
    let s = mlxcel_core::speed(prompt.len());
    println!("Loading model from {model}");
    println!("Generating...");
    print!("{prompt}");
    print!(" {text}");
    std::io::stdout().flush().unwrap();
    println!();
    println!();
    if args.iter().any(|a| a == "--profile") {
        println!("[Profile Results]");
        println!("  Prompt tokens:    {}", prompt.split_whitespace().count());
        println!("  Generated tokens: {tokens}");
        println!("  Prefill:          {:.2} ms ({:.2} tok/s)", 1000.0 * 8.0 / s.prefill, s.prefill);
        println!("  Decode:           {:.2} ms ({:.2} tok/s)", 1000.0 * tokens as f64 / s.decode, s.decode);
    } else {
        println!("[Generated {tokens} tokens in {:.2}s = {:.2} tok/s]", tokens as f64 / s.decode, s.decode);
    }
}
"""

BENCH = r"""//! `mlxcel-bench-decode`: load once, warm up, one measured pass; the engine's output format.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let model = get("-m").unwrap_or_default();
    let max_tokens: usize = get("-n").and_then(|v| v.parse().ok()).unwrap_or(100);
    let prompt_tokens: usize = get("--prompt-tokens").and_then(|v| v.parse().ok()).unwrap_or(12);
    let s = mlxcel_core::speed(prompt_tokens);
    if !std::path::Path::new(&model).join("config.json").exists() {
        eprintln!("Error: failed to load model");
        std::process::exit(1);
    }
    println!("[Load] wall: {:.3} s  MLX peak: {:.2} GB", s.load_s, s.peak_gb - 0.5);
    println!("[Memory] after load: active {:.2} GB, peak {:.2} GB, cache 0.00 GB", s.peak_gb - 0.5, s.peak_gb - 0.5);
    eprintln!("[long-prompt] target={prompt_tokens} tokens -> using {prompt_tokens} tokens \
               (max_context=Some(131072), reserved {max_tokens} for generation)");
    println!("[Memory] after warmup: active {:.2} GB, peak {:.2} GB, cache 0.41 GB", s.peak_gb - 0.5, s.peak_gb);
    println!("Decode path: {}", if mlxcel_core::on("MLXCEL_NVFP4_DENSE_REPACK") { "affine qmv" } else { "nvfp4 qmv" });
    println!("[Profile Results]");
    println!("  Prompt tokens:    {prompt_tokens}");
    println!("  Generated tokens: {max_tokens}");
    println!("  Prefill:          {:.2} ms ({:.2} tok/s)", 1000.0 * prompt_tokens as f64 / s.prefill, s.prefill);
    println!("  Decode:           {:.2} ms ({:.2} tok/s)", 1000.0 * max_tokens as f64 / s.decode, s.decode);
    println!("  MLX peak memory:  {:.2} GB", s.peak_gb);
    println!("[Memory] after measured: active {:.2} GB, peak {:.2} GB, cache 0.52 GB", s.peak_gb - 0.5, s.peak_gb);
}
"""

GATHER_TEST = r"""//! The sorted-gather route against the CPU reference (in miniature).
#[test]
fn sorted_gather_route_matches_cpu_reference_e128() {
    assert!(mlxcel_core::TESTS_PASS, "route output differs from the CPU reference at tolerance()");
}

#[test]
fn unsorted_gather_matches_cpu_reference() {}
"""

BENCH_DECODE_SH = r"""#!/usr/bin/env bash
# A compact stand-in for mlxcel's scripts/bench_decode.sh, single-model path, in today's format: the
# backend probed with a one-token `mlxcel generate` (MLXCEL_DEBUG_KERNEL_BACKEND=1), the header and
# one row per model on stdout (and in the CSV file), 17 columns, 19 on ROCm (the overlay commit and
# the HIP version), a trailing SKIP:/FAIL: field where the model was skipped or failed.
set -euo pipefail
BENCH=./target/release/mlxcel-bench-decode MLXCEL=./target/release/mlxcel
PROMPT="Hello, how are you today?" MAX_TOKENS=100 WARMUP=20 PROMPT_TOKENS="" MODEL="" OUTPUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prompt-tokens) PROMPT_TOKENS="$2"; shift 2 ;;
    --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    --output) OUTPUT="$2"; shift 2 ;;
    -*) echo "Unknown option: $1" >&2; exit 1 ;;
    *) MODEL="$1"; shift ;;
  esac
done
[[ -n "$MODEL" ]] || { echo "Error: model path or 'all' required" >&2; exit 1; }
[[ -x "$BENCH" ]] || { echo "Error: $BENCH not found. Run 'cargo build --release' first." >&2; exit 1; }
[[ -d "$MODEL" ]] || { echo "Error: model directory '$MODEL' not found" >&2; exit 1; }
probe=$(MLXCEL_DEBUG_KERNEL_BACKEND=1 "$MLXCEL" generate -m "$MODEL" -p Hello -n 1 2>&1 >/dev/null || true)
BACKEND=$(echo "$probe" | sed -n 's/.*custom kernel backend: \([a-z]*\).*/\1/p' | head -1)
BACKEND=${BACKEND:-cpu}
name=$(basename "$MODEL")
OUTPUT=${OUTPUT:-benchmarks/${BACKEND}_test_$(date +%F)_single_${name}.csv}
mkdir -p "$(dirname "$OUTPUT")"
HEADER="model,model_path,prompt_tokens,generated_tokens,prefill_ms,prefill_tok_s,decode_ms,decode_tok_s"
HEADER="$HEADER,date,hardware,mlxcel_version,build_type,max_tokens,prompt,prompt_target_len,mlxcel_commit,mlx_commit"
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
COMMIT_FIELDS="$(git rev-parse --short=8 HEAD 2>/dev/null || echo unknown),$(cat src/lib/mlx-cpp/MLX_COMMIT)"
if [[ "$BACKEND" == rocm ]]; then
  HEADER="$HEADER,mlx_rocm_overlay_commit,hip_version"
  COMMIT_FIELDS="$COMMIT_FIELDS,$(head -c 8 src/lib/mlx-cpp/patches-rocm/UPSTREAM),7.15.26333"
fi
emit() { echo "$1" | tee -a "$OUTPUT"; }
echo "$HEADER" > "$OUTPUT"; echo "$HEADER"
rest="$(date +%F),Test_CPU_8GB,$VERSION,release,$MAX_TOKENS,\"$PROMPT\",$PROMPT_TOKENS,$COMMIT_FIELDS"
if [[ -e "$MODEL/too_big" ]]; then
  echo ">>> [skip]   $name (too big)" >&2
  emit "$name,$MODEL,,,,,,,$rest,SKIP:oom_estimate"; exit 0
fi
extra=(); [[ -n "$PROMPT_TOKENS" ]] && extra=(--prompt-tokens "$PROMPT_TOKENS")
echo ">>> [bench]  $name (same-process warmup=$WARMUP) ..." >&2
rc=0
raw=$("$BENCH" -m "$MODEL" -p "$PROMPT" -n "$MAX_TOKENS" --warmup-tokens "$WARMUP" "${extra[@]}" 2>&1) || rc=$?
if (( rc != 0 )); then
  echo "    benchmark failed (exit $rc)" >&2
  emit "$name,$MODEL,,,,,,,$rest,FAIL:bench"; exit 0
fi
field() { echo "$raw" | sed -n "$1" | head -1; }
pt=$(field 's/.*Prompt tokens:[[:space:]]*\([0-9]*\).*/\1/p')
gt=$(field 's/.*Generated tokens:[[:space:]]*\([0-9]*\).*/\1/p')
pms=$(field 's/.*Prefill:[[:space:]]*\([0-9.]*\) ms.*/\1/p')
pts=$(field 's/.*Prefill:.*(\([0-9.]*\) tok\/s).*/\1/p')
dms=$(field 's/.*Decode:[[:space:]]*\([0-9.]*\) ms.*/\1/p')
dts=$(field 's/.*Decode:.*(\([0-9.]*\) tok\/s).*/\1/p')
echo "    decode: $dts tok/s" >&2
emit "$name,$MODEL,$pt,$gt,$pms,$pts,$dms,$dts,$rest"
"""

GUARD_SH = r"""#!/usr/bin/env bash
# A compact stand-in for mlxcel's scripts/rocm_gpu_guard.sh: its host-wide flock on
# $ROCM_GPU_GUARD_LOCK and its nesting (ROCM_GPU_GUARD_LOCK_HELD naming an ancestor of this guard
# skips the lock). Its idle gate and KFD contention monitor are left out: there is no ROCm GPU here.
set -euo pipefail
LOCK="${ROCM_GPU_GUARD_LOCK:-/tmp/mlxcel-rocm-gpu-guard.lock}" MAX_WAIT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hold) shift ;;  # HOLD_OPTION
    --idle-secs|--max-attempts|--log) shift 2 ;;
    --max-wait) MAX_WAIT="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "rocm_gpu_guard: unknown option $1" >&2; exit 2 ;;
  esac
done
note() {
  echo "rocm_gpu_guard: $*" >&2
  if [[ -n "${ROCM_GPU_GUARD_TRACE:-}" ]]; then echo "$*" >> "$ROCM_GPU_GUARD_TRACE"; fi
}
descends_from() {
  local pid="$1" root="$2" stat
  while [[ -n "$pid" && "$pid" != 0 && "$pid" != 1 ]]; do
    [[ "$pid" == "$root" ]] && return 0
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat="${stat##*) }"; read -r _ pid _ <<<"$stat"
  done
  return 1
}
held="${ROCM_GPU_GUARD_LOCK_HELD:-}"
rc=0
if [[ "$held" =~ ^[1-9][0-9]*$ && "$held" != "$$" ]] && descends_from "$$" "$held"; then
  note "nested: lock held by outer guard $held, not taking $LOCK"
  "$@" || rc=$?
else
  [[ -e "$LOCK" ]] || { (umask 000; : >>"$LOCK") 2>/dev/null || true; }
  exec {fd}<"$LOCK"
  if (( MAX_WAIT > 0 )); then flock -w "$MAX_WAIT" "$fd" || { note "gave up waiting for $LOCK"; exit 75; }
  else flock "$fd"; fi
  note "acquired guard lock $LOCK"
  export ROCM_GPU_GUARD_LOCK_HELD=$$
  "$@" {fd}<&- || rc=$?
fi
exit "$rc"
"""


def guard_script(*, hold: bool = True) -> str:
    """The guard as a commit has it: `hold=False` is one older than its `--hold` option."""
    return GUARD_SH if hold else "\n".join(ln for ln in GUARD_SH.split("\n") if "HOLD_OPTION" not in ln)


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` with a fixed identity and nothing of the user's configuration."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "HOME": str(repo.parent), "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def _rust_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Rust string literal for this text


class EngineRepo:
    """The repository: `commit(knobs)` writes a commit whose engine behaves as `knobs` says."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")
        files = {
            "Cargo.toml": CARGO_TOML,
            "src/lib/mlxcel-core/Cargo.toml": CORE_TOML,
            "src/lib/mlxcel-core/src/lib.rs": CORE_LIB,
            "src/main.rs": MAIN,
            "src/bin/bench_decode.rs": BENCH,
            "tests/rocm_nvfp4_quant.rs": GATHER_TEST,
            "scripts/bench_decode.sh": BENCH_DECODE_SH,
            "scripts/rocm_gpu_guard.sh": GUARD_SH,
            ".gitignore": "target/\nbenchmarks/\n",
        }
        for name, text in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text)
        for script in ("scripts/bench_decode.sh", "scripts/rocm_gpu_guard.sh"):
            (path / script).chmod(0o755)

    def commit(self, message: str, knobs: Knobs) -> str:
        """Write `knobs` into the core crate (and the scripts), commit, and return the commit id."""
        k = knobs
        (self.path / "scripts/rocm_gpu_guard.sh").write_text(guard_script(hold=k.guard_hold))
        (self.path / "src/lib/mlx-cpp/patches-rocm").mkdir(parents=True, exist_ok=True)
        (self.path / "src/lib/mlx-cpp/MLX_COMMIT").write_text(k.mlx_commit + "\n")
        (self.path / "src/lib/mlx-cpp/patches-rocm/UPSTREAM").write_text(k.rocm_overlay + "\n")
        affine = f"{k.greedy} The affine rounding picks another word."
        (self.path / "src/lib/mlxcel-core/src/knobs.rs").write_text(
            f"pub const PREFILL: f64 = {float(k.prefill)!r};\npub const DECODE: f64 = {float(k.decode)!r};\n"
            f"pub const AFFINE_PREFILL: f64 = {float(k.affine_prefill)!r};\n"
            f"pub const ROUTE_SPEEDUP: f64 = {float(k.route_speedup)!r};\n"
            f"pub const GREEDY: &str = {_rust_str(k.greedy)};\n"
            f"pub const ROUTE_GREEDY: &str = {_rust_str(k.route_greedy or k.greedy)};\n"
            f"pub const AFFINE_GREEDY: &str = {_rust_str(affine)};\n"
            f"pub const TESTS_PASS: bool = {str(k.tests_pass).lower()};\n"
            f"pub const NOISE: f64 = {float(k.noise)!r};\n"
            + ("" if k.builds else 'compile_error!("broken at this commit");\n')
        )
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "--allow-empty", "-m", message)  # a commit may leave the engine as it was
        return git(self.path, "rev-parse", "HEAD")


def make_checkpoint(path: Path, *, too_big: bool = False) -> Path:
    """A checkpoint directory as the engine's tools check for it (`config.json`)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "nemotron_h", "quantization": {"quant_method": "nvfp4"}}')
    if too_big:
        (path / "too_big").write_text("")
    return path


def edited_sweep(name: str, dest: Path, *, repo: Path, ref: str, checkpoint: Path, devices: list[str]) -> Path:
    """A copy of a built-in sweep with only its documented edits: repo, ref, checkpoint, devices.

    Each of the four must occur exactly once in the file, where its header says.
    """
    text = builtin_sweeps()[name].read_text()
    edits = [
        (r'^repo = "[^"]*"$', f'repo = "{repo}"'),
        (r'^ref = "[^"]*"$', f'ref = "{ref}"'),
        (r'^params = \{ checkpoint = "[^"]*" \}$', f'params = {{ checkpoint = "{checkpoint}" }}'),
        (r"^devices = \[[^\]]*\]$", "devices = [" + ", ".join(f'"{d}"' for d in devices) + "]"),
    ]
    for pattern, replacement in edits:
        text, n = re.subn(pattern, replacement.replace("\\", "\\\\"), text, flags=re.M)
        assert n == 1, f"{name}: {pattern} matched {n} times"
    dest.write_text(text)
    return dest
