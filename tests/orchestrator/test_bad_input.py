"""Bad sweep and inventory files: one line naming the file and field, exit 2, nothing written."""

from __future__ import annotations

import random
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.specs.checks import check_sweep_against_inventory
from orchestrator.specs.sweep import load_inventory, load_sweep
from tests.conftest import child_env

GOOD_CASE = """
[[cases]]
case = "qmm"
arms = ["native", "affine"]
params = { tokens = [1, 4], n = 32, k = 64, dtype = "float32" }
"""


def _sweep(tmp: Path, body: str) -> Path:
    path = tmp / "s.toml"
    path.write_text(body)
    return path


CASES = {
    "unknown field": ('name = "x"\ncolour = "red"\n' + GOOD_CASE, "field colour: unknown field"),
    "wrong type": ('name = "x"\nrepetitions = "ten"\n' + GOOD_CASE, "field repetitions"),
    "empty axis": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = [], n = 32, k = 64 }\n',
        "params.tokens: empty axis",
    ),
    "unknown case": ('name = "x"\n[[cases]]\ncase = "gemm9"\narms = ["native"]\n', "unknown case 'gemm9'"),
    "unknown arm": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native", "turbo"]\nparams = { tokens = 1, n = 32, k = 64 }\n',
        "unknown arm 'turbo'",
    ),
    "unknown device kind": ('name = "x"\ndevices = ["tpu-v9"]\n' + GOOD_CASE, "device kind 'tpu-v9' has no host"),
    "malformed toml": ('name = "x\n', "malformed TOML"),
    "copy of an unknown path": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = { affine = {}, again = { path = "afine" } }\n'
        "params = { tokens = 1, n = 32, k = 64 }\n",
        "arms.again.path: unknown arm 'afine'",
    ),
    "copy named as another arm": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = { affine = {}, native = { path = "affine" } }\n'
        "params = { tokens = 1, n = 32, k = 64 }\n",
        "arms.native.path: 'native' is an arm of case 'qmm'",
    ),
    "precision of 1 or more": ('name = "x"\nprecision = 1.5\n' + GOOD_CASE, "precision"),
    "budget of no time": ('name = "x"\nmax_seconds = 0\n' + GOOD_CASE, "max_seconds"),
    "missing param": (
        'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = 1, n = 32 }\n',
        "params.k: required",
    ),
}


