"""The library behind issue 15's refusals: ProxyJump chains, which host is this machine, counting
jobs without making them, and pydantic's errors as one line that says what was found."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.cluster.reach import MAX_JUMPS, JumpHop, is_this_machine, parse_hop
from orchestrator.cluster.target import SshTarget
from orchestrator.errors import InputError
from orchestrator.run.plan import expand
from orchestrator.specs.case import MAX_JOBS
from orchestrator.specs.checks import check_sweep_against_inventory
from orchestrator.specs.sweep import InventorySpec, SweepSpec, load_inventory, load_sweep
from orchestrator.specs.toml import validation_message

# ------------------------------------------------------------------------------------- ProxyJump


def test_hops_parse_like_ssh_dash_j() -> None:
    assert parse_hop("bench@bastion.lab:2222") == JumpHop("bastion.lab", 2222, "bench")
    assert parse_hop("bastion") == JumpHop("bastion", None, None)
    assert parse_hop("10.0.0.1:65535").port == 65535
    for bad, message in [
        ("bastion:99999", "port '99999' is not a number from 1 to 65535"),
        ("bastion:0", "port '0'"),
        ("bastion:abc", "port 'abc'"),
        ("bastion:２２", "port '２２'"),  # fullwidth digits: `isdigit` says yes, ssh says no
        ("a@b@c", "is not [user@]host[:port]"),
        ("@bastion", "is not [user@]host[:port]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_hop(bad)


def _hosts(*entries: dict[str, Any]) -> InventorySpec:
    return InventorySpec.model_validate({"head": {"address": "10.0.0.100"}, "hosts": list(entries)})


def test_a_jump_through_an_inventory_host_goes_through_its_own_jumps_and_address() -> None:
    inv = _hosts(
        {"name": "bastion", "host": "10.0.0.1", "port": 2200, "user": "gate", "device": "x"},
        {"name": "relay", "host": "10.0.0.2", "proxy_jump": "bastion", "device": "x"},
        {"name": "strix", "host": "10.0.0.3", "proxy_jump": "me@relay:2022", "device": "x"},
    )
    by_name = {h.name: h for h in inv.hosts}
    assert by_name["relay"].proxy_jump == ["gate@10.0.0.1:2200"]
    assert by_name["strix"].proxy_jump == ["gate@10.0.0.1:2200", "me@10.0.0.2:2022"]
    target = SshTarget.from_host(by_name["strix"], ssh_config=Path("/nonexistent"))
    assert [(h.hostname, h.port, h.user) for h in target.jumps] == [
        ("10.0.0.1", 2200, "gate"),
        ("10.0.0.2", 2022, "me"),
    ]


def test_chains_up_to_the_limit_are_accepted_and_one_more_is_not() -> None:
    ok = _hosts({"name": "a", "host": "a.lab", "proxy_jump": [f"j{i}.lab" for i in range(MAX_JUMPS)], "device": "x"})
    assert len(ok.hosts[0].proxy_jump) == MAX_JUMPS
    with pytest.raises(ValidationError, match=f"more than {MAX_JUMPS} hops"):
        _hosts({"name": "a", "host": "a.lab", "proxy_jump": [f"j{i}.lab" for i in range(MAX_JUMPS + 1)], "device": "x"})
    nested = [
        {"name": f"h{i}", "host": f"h{i}.lab", "proxy_jump": f"h{i + 1}", "device": "x"} for i in range(MAX_JUMPS)
    ]
    nested.append({"name": f"h{MAX_JUMPS}", "host": f"h{MAX_JUMPS}.lab", "device": "x"})
    assert len(_hosts(*nested).hosts[0].proxy_jump) == MAX_JUMPS  # h0 through h8 .. h1
    nested.insert(0, {"name": "top", "host": "top.lab", "proxy_jump": "h0", "device": "x"})
    with pytest.raises(ValidationError, match=f"more than {MAX_JUMPS} hops"):
        _hosts(*nested)


@pytest.mark.parametrize("length", [2, 3, 4, 7])
def test_loops_of_any_length_are_refused(length: int) -> None:
    hosts = [
        {"name": f"h{i}", "host": f"h{i}.lab", "proxy_jump": f"h{(i + 1) % length}", "device": "x"}
        for i in range(length)
    ]
    loop = " -> ".join([*(f"h{i}" for i in range(length)), "h0"])
    with pytest.raises(ValidationError, match=f"a ProxyJump loop: {loop}"):
        _hosts(*hosts)


# ------------------------------------------------------------------------------ this machine


def test_which_hosts_are_this_machine() -> None:
    me = socket.gethostname()
    for host in (None, "localhost", "127.0.0.1", "127.0.0.7", "::1", me, me.upper()):
        assert is_this_machine(host), host
    assert not is_this_machine("localhost", port=2222)  # another sshd: a container or a VM
    assert not is_this_machine("127.0.0.1", proxy_jump=["bastion"])
    for host in ("studio.lab.example", "10.0.0.5", "192.168.1.20", f"{me}x"):
        assert not is_this_machine(host), host


def test_an_inventory_without_head_may_name_this_machine_but_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "inv.toml"
    path.write_text(f'[[hosts]]\nname = "here"\nhost = "{socket.gethostname()}"\ndevice = "cpu"\n')
    assert load_inventory(path).embedded
    path.write_text('[[hosts]]\nname = "there"\nhost = "studio.lab.example"\ndevice = "m1-ultra"\n')
    with pytest.raises(
        InputError, match=r"inv\.toml: field hosts\.0\.host \(host 'there'\): studio\.lab\.example is not"
    ):
        load_inventory(path)
    path.write_text(
        '[head]\naddress = "10.0.0.1"\n[[hosts]]\nname = "there"\nhost = "studio.lab.example"\ndevice = "x"\n'
    )
    assert not load_inventory(path).embedded  # with a head: the hosts join its cluster


# ------------------------------------------------------------------------------- counting jobs


def _command_sweep(axes: dict[str, int], cases: int = 1) -> dict[str, Any]:
    params = {name: list(range(n)) for name, n in axes.items()}
    case = {"case": "command", "repo": ".", "run": "./b", "parse": "json-lines", "arms": ["a"], "params": params}
    return {"name": "big", "cases": [{**case, "name": f"c{i}"} for i in range(cases)]}


def test_a_billion_jobs_are_counted_not_made() -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match="case 'c0' has 1,000,000,000 jobs, more than the limit of 10,000"):
        SweepSpec.model_validate(_command_sweep({f"p{i}": 10 for i in range(9)}))
    assert time.perf_counter() - t0 < 5  # expanding would take minutes and gigabytes


def test_the_limit_counts_device_kinds_too() -> None:
    sweep = SweepSpec.model_validate(_command_sweep({"p": MAX_JOBS // 2}))  # 5,000 points: fine on one kind
    one = InventorySpec.model_validate({"hosts": [{"name": "a", "device": "cpu"}]})
    assert check_sweep_against_inventory(sweep, one, "s.toml") == ["cpu"]
    assert len(expand(sweep, one, ["cpu"], run_id="r", version="v", digest="d")) == MAX_JOBS // 2
    two = InventorySpec.model_validate(
        {"head": {"address": "10.0.0.1"}, "hosts": [{"name": "a", "device": "cpu"}, {"name": "b", "device": "h200"}]}
    )
    check_sweep_against_inventory(sweep, two, "s.toml")  # 10,000: at the limit
    bigger = SweepSpec.model_validate(_command_sweep({"p": MAX_JOBS // 2 + 1}))
    with pytest.raises(InputError, match=r"s\.toml: sweep 'big' on cpu, h200 has 10,002 jobs, more than the limit"):
        check_sweep_against_inventory(bigger, two, "s.toml")
    with pytest.raises(InputError, match="10,002 jobs"):  # a library caller that skips the check
        expand(bigger, two, ["cpu", "h200"], run_id="r", version="v", digest="d")
    with pytest.raises(ValidationError, match="sweep 'big' has 10,002 jobs"):  # points alone, at load
        SweepSpec.model_validate(_command_sweep({"p": MAX_JOBS // 2 + 1}, cases=2))


# ---------------------------------------------------------------------------------- messages


def _message(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as exc:
        SweepSpec.model_validate(data)
    return validation_message(exc.value, SweepSpec)


CASE = {"case": "qmm", "arms": ["native"], "params": {"tokens": 1, "n": 32, "k": 64}}


def test_messages_say_what_was_found_and_what_is_allowed() -> None:
    assert _message({"name": "s", "repetitions": "ten", "cases": [CASE]}) == (
        "field repetitions: Input should be a valid integer, unable to parse string as an integer (found 'ten')"
    )
    bad_value = {**CASE, "params": {"tokens": {"a": 1}, "n": 32, "k": 64}}
    assert _message({"name": "s", "cases": [bad_value]}).startswith(
        "field cases.0.params.tokens: a table is not one of the allowed types (int, float, str, bool, list["
    )
    assert _message({"name": "s", "cases": [{**CASE, "arms": 5}]}) == (
        "field cases.0.arms: 5 is not one of the allowed types (list[str], dict[str,ArmSpec])"
    )
    assert _message({"name": "s", "cases": [{**CASE, "arms": ["native", 5]}]}) == (
        "field cases.0.arms.1: Input should be a valid string (found 5)"
    )
    assert _message({"name": "s", "cases": [{**CASE, "colour": 1}]}).startswith(
        "field cases.0.colour: unknown field 'colour' (allowed: case, name, arms, params,"
    )
    assert _message({"name": "s"}) == "field cases: required field missing"


def test_a_utf8_byte_order_mark_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'name = "bom"\n[[cases]]\ncase = "qmm"\narms = ["native"]\n'
                     b"params = { tokens = 1, n = 32, k = 64 }\n")  # fmt: skip
    assert load_sweep(str(path)).name == "bom"
