"""Hosts on one machine: Linux network namespaces joined by a bridge (needs root).

Each :class:`Host` is a namespace with one veth link to the bridge and an address of
its own on a private /24 that the :class:`Network` picked unused; the root namespace
(where the test runs) is the bridge's address. A host is cut off by setting its link
down (:meth:`Host.cut_off`), or from some peers only, in both directions, by an
nftables table inside its namespace (:meth:`Host.block`): the table dies with the
namespace. Everything is named after the creating process's pid (``almac<pid>``, the
bridge; ``almac<pid>h<n>``, its links; ``almac-<pid>-<host>``, the namespaces), so
:func:`sweep` removes what a killed run left (namespaces, their processes, links)
before a new one starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from alma_core.pids import alive

PREFIX = "almac"
NETNS_DIR = Path("/run/netns")


class HostsUnavailable(RuntimeError):
    """What is missing to make hosts on this machine, with what to do."""


def problem() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return (
            "the cluster's hosts are network namespaces, which only root can make. What to "
            "do: run the cluster tests as root (CI does), or `sudo make faults`"
        )
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed. What to do: apt-get install {package}"
    return None


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name``, then delete it."""
    pids = run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGCONT)  # a frozen process dies only once thawed
            os.kill(int(pid), signal.SIGKILL)
    run("ip", "netns", "delete", name, check=False)


def sweep() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (a run killed
    before its finalizer ran). Returns what was removed."""
    removed: list[str] = []
    names = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.exists() else []
    for name in names:
        found = re.match(rf"^{PREFIX}-(\d+)-", name)
        if found and not alive(int(found.group(1))):
            _kill_namespace(name)
            removed.append(name)
    for line in run("ip", "-o", "link", "show").stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        found = re.match(rf"^{PREFIX}(\d+)(h\d+)?$", link)
        if found and not alive(int(found.group(1))):
            run("ip", "link", "delete", link, check=False)
            removed.append(link)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.231.0.0/16 that no address on this machine is in."""
    used = run("ip", "-o", "-4", "addr", "show").stdout
    taken = {ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", used)}
    for _ in range(200):
        net = ipaddress.ip_network(f"10.231.{random.randint(1, 254)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostsUnavailable("no free /24 in 10.231.0.0/16 for the cluster's bridge")


@dataclass
class Host:
    """One namespace on the bridge: ``prefix`` runs a command there."""

    name: str  # the short name: k1, pg1, w1 ...
    netns: str
    address: str
    link: str  # the host end of its veth (on the bridge)
    blocked: set[str] = field(default_factory=set)

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def cut_off(self) -> None:
        """Nothing in or out: the link to the bridge is down."""
        run("ip", "link", "set", self.link, "down")

    def reconnect(self) -> None:
        run("ip", "link", "set", self.link, "up")
        self.unblock()

    def block(self, *peers: str) -> None:
        """Drop every packet between this host and ``peers`` (addresses), both ways."""
        self.blocked.update(peers)
        self._write_rules()

    def unblock(self) -> None:
        self.blocked.clear()
        self._write_rules()

    def _write_rules(self) -> None:
        run(*self.prefix, "nft", "delete", "table", "inet", "almacut", check=False)
        if not self.blocked:
            return
        peers = ", ".join(sorted(self.blocked))
        rules = (
            "table inet almacut {\n"
            f"  chain in {{ type filter hook input priority 0; ip saddr {{ {peers} }} drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; ip daddr {{ {peers} }} drop; }}\n"
            "}\n"
        )
        subprocess.run([*self.prefix, "nft", "-f", "-"], input=rules, text=True, check=True)


class Network:
    """A bridge and the hosts on it; :meth:`close` removes all of it (and kills what
    runs in the hosts)."""

    def __init__(self) -> None:
        found = problem()
        if found:
            raise HostsUnavailable(found)
        sweep()
        self.tag = str(os.getpid())  # one network per process at a time
        self.bridge = f"{PREFIX}{self.tag}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])  # the root namespace's address on the bridge
        self._next = iter(addresses[1:])
        self.hosts: dict[str, Host] = {}
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        index = len(self.hosts)
        netns = f"{PREFIX}-{self.tag}-{name}"
        link = f"{self.bridge}h{index}"  # 15 characters at most: pids have 7 digits
        inner = "eth0"  # inside the namespace: no other link to collide with
        address = str(next(self._next))
        run("ip", "netns", "add", netns)
        host = Host(name, netns, address, link)
        self.hosts[name] = host
        run("ip", "link", "add", link, "type", "veth", "peer", "name", inner, "netns", netns)
        run("ip", "link", "set", link, "master", self.bridge)
        run("ip", "link", "set", link, "up")
        run(*host.prefix, "ip", "addr", "add", f"{address}/24", "dev", inner)
        run(*host.prefix, "ip", "link", "set", inner, "up")
        run(*host.prefix, "ip", "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            _kill_namespace(host.netns)
        self.hosts.clear()
        run("ip", "link", "delete", self.bridge, check=False)
