"""Helpers of the Ray tests (a plain module): the private network namespace they run in,
what Ray's processes listen on, and the test cluster's layout and spec."""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
from pathlib import Path

import psutil

#: Set (to "1") in the environment of the pytest that runs inside the namespace.
NETNS_ENV = "MARLAAS_RAY_NETNS"
RAY_MODULE = Path(__file__).with_name("test_ray_backend.py")
ROOT = Path(__file__).resolve().parents[2]

#: Environment of every Ray process of the tests: no probing of public DNS servers for
#: the node's address (Ray then uses loopback), no token files, no usage reports.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def interfaces() -> set[str]:
    """Network interfaces of this process's network namespace."""
    return set(psutil.net_if_addrs())


def isolated() -> bool:
    """True inside a network namespace whose only interface is loopback."""
    return interfaces() == {"lo"}


def can_isolate() -> str | None:
    """None when a private network namespace can be made here, else why not."""
    if os.geteuid() != 0:
        return "making a network namespace needs root (unshare --net)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def netns_command(*pytest_args: str) -> list[str]:
    """pytest of the Ray module in a fresh network namespace with only `lo`, up."""
    inner = 'ip link set lo up && exec "$0" -m pytest "$@"'
    return ["unshare", "--net", "--", "sh", "-c", inner, sys.executable, *pytest_args]


def listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses on which these processes listen (TCP) or are bound (UDP)."""
    out: set[str] = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid in pids and conn.laddr and (conn.status == "LISTEN" or not conn.raddr):
            out.add(conn.laddr.ip)
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def ray_pids() -> set[int]:
    """This process and every process of the Ray cluster it started (its descendants)."""
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.children(recursive=True))}
