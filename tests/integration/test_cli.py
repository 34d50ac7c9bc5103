"""The operator commands `leasekeeper leases list|get` against a real server."""

from __future__ import annotations

import asyncio
import json
import sys

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import dur


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "leasekeeper_server.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_leases_get_held_task_prints_its_lease(server, stub, namespace):
    await stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t1", owner_id="w", ttl=dur(30)))
    code, out, _ = await _cli("leases", "get", "t1", "-n", namespace, "--target", server.target)
    assert code == 0
    shown = json.loads(out)
    assert (shown["task_id"], shown["owner_id"], shown["fence"], shown["state"]) == (
        "t1",
        "w",
        1,
        "HELD",
    )


async def test_leases_get_unknown_task_exits_1(server, namespace):
    code, _, err = await _cli("leases", "get", "nope", "-n", namespace, "--target", server.target)
    assert code == 1
    assert "not found" in err


async def test_leases_list_state_filter_lists_only_that_state(server, stub, namespace):
    for task_id in ("a", "b", "c"):
        await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id=task_id, owner_id="w", ttl=dur(30))
        )
    await stub.Release(pb.ReleaseRequest(namespace=namespace, task_id="b", owner_id="w", fence=1))
    code, out, _ = await _cli(
        "leases", "list", "-n", namespace, "--state", "HELD", "--target", server.target
    )
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(x["task_id"], x["state"]) for x in listed] == [("a", "HELD"), ("c", "HELD")]


async def test_leases_get_bad_namespace_prints_one_line_exits_1(server):
    code, _, err = await _cli("leases", "get", "t", "-n", "", "--target", server.target)
    assert code == 1
    assert "namespace" in err
    assert "Traceback" not in err


async def test_leases_list_unreachable_server_prints_one_line_exits_2(unused_tcp_port):
    target = f"127.0.0.1:{unused_tcp_port}"
    code, _, err = await _cli("leases", "list", "-n", "ns", "--target", target)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err


async def test_effects_list_shows_what_was_reserved_by_which_fence(server, stub, namespace):
    await stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="w", ttl=dur(30)))
    for key in ("email", "draft"):
        await stub.BeginEffect(
            pb.BeginEffectRequest(
                namespace=namespace,
                task_id="t",
                fence=1,
                effect_key=key,
                policy=pb.EFFECT_POLICY_ONCE,
                request_digest=b"\x01\xff",
            )
        )
    await stub.CompleteEffect(
        pb.CompleteEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=1,
            effect_key="email",
            outcome=pb.EFFECT_STATE_SUCCEEDED,
            result=b"msg-7",
        )
    )
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await _cli("effects", "list", "t", *where)
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(x["effect_key"], x["state"], x["fence"]) for x in listed] == [
        ("draft", "RESERVED", 1),
        ("email", "SUCCEEDED", 1),
    ]
    assert (listed[1]["result"], listed[1]["request_digest"]) == ("msg-7", "01ff")
    assert listed[1]["complete_fence"] == 1 and listed[0]["complete_time"] is None
    code, out, _ = await _cli("effects", "list", "t", *where, "--state", "RESERVED")
    assert [json.loads(line)["effect_key"] for line in out.splitlines()] == ["draft"]
