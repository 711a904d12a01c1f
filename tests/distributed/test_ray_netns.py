"""Entry point of the Ray tests: Ray's servers listen on wildcard addresses and probe a
public DNS server for the node's address, so the Ray tests run in a private network
namespace that has only `lo` (`unshare --net`): nothing they start can reach or be
reached from any other address. This test starts that namespace and runs
`test_ray_backend.py` inside it; that module checks, inside, that `lo` is the only
interface and that every socket of the cluster is bound to loopback."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from ray_support import (
    NETNS_ENV,
    RAY_ENV,
    RAY_MODULE,
    ROOT,
    can_isolate,
    isolated,
    netns_command,
)

pytestmark = pytest.mark.ray


def test_ray_suite_passes_in_a_private_network_namespace() -> None:
    if isolated():
        pytest.skip("already inside the namespace: the Ray module runs directly here")
    pytest.importorskip("ray", reason="the Ray backend needs `pip install 'marlaas[ray]'`")
    why = can_isolate()
    if why is not None:
        pytest.skip(f"cannot isolate the Ray tests from the network: {why}")
    env = {**os.environ, **RAY_ENV, NETNS_ENV: "1"}
    command = netns_command("-q", "-p", "no:cacheprovider", str(RAY_MODULE))
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = re.search(r"(\d+) passed", output)
    assert summary is not None and int(summary.group(1)) >= 8, output[-3000:]
    assert "skipped" not in output.splitlines()[-1], output[-3000:]
