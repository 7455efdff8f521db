"""Inventories: defaults inheritance, the worked example, and bad input refused with exit 2."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.cluster.nodes import node_command, node_env, registration
from orchestrator.specs.sweep import HostSpec, load_inventory
from tests.conftest import REPO, child_env

GOOD_HOSTS = """
[head]
address = "127.0.0.1"
ray_port = 46999
workdir = "{head}"

[defaults]
user = "bench"
python = "/opt/venv/bin/python"
env = {{ SHARED = "1" }}

[[hosts]]
name = "a"
host = "127.0.0.2"
device = "kind-a"
env = {{ OWN = "2" }}
"""


def write(tmp_path: Path, text: str, name: str = "inv.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_inherited_and_host_fields_win(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, GOOD_HOSTS.format(head=tmp_path / "head")))
    (host,) = inv.hosts
    assert (host.user, host.python, host.env) == ("bench", "/opt/venv/bin/python", {"SHARED": "1", "OWN": "2"})
    assert inv.head.address == "127.0.0.1" and not inv.embedded


def test_lab_example_is_valid_and_starts_nodes_with_the_right_labels() -> None:
    inv = load_inventory(REPO / "inventories" / "lab.toml")
    studio, strix = inv.hosts
    assert (studio.device, studio.backend, strix.device, strix.backend) == ("m1-ultra", "metal", "gfx1151", "rocm")
    assert strix.proxy_jump == ["jump@bastion.lab.example:22"]
    assert strix.lock == "/tmp/mlxcel-rocm-gpu-guard.lock"
    paths = {"workdir": "/home/bench/.orchestrate", "token": "/home/bench/.orchestrate/auth_token"}
    argv = node_command(strix, inv, paths, "Linux")
    assert argv[argv.index("--labels") + 1] == "device-kind=gfx1151,backend=rocm,host=strix,chip=strix-halo"
    assert argv[argv.index("--resources") + 1] == '{"gpu_slot": 1}'
    assert argv[argv.index("--address") + 1] == "head.lab.example:6379"
    mac = node_env(studio, paths, "Darwin")
    assert mac["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1" and mac["RAY_AUTH_MODE"] == "token"
    assert mac["RAY_AUTH_TOKEN_PATH"] == "/home/bench/.orchestrate/auth_token"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in node_env(strix, paths, "Linux")
    assert node_env(strix, paths, "Linux")["ORCHESTRATE_LOCK_PATH"] == "/tmp/mlxcel-rocm-gpu-guard.lock"


BAD = {
    "duplicate host names": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\n'
        '[[hosts]]\nname = "a"\nhost = "10.0.0.2"\ndevice = "x"\n',
        "hosts: the host name 'a' is used twice",
    ),
    "invalid port": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\nport = 70000\ndevice = "x"\n',
        "field hosts.0.port: Input should be less than or equal to 65535 (found 70000)",
    ),
    "ProxyJump loop": (
        '[[hosts]]\nname = "a"\nhost = "a"\nproxy_jump = "b"\ndevice = "x"\n'
        '[[hosts]]\nname = "b"\nhost = "b"\nproxy_jump = "a"\ndevice = "x"\n',
        "field hosts.0.proxy_jump (host 'a'): a ProxyJump loop: a -> b -> a",
    ),
    "metacharacters in a host name": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1;reboot"\ndevice = "x"\n',
        "field hosts.0.host: value '10.0.0.1;reboot' contains shell metacharacters, spaces or control characters",
    ),
    "metacharacters in a path": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\npython = "/opt/$(id)/python"\ndevice = "x"\n',
        "field hosts.0.python: value '/opt/$(id)/python' contains shell metacharacters, spaces or control characters",
    ),
    "gpus neither a list nor all": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\ngpus = "0,1"\n',
        "field hosts.0.gpus: gpus '0,1' is neither \"all\" nor a list of GPU indices such as [0, 1]",
    ),
    "a GPU named twice": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\ngpus = [0, 1, 1]\n',
        "field hosts.0.gpus: gpus [0, 1, 1] names GPU 1 twice",
    ),
    "a GPU index that is no index": (
        '[defaults]\ngpus = [0, 1.5]\n[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\n',
        "field defaults.gpus: gpus [0, 1.5]: 1.5 is not a GPU index (a whole number >= 0)",
    ),
    "the GPU label is orchestrate's": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\nlabels = { gpu-index = "3" }\n',
        "field hosts.0.labels: label 'gpu-index' is set by orchestrate itself (from the host's fields)",
    ),
    "unknown field": (
        '[[hosts]]\nname = "a"\nhost = "10.0.0.1"\ndevice = "x"\nfrobnicate = 1\n',
        "field hosts.0.frobnicate: unknown field 'frobnicate' (allowed: " + ", ".join(HostSpec.model_fields) + ")",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inventory_exits_2_naming_file_and_field_and_starts_nothing(
    case: str, tmp_path: Path, orchestrate_bin: str
) -> None:
    text, message = BAD[case]
    head = tmp_path / "head"
    path = write(tmp_path, f'[head]\naddress = "127.0.0.1"\nray_port = 46998\nworkdir = "{head}"\n' + text)
    proc = subprocess.run(
        [orchestrate_bin, "cluster", "up", "--inventory", str(path)],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"orchestrate: error: {path}: {message}"
    assert not head.exists()  # nothing was started: the head's workdir was never made


def test_sweep_device_kind_without_a_host_exits_2(tmp_path: Path, orchestrate_bin: str) -> None:
    inv = write(tmp_path, GOOD_HOSTS.format(head=tmp_path / "head"))
    sweep = write(
        tmp_path,
        'name = "s"\ndevices = ["gfx1151"]\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
        "params = { tokens = 1, n = 64, k = 64 }\n",
        "sweep.toml",
    )
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--sweep", str(sweep), "--results", str(tmp_path / "r")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"{sweep}: field devices: device kind 'gfx1151' has no host in the inventory" in proc.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "head").exists()


def test_run_without_a_live_head_fails_fast_with_exit_3(tmp_path: Path, orchestrate_bin: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = write(tmp_path, GOOD_HOSTS.format(head=tmp_path / "head").replace("46999", str(port)))
    sweep = write(
        tmp_path,
        'name = "s"\n[[cases]]\ncase = "qmm"\narms = ["native"]\nparams = { tokens = 1, n = 64, k = 64 }\n',
        "sweep.toml",
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [orchestrate_bin, "run", "--inventory", str(inv), "--sweep", str(sweep), "--results", str(tmp_path / "r")],
        capture_output=True, text=True, env=child_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert f"no Ray head answers at 127.0.0.1:{port}: start the cluster with `orchestrate cluster up`" in proc.stderr
    assert time.monotonic() - t0 < 30  # not Ray's minutes-long wait for a GCS that is not there


def test_a_node_counts_as_joined_only_alive_with_its_labels_and_a_gpu_slot() -> None:
    inv = load_inventory(REPO / "inventories" / "lab.toml")
    strix = inv.hosts[1]
    labels = {
        "device-kind": "gfx1151",
        "backend": "rocm",
        "host": "strix",
        "chip": "strix-halo",
        "ray.io/node-id": "ab",
    }

    def node(alive: bool = True, slot: float = 1.0, **over: str) -> dict[str, object]:
        return {"Alive": alive, "Labels": {**labels, **over}, "Resources": {"CPU": 16.0, "gpu_slot": slot}}

    assert registration([node()], strix) == (True, "")
    assert registration([node(alive=False), node()], strix) == (True, "")  # an old dead entry beside the new one
    assert registration([node(alive=False)], strix) == (False, "")
    assert registration([node(host="studio")], strix) == (False, "")  # another host's node
    assert registration([node(**{"device-kind": "cpu"})], strix) == (
        False,
        "a node registered as host 'strix' with labels {'device-kind': 'cpu'} where {'device-kind': 'gfx1151'} "
        "was expected",
    )
    assert registration([node(slot=0.0)], strix) == (False, "a node registered as host 'strix' with no gpu_slot")
