"""Three "hosts" on one machine: network namespaces joined by veth pairs and a bridge.

Each namespace has its own address; workers listen on it and meet through a tcp://
rendezvous on host 0. Needs root (ip netns); skipped with the reason otherwise. The
namespaces are removed afterwards, also when the test fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HOSTS = 3
SCRIPT = Path(__file__).with_name("host_worker.py")
ROOT = Path(__file__).parents[2]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def _netns_usable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"agprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=20)
    if result.returncode != 0:
        return f"creating network namespaces is not permitted here: {result.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


@pytest.fixture
def hosts():  # type: ignore[no-untyped-def]
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    tag = f"ag{os.getpid() % 100000}"
    switch = f"{tag}sw"
    names = [f"{tag}h{i}" for i in range(HOSTS)]
    subnet = 200 + os.getpid() % 50
    addresses = [f"10.213.{subnet}.{i + 1}" for i in range(HOSTS)]
    created = []
    try:
        for ns in [switch, *names]:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=20)
            created.append(ns)
        _ip("link", "add", "br0", "type", "bridge", ns=switch)
        _ip("link", "set", "br0", "up", ns=switch)
        for i, ns in enumerate(names):
            host_end, switch_end = f"{tag}v{i}", f"{tag}p{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", switch)
            _ip("link", "set", switch_end, "master", "br0", ns=switch)
            _ip("link", "set", switch_end, "up", ns=switch)
            _ip("addr", "add", f"{addresses[i]}/24", "dev", host_end, ns=ns)
            _ip("link", "set", host_end, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield list(zip(names, addresses, strict=True))
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@pytest.mark.slow
def test_training_across_three_hosts(hosts) -> None:  # type: ignore[no-untyped-def]
    master = hosts[0][1]
    # 2 ms of one-way latency on every frame (netem is not available on every kernel)
    env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT="29517", KEY=secrets.token_hex(16),
               PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               ACTORGRAD_TEST_DELAY_MS="2")
    procs = []
    try:
        for rank, (ns, address) in enumerate(hosts):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(SCRIPT)],
                env=dict(env, RANK=str(rank), HOST_ADDR=address),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            ))
        outputs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(outputs)
    assert "MULTIHOST OK" in outputs[0], outputs[0]
    assert f"'{hosts[1][1]}'" in outputs[0] and f"'{hosts[2][1]}'" in outputs[0]