@pytest.mark.parametrize("label", sorted(CASES))
def test_bad_sweep_exits_2_and_writes_nothing(label: str, tmp_path: Path, orchestrate_bin: str) -> None:
    body, expected = CASES[label]
    sweep = _sweep(tmp_path, body)
    results = tmp_path / "out"
    proc = subprocess.run(
        [orchestrate_bin, "run", "--sweep", str(sweep), "--results", str(results)],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(sweep) in lines[0]
    assert expected in lines[0]
    assert not results.exists()


def test_missing_inventory_file(tmp_path: Path, orchestrate_bin: str) -> None:
    missing = tmp_path / "nope.toml"
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(missing), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"orchestrate: error: {missing}: inventory file not found"
    assert not (tmp_path / "out").exists()


def test_inventory_unknown_field_and_duplicate_host(tmp_path: Path, orchestrate_bin: str) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text('[[hosts]]\nname = "a"\ndevice = "cpu"\n[[hosts]]\nname = "a"\ndevice = "cpu"\n')
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "host name 'a' is used twice" in proc.stderr and str(inv) in proc.stderr
    inv.write_text('[[hosts]]\nname = "a"\ndevice = "cpu"\ngpu_count = 2\n')
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--results", str(tmp_path / "out")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "field hosts.0.gpu_count: unknown field" in proc.stderr


def test_unwritable_results_dir(tmp_path: Path, orchestrate_bin: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [orchestrate_bin, "run", "--results", str(blocker / "results")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "results directory is not writable" in proc.stderr
    assert blocker.read_text() == "not a directory"


def test_unknown_builtin_sweep(tmp_path: Path, orchestrate_bin: str) -> None:
    proc = subprocess.run(
        [orchestrate_bin, "run", "--sweep", "nope"], capture_output=True, text=True, env=child_env(), timeout=60
    )
    assert proc.returncode == 2
    assert "unknown sweep 'nope'" in proc.stderr and "smoke" in proc.stderr


# ------------------------------------------------------------------------------------------------
# The corpus of issue 15, by class, at least two examples each, through the real CLI: exit 2, at
# most three lines on stderr (here: one), no traceback, the file and the field or line named, and
# nothing started or written (no results directory, no Ray temp dir: RAY_TMPDIR is the test's).

TINY = '[[cases]]\ncase = "qmm"\narms = ["native", "affine"]\nparams = { tokens = 1, n = 32, k = 64 }\n'
COMMAND = '[[cases]]\ncase = "command"\nrepo = "."\nparse = "json-lines"\narms = ["a", "b"]\n'


def _nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return "x = " + open_ * depth + close * depth + "\n"


def _criterion(where: str, arm: str = "native") -> str:
    return (
        'name = "c"\nbaseline = "affine"\n[[cases]]\ncase = "qmm"\narms = ["native", "affine"]\n'
        'params = { tokens = [1, 512, 4096], n = 32, k = 64, dtype = "bfloat16" }\n'
        f'[[criteria]]\nname = "long prompts"\nmetric = "prefill_tok_s"\narm = "{arm}"\nwhere = "{where}"\n'
        "min_ratio = 0.97\n"
    )


def _axes(n_axes: int, values: int) -> str:
    axes = ", ".join(f"p{i} = [{', '.join(str(v) for v in range(values))}]" for i in range(n_axes))
    return f'name = "big"\n{COMMAND}run = "./b {{p0}}"\nparams = {{ {axes} }}\n'


# label -> (file bytes, expected part of the one error line)
SWEEP_CORPUS: dict[str, tuple[bytes, str]] = {
    # not UTF-8
    "random bytes": (random.Random(15).randbytes(400), "is not UTF-8 text (byte 0x"),
    "UTF-16 with a BOM": ('name = "x"\n'.encode("utf-16"), "sweep file is UTF-16 (byte-order mark)"),
    "UTF-32 with a BOM": ('name = "x"\n'.encode("utf-32"), "sweep file is UTF-32 (byte-order mark)"),
    "Latin-1 text": ('name = "x"\ndescription = "caf\xe9"\n'.encode("latin-1"), "(byte 0xe9 at line 2)"),
    # nested too deep (Python's own limit, and merely deeper than any sweep needs)
    "3000 nested arrays": (_nested(3000).encode(), "nested deeper than 16 tables or arrays"),
    "2000 nested inline tables": (_nested(2000, "{a = ", "}").encode(), "nested deeper than 16"),
    "20 nested arrays": (_nested(20).encode(), "nested deeper than 16"),
    # too many jobs, counted before anything is expanded
    "9 axes of 10 values": (_axes(9, 10).encode(), "has 1,000,000,000 jobs, more than the limit of 10,000"),
    "one axis of 10001 values": (_axes(1, 10_001).encode(), "has 10,001 jobs, more than the limit of 10,000"),
    "two cases of 6000": (
        (
            f'name = "big"\n{COMMAND}name = "one"\nrun = "./b {{p0}}"\nparams = {{ p0 = {list(range(6000))} }}\n'
            f'{COMMAND}name = "two"\nrun = "./b {{p0}}"\nparams = {{ p0 = {list(range(6000))} }}\n'
        ).encode(),
        "sweep 'big' has 12,000 jobs",
    ),
    # parameters the case cannot run (the rule is the case's own)
    "qmm k not a multiple of 16": (
        b'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = 1, n = 32, k = [64, 100] }\n',
        "k = 100: not a multiple of 16, the NVFP4 group size",
    ),
    "moe hidden not a multiple of 16": (
        b'name = "x"\n[[cases]]\ncase = "moe-gather"\narms = ["native-sorted"]\n'
        b"params = { experts = 8, top_k = 2, tokens = 4, hidden = 200, expert_width = 64 }\n",
        "hidden = 200: not a multiple of 16",
    ),
    "moe top_k above experts": (
        b'name = "x"\n[[cases]]\ncase = "moe-gather"\narms = ["native-sorted"]\n'
        b"params = { experts = 4, top_k = 6, tokens = 4, hidden = 64, expert_width = 64 }\n",
        "top_k = 6: more than experts = 4",
    ),
    "mlp intermediate": (
        b'name = "x"\n[[cases]]\ncase = "mlp"\narms = ["fused"]\n'
        b"params = { tokens = 4, hidden = 64, intermediate = 1000 }\n",
        "intermediate = 1000: not a multiple of 16",
    ),
    "model hidden": (
        b'name = "x"\n[[cases]]\ncase = "model"\narms = ["native"]\nparams = { prompt_tokens = 8, hidden = 100 }\n',
        "hidden = 100: not a multiple of 64",
    ),
    "qmm dtype": (
        b'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        b'params = { tokens = 1, n = 32, k = 64, dtype = "float64" }\n',
        "dtype = 'float64': not one of float32, bfloat16, float16",
    ),
    "qmm zero tokens": (
        b'name = "x"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = [0, 1], n = 32, k = 64 }\n',
        "tokens = 0: must be at least 1",
    ),
    # a baseline that is no arm
    "baseline misspelt": (b'name = "x"\nbaseline = "afine"\n' + TINY.encode(), "'afine' is not an arm of any case"),
    "baseline of another case": (b'name = "x"\nbaseline = "fused"\n' + TINY.encode(), "field baseline: 'fused'"),
    # names with a trailing newline, or otherwise not names
    "sweep name with a newline": (b'name = "nightly\\n"\n' + TINY.encode(), "sweep name 'nightly\\n' must be"),
    "case name with a newline": (
        b'name = "x"\n' + TINY.replace('case = "qmm"', 'case = "qmm"\nname = "a\\n"').encode(),
        "case name 'a\\n'",
    ),
    "arm name with a newline": (
        f'name = "x"\n{COMMAND}run = "./b"\n'.replace('["a", "b"]', '["a", "b\\n"]').encode(),
        "arm name 'b\\n'",
    ),
    "device kind with a newline": (b'name = "x"\ndevices = ["cpu\\n"]\n' + TINY.encode(), "device kind 'cpu\\n'"),
    # environment keys and values
    "= in an env key": (
        b'name = "x"\n' + TINY.replace('["native", "affine"]', '{ native = { env = { "A=B" = "1" } } }').encode(),
        "environment variable name 'A=B' is not valid",
    ),
    "NUL in an env key": (
        b'name = "x"\n' + TINY.replace('["native", "affine"]', '{ native = { env = { "A\\u0000" = "1" } } }').encode(),
        "holds a NUL byte",
    ),
    "NUL in an env value": (
        b'name = "x"\n' + TINY.replace('["native", "affine"]', '{ native = { env = { A = "1\\u0000" } } }').encode(),
        "holds a NUL byte",
    ),
    "env key starting with a digit": (
        b'name = "x"\n' + TINY.replace('["native", "affine"]', '{ native = { env = { 1A = "1" } } }').encode(),
        "environment variable name '1A' is not valid",
    ),
    # template fields that would defeat the quoting
    "conversion !r": (
        f'name = "x"\n{COMMAND}run = "./b {{p!r}}"\nparams = {{ p = 1 }}\n'.encode(),
        "{p!r} is not a plain",
    ),
    "format spec :.3": (f'name = "x"\n{COMMAND}run = "./b {{p:.3}}"\nparams = {{ p = 1 }}\n'.encode(), "{p:.3} is not"),
    "index [0]": (f'name = "x"\n{COMMAND}run = "./b {{p[0]}}"\nparams = {{ p = 1 }}\n'.encode(), "{p[0]} is not"),
    "conversion in build": (
        f'name = "x"\n{COMMAND}run = "./b"\nbuild = "make {{backend!s}}"\n'.encode(),
        "build: template field {backend!s}",
    ),
    # criteria whose `where` selects nothing
    "where tokens >= 4k": (_criterion("tokens >= 4k").encode(), "'tokens >= 4k': >= compares numbers, and '4k' is not"),
    "where tokens >= 4O96": (_criterion("tokens >= 4O96").encode(), "and '4O96' is not one"),
    "where dtype > bfloat16": (_criterion("dtype > bfloat16").encode(), "> compares numbers, and 'bfloat16' is not"),
    "where tokens == 4O96": (_criterion("tokens == 4O96").encode(), "tokens is a number (1, 512, 4096), '4O96' is not"),
    "where beyond every point": (
        _criterion("tokens >= 40960").encode(),
        "criteria.0 ('long prompts'): where 'tokens >= 40960' selects no point of the sweep (tokens: 1, 512, 4096)",
    ),
    "where misspelt parameter": (_criterion("tokns >= 4096").encode(), "'tokns', not a parameter of its cases"),
    "where = for ==": (_criterion("tokens = 4096").encode(), "(compare with ==)"),
    "criterion arm misspelt": (_criterion("tokens >= 4096", "natve").encode(), "(did you mean 'native'?)"),
    # nan and inf are TOML floats, but no setting
    "min_ratio nan": (
        _criterion("tokens >= 4096").replace("min_ratio = 0.97", "min_ratio = nan").encode(),
        "field criteria.0.min_ratio: Input should be a finite number (found nan)",
    ),
    "timeout inf": (
        f'name = "x"\n{COMMAND}run = "./b"\ntimeout = inf\n'.encode(),
        "field cases.0.timeout: Input should be a finite",
    ),
    # misspelt fields get the nearest name
    "repetitons": (
        b'name = "x"\nrepetitons = 3\n' + TINY.encode(),
        "unknown field 'repetitons' (did you mean 'repetitions'?)",
    ),
    "parms": (
        b'name = "x"\n' + TINY.replace("params", "parms").encode(),
        "unknown field 'parms' (did you mean 'params'?)",
    ),
    "envv in an arm": (
        b'name = "x"\n' + TINY.replace('["native", "affine"]', "{ native = { envv = {} } }").encode(),
        "field cases.0.arms.native.envv: unknown field 'envv' (did you mean 'env'?)",
    ),
    "unknown case": (b'name = "x"\n' + TINY.replace('"qmm"', '"qnm"').encode(), "(did you mean 'qmm'?)"),
}

HEAD_LESS = '[[hosts]]\nname = {name!r}\ndevice = "cpu"\n'


def _inventory(*hosts: str, head: bool = False) -> bytes:
    text = '[head]\naddress = "127.0.0.1"\n' if head else ""
    return (text + "".join(f"[[hosts]]\n{h}\n" for h in hosts)).encode()


INVENTORY_CORPUS: dict[str, tuple[bytes, str]] = {
    # hosts that are not this machine, and no [head]: never run here
    "remote host name": (
        _inventory('name = "studio"\nhost = "studio.lab.example"\ndevice = "m1-ultra"\nbackend = "metal"'),
        "field hosts.0.host (host 'studio'): studio.lab.example is not this machine, and the inventory has no [head]",
    ),
    "remote address": (
        _inventory('name = "gpu"\nhost = "10.0.0.5"\ndevice = "h200"\nbackend = "cuda"'),
        "`orchestrate cluster up`",
    ),
    "localhost through a jump": (
        _inventory('name = "l"\nhost = "localhost"\nproxy_jump = "bastion"\ndevice = "cpu"'),
        "localhost through bastion is not this machine",
    ),
    "loopback on another port": (
        _inventory('name = "c"\nhost = "127.0.0.1"\nport = 2222\ndevice = "cpu"'),
        "127.0.0.1:2222 is not this machine",
    ),
    "two hosts of this machine": (
        _inventory('name = "a"\ndevice = "cpu"', 'name = "b"\ndevice = "m1-ultra"'),
        "an inventory without [head] is this machine alone, one host; this one lists 2 (a, b)",
    ),
    # relative lock paths
    "relative lock": (
        _inventory('name = "l"\ndevice = "cpu"\nlock = "gpu.lock"'),
        "lock 'gpu.lock' is not an absolute path",
    ),
    "dot lock": (
        _inventory('name = "l"\ndevice = "cpu"\nlock = "./run/gpu.lock"'),
        "lock './run/gpu.lock' is not an absolute",
    ),
    "home lock": (
        _inventory('name = "l"\ndevice = "cpu"\nlock = "~/gpu.lock"'),
        "lock '~/gpu.lock' is not an absolute",
    ),
    "relative lock in defaults": (
        b'[defaults]\nlock = "locks/gpu"\n' + _inventory('name = "l"\ndevice = "cpu"'),
        "lock 'locks/gpu' is not an absolute",
    ),
    # ProxyJump loops of any length, chains beyond the limit, bad ports
    "loop of three": (
        _inventory(
            *(f'name = "{a}"\nhost = "{a}.lab"\nproxy_jump = "{b}"\ndevice = "x"' for a, b in ("ab", "bc", "ca")),
            head=True,
        ),
        "a ProxyJump loop: a -> b -> c -> a",
    ),
    "loop of five": (
        _inventory(
            *(f'name = "h{i}"\nhost = "h{i}.lab"\nproxy_jump = "h{(i + 1) % 5}"\ndevice = "x"' for i in range(5)),
            head=True,
        ),
        "a ProxyJump loop: h0 -> h1 -> h2 -> h3 -> h4 -> h0",
    ),
    "a host jumping through itself": (
        _inventory('name = "a"\nhost = "a.lab"\nproxy_jump = ["j", "a.lab"]\ndevice = "x"', head=True),
        "a ProxyJump loop: a -> a",
    ),
    "200 hops": (
        _inventory(
            f'name = "a"\nhost = "a.lab"\nproxy_jump = "{",".join(f"j{i}.lab" for i in range(200))}"\ndevice = "x"',
            head=True,
        ),
        "a ProxyJump chain of more than 8 hops",
    ),
    "a chain of 12 inventory hosts": (
        _inventory(
            *(f'name = "h{i}"\nhost = "h{i}.lab"\nproxy_jump = "h{i + 1}"\ndevice = "x"' for i in range(11)),
            'name = "h11"\nhost = "h11.lab"\ndevice = "x"',
            head=True,
        ),
        "a ProxyJump chain of more than 8 hops",
    ),
    "jump port 99999": (
        _inventory('name = "a"\nhost = "a.lab"\nproxy_jump = "jump@bastion:99999"\ndevice = "x"', head=True),
        "port '99999' is not a number from 1 to 65535",
    ),
    "jump port abc": (
        _inventory('name = "a"\nhost = "a.lab"\nproxy_jump = "bastion:abc"\ndevice = "x"', head=True),
        "'bastion:abc': port 'abc' is not a number",
    ),
    "jump port 0": (_inventory('name = "a"\nhost = "a.lab"\nproxy_jump = "b:0"\ndevice = "x"', head=True), "port '0'"),
    "empty jump port": (
        _inventory('name = "a"\nhost = "a.lab"\nproxy_jump = "b:"\ndevice = "x"', head=True),
        "port ''",
    ),
    # names with a trailing newline; names Ray refuses as labels
    "host name with a newline": (_inventory('name = "local\\n"\ndevice = "cpu"'), "host name 'local\\n' must be"),
    "device kind with a newline": (_inventory('name = "l"\ndevice = "cpu\\n"'), "device kind 'cpu\\n' must be"),
    "label ending in a dash": (
        _inventory('name = "l"\ndevice = "cpu"\nlabels = { chip = "m1-" }'),
        "value of label chip 'm1-'",
    ),
    # environment keys
    "= in a host env key": (
        _inventory('name = "l"\ndevice = "cpu"\nenv = { "A=B" = "1" }'),
        "environment variable name 'A=B'",
    ),
    "NUL in a host env key": (_inventory('name = "l"\ndevice = "cpu"\nenv = { "A\\u0000" = "1" }'), "holds a NUL byte"),
    # misspelt fields, values out of range
    "backendd": (
        _inventory('name = "l"\ndevice = "cpu"\nbackendd = "cpu"'),
        "unknown field 'backendd' (did you mean 'backend'?)",
    ),
    "backend misspelt": (_inventory('name = "l"\ndevice = "cpu"\nbackend = "cdua"'), "(did you mean 'cuda'?)"),
    "node_ip not an IP": (
        _inventory('name = "l"\ndevice = "cpu"\nnode_ip = "studio.lan"'),
        "node_ip 'studio.lan' is not an IP",
    ),
}


def _problem(proc: subprocess.CompletedProcess[str], path: Path, expected: str, tmp: Path) -> str | None:
    """What is wrong with how the CLI refused a bad file (None: refused as it should be)."""
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 2:
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"
    if len(lines) != 1 or "Traceback" in proc.stderr:
        return f"not one line: {proc.stderr[-300:]}"
    if not lines[0].startswith(f"orchestrate: error: {path}: ") or expected not in lines[0]:
        return f"{lines[0]!r} does not name the file and say {expected!r}"
    if (tmp / "out").exists() or (tmp / "ray").exists():  # written, or Ray (its temp dir) started
        return "something was written or started"
    return None


def _cli_run(tmp: Path, bin_: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_, "run", *args, "--results", str(tmp / "out")],
        capture_output=True, text=True, env=child_env(RAY_TMPDIR=str(tmp / "ray")), timeout=300,
    )  # fmt: skip


def _corpus_files(tmp: Path, label: str, kind: str, body: bytes) -> tuple[Path, list[str]]:
    """Write one example under its own dir; the `orchestrate run` arguments that load it."""
    work = tmp / f"{kind}-{re.sub(r'[^A-Za-z0-9]+', '-', label)}-{abs(hash(label)) % 10**6}"
    work.mkdir()
    path = work / f"{kind}.toml"
    path.write_bytes(body)
    if kind == "sweep":
        return path, ["--sweep", str(path)]
    sweep = work / "tiny.toml"
    sweep.write_text('name = "tiny"\n' + TINY)
    return path, ["--inventory", str(path), "--sweep", str(sweep)]


CORPUS = [("sweep", label, *v) for label, v in SWEEP_CORPUS.items()] + [
    ("inventory", label, *v) for label, v in INVENTORY_CORPUS.items()
]


@pytest.mark.parametrize(("kind", "label", "body", "expected"), CORPUS, ids=[f"{c[0]}: {c[1]}" for c in CORPUS])
def test_corpus_is_refused_by_the_library(kind: str, label: str, body: bytes, expected: str, tmp_path: Path) -> None:
    path, _ = _corpus_files(tmp_path, label, kind, body)
    with pytest.raises(InputError) as refused:
        if kind == "sweep":
            load_sweep(str(path))
        else:
            check_sweep_against_inventory(load_sweep(str(path.parent / "tiny.toml")), load_inventory(path), "s")
    assert str(refused.value).startswith(f"{path}: ") and expected in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_corpus_is_refused_by_the_cli(tmp_path: Path, orchestrate_bin: str) -> None:
    """Every example of the corpus through `orchestrate run`, three at a time (each is a Python start-up)."""

    def refuse(example: tuple[str, str, bytes, str]) -> str | None:
        kind, label, body, expected = example
        path, args = _corpus_files(tmp_path, label, kind, body)
        problem = _problem(_cli_run(path.parent, orchestrate_bin, *args), path, expected, path.parent)
        return f"{kind} {label!r}: {problem}" if problem else None

    with ThreadPoolExecutor(max_workers=3) as pool:
        problems = [p for p in pool.map(refuse, CORPUS) if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("inventory", "expected"),
    [
        (
            '[[hosts]]\nname = "l"\ndevice = "cpu"\nmemory_gib = 0.5\n',
            "host 'l' (device kind cpu) has 512.0 MiB, its memory_gib",
        ),
        (None, "host 'local' (device kind cpu) has"),  # this machine's fingerprint: its RAM
    ],
    ids=["memory_gib", "this machine's RAM"],
)
def test_a_shape_beyond_the_device_memory_is_refused(
    inventory: str | None, expected: str, tmp_path: Path, orchestrate_bin: str
) -> None:
    sweep = tmp_path / "sweep.toml"
    n = 1 << 20 if inventory is None else 32768  # 2^40 weights (576 GiB) / 2^30 weights (0.6 GiB + x, y)
    sweep.write_text(
        f'name = "huge"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = {{ tokens = 1, n = {n}, k = {n} }}\n'
    )
    args = ["--sweep", str(sweep)]
    if inventory is not None:
        (tmp_path / "inv.toml").write_text(inventory)
        args += ["--inventory", str(tmp_path / "inv.toml")]
    proc = _cli_run(tmp_path, orchestrate_bin, *args)
    assert _problem(proc, sweep, f"field cases.0.params: qmm at tokens=1, n={n}, k={n}", tmp_path) is None
    assert expected in proc.stderr and "needs at least" in proc.stderr
    if inventory is None:
        assert "576.0 GiB" in proc.stderr and "this machine's RAM" in proc.stderr
