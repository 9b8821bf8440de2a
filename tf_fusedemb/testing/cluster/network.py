"""Emulated hosts on one machine: network namespaces on a bridge, rate-limited links.

Layout of a cluster named ``NAME`` with H hosts on subnet ``S`` (a /24 by default)::

    root namespace   NAME_br  bridge, address S.1 (the rendezvous server listens here)
                     NAME_v1 ... NAME_vH   root ends of the veth pairs, ports of NAME_br
    host i           namespace NAME_hi, device eth0 (peer of NAME_vi), address S.(10+i)
                     /etc/netns/NAME_hi/hosts  (``ip netns exec`` mounts it over /etc/hosts)

Each host's link is limited to its rate in both directions with a ``tbf`` qdisc: on its
eth0 (what it sends) and on NAME_vi (what the bridge sends to it), like a full-duplex NIC.
Ranks inside one host talk over the namespace's loopback, unlimited, like one machine.
Traffic stays on these addresses; nothing is routed anywhere else.
"""
import dataclasses
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import contextlib
from typing import Dict, List, Optional, Sequence

from tf_fusedemb.testing.cluster.errors import ClusterUnavailable

NETNS_ETC = "/etc/netns"
HOST_IFACE = "eth0"  # the same device name in every host, so HOROVOD_GLOO_IFACE is one value
# Names the cluster builds are NAME_br / NAME_vI (<= 15 characters, the kernel's IFNAMSIZ).
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")
# Default names are "fe<pid>" plus an optional letter; the pid lets a later run tell a crashed
# run's leftovers (pid gone) from a live cluster of another process.
_DEFAULT_NAME_RE = re.compile(r"^fe(\d+)[a-z]?$")
_DEFAULT_POOL = ipaddress.IPv4Network("10.77.0.0/16")  # /24s of it are handed out in order
_LOCK_PATH = "/run/lock/tf_fusedemb_cluster.lock" if os.path.isdir("/run/lock") \
    else "/tmp/tf_fusedemb_cluster.lock"


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated host.

    Attributes:
        index: int, 1-based position of the host (host 1 holds the lowest ranks).
        namespace: str, the network namespace, also the Horovod hostname of its ranks.
        address: str, IPv4 address of its eth0.
        veth: str, the root-namespace end of its link (a port of the bridge).
        mbit: float, the link rate in Mbit/s, each direction.
    """
    index: int
    namespace: str
    address: str
    veth: str
    mbit: float


def _cmd(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs one iproute2 command; on failure with check=True raises CalledProcessError whose
    stderr says why (the caller turns it into ClusterUnavailable or a teardown warning)."""
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


def check_available(need_taskset: bool = True) -> None:
    """Raises ClusterUnavailable naming what this machine lacks; returns None when it can
    build emulated hosts (root, iproute2 ``ip`` and ``tc``, util-linux ``taskset``, and a
    network namespace can really be created)."""
    if not os.path.exists("/proc/self/ns/net"):
        raise ClusterUnavailable("network namespaces need Linux (/proc/self/ns/net is absent)")
    if os.geteuid() != 0:
        raise ClusterUnavailable("emulated hosts need root (network namespaces, veth, tc); "
                                 f"running as uid {os.geteuid()}")
    tools = {"ip": "iproute2", "tc": "iproute2"}
    if need_taskset:
        tools["taskset"] = "util-linux"
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"`{tool}` not found: install {package} "
                                     f"(apt-get install -y {package}; `make setup` does it)")
    probe = f"fe_probe{os.getpid()}"
    made = _cmd(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise ClusterUnavailable(f"cannot create a network namespace (`ip netns add`): "
                                 f"{made.stderr.strip()}")
    _cmd(["ip", "netns", "del", probe], check=False)


def default_name(taken: Sequence[str] = ()) -> str:
    """Returns "fe<pid>" or, when this process already runs a cluster of that name,
    "fe<pid>b", "fe<pid>c", ...; ``taken`` lists the names in use by this process."""
    base = f"fe{os.getpid()}"
    for suffix in [""] + [chr(c) for c in range(ord("b"), ord("z") + 1)]:
        if base + suffix not in taken:
            return base + suffix
    raise ValueError("more than 25 concurrent emulated clusters in one process")


def validate_name(name: str) -> str:
    """Returns ``name`` if usable as the prefix of every device (lowercase letter, then up to
    nine lowercase letters or digits); raises ValueError otherwise."""
    if not _NAME_RE.match(name):
        raise ValueError(f"cluster name {name!r} must match {_NAME_RE.pattern} (it prefixes "
                         "interface names, limited to 15 characters)")
    return name


@contextlib.contextmanager
def machine_lock():
    """Holds an exclusive lock file while clusters are created or swept, so two processes
    neither pick the same subnet nor remove each other's half-built devices."""
    with open(_LOCK_PATH, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _namespaces() -> List[str]:
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> List[str]:
    out = _cmd(["ip", "-o", "link", "show"], check=False).stdout
    # "12: fe_v1@if2: <BROADCAST,...>" -> "fe_v1"
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]


def leftovers(name: str) -> Dict[str, List[str]]:
    """Everything that exists now of the cluster ``name``: {"namespaces", "links", "etc"}."""
    ns_re = re.compile(rf"^{re.escape(name)}_h\d+$")
    link_re = re.compile(rf"^{re.escape(name)}_(br|v\d+)$")
    etc = os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []
    return {"namespaces": [n for n in _namespaces() if ns_re.match(n)],
            "links": [n for n in _links() if link_re.match(n)],
            "etc": [os.path.join(NETNS_ETC, n) for n in etc if ns_re.match(n)]}


def remove(name: str) -> List[str]:
    """Removes every namespace, link and /etc/netns entry of the cluster ``name`` (complete or
    half-built, of this run or of a crashed one) and returns what could not be removed.

    Processes still inside its namespaces are killed first: a namespace with live processes
    outlives ``ip netns del`` together with its veth, and they belong to this cluster."""
    found = leftovers(name)
    for ns in found["namespaces"]:
        pids = _cmd(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _cmd(["ip", "netns", "del", ns], check=False)
    # Deleting a namespace deletes its eth0 and so the veth pair; the bridge goes last.
    for link in sorted(set(found["links"]) & set(_links()), key=lambda n: n.endswith("_br")):
        _cmd(["ip", "link", "del", link], check=False)
    for path in found["etc"]:
        shutil.rmtree(path, ignore_errors=True)
    still = leftovers(name)
    return [item for items in still.values() for item in items]


def sweep_stale() -> List[str]:
    """Removes clusters with a default name ("fe<pid>") whose creating process is gone
    (an earlier run that crashed or was killed) and returns their names; call it under
    :func:`machine_lock`."""
    names = {m.group(0) for n in _namespaces() + _links()
             for m in [_DEFAULT_NAME_RE.match(n.rsplit("_", 1)[0])] if m}
    stale = []
    for name in sorted(names):
        match = _DEFAULT_NAME_RE.match(name)
        if match is None:  # names holds matches only; for the type checker
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive: a cluster of a running process
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        remove(name)
        stale.append(name)
    return stale


def pick_subnet(pool: ipaddress.IPv4Network = _DEFAULT_POOL) -> ipaddress.IPv4Network:
    """Returns the first /24 of ``pool`` that overlaps no address or route of the root
    namespace (so two clusters never share a subnet); call it under :func:`machine_lock`."""
    used = []
    for args in (["ip", "-o", "-4", "addr", "show"], ["ip", "-4", "route", "show"]):
        for token in _cmd(args, check=False).stdout.split():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(token, strict=False))
    for subnet in pool.subnets(new_prefix=24):
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise ClusterUnavailable(f"no free /24 left in {pool} for an emulated cluster")


def set_link_rate(hosts, mbit: float):
    """Sets every host's link to ``mbit`` Mbit/s each direction, on a running cluster:
    its egress qdisc (its eth0) and its ingress one (the bridge end of its veth)."""
    for host in hosts:
        _cmd(["tc", "-n", host.namespace, "qdisc", "replace", "dev", HOST_IFACE, "root",
              *_tbf(mbit)])
        _cmd(["tc", "qdisc", "replace", "dev", host.veth, "root", *_tbf(mbit)])


def _tbf(mbit: float) -> List[str]:
    """tbf arguments for ``mbit`` Mbit/s: a burst of 5 ms of traffic (at least 64 KiB, one
    GSO packet) keeps the rate exact on short transfers; 400 ms of queue absorbs TCP bursts."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.005))
    return ["tbf", "rate", f"{int(round(mbit * 1000))}kbit", "burst", str(burst),
            "latency", "400ms"]


class EmulatedNetwork:
    """The hosts and links of one cluster; :meth:`create` builds them, :meth:`destroy`
    removes them (idempotent).

    Args:
        name: str, prefix of every namespace and device (see :func:`validate_name`).
        num_hosts: int >= 1.
        link_mbit: float > 0, each host's link rate, each direction.
        slow_host_mbit: float > 0 or None, the rate of the last host instead (a straggler).
        subnet: "a.b.c.d/n" or None to pick a free /24 of 10.77.0.0/16.
    """

    def __init__(self, name: str, num_hosts: int, link_mbit: float,
                 slow_host_mbit: Optional[float] = None, subnet: Optional[str] = None):
        if num_hosts < 1:
            raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
        for label, rate in (("link_mbit", link_mbit), ("slow_host_mbit", slow_host_mbit)):
            if rate is not None and not rate > 0:
                raise ValueError(f"{label} must be > 0 Mbit/s, got {rate}")
        self.name = validate_name(name)
        self.num_hosts = num_hosts
        self.link_mbit = float(link_mbit)
        self.slow_host_mbit = None if slow_host_mbit is None else float(slow_host_mbit)
        self._subnet = None if subnet is None else ipaddress.ip_network(subnet)
        if self._subnet is not None and self._subnet.num_addresses < num_hosts + 12:
            raise ValueError(f"subnet {subnet} is too small for {num_hosts} hosts")
        self.bridge = f"{name}_br"
        self.hosts: List[Host] = []
        self.bridge_address: Optional[str] = None

    def create(self, sweep: bool = True) -> None:
        """Removes leftovers of an earlier run of the same name (and, with ``sweep``, of
        default-named clusters whose process is gone), then builds bridge, hosts and links.
        Raises ClusterUnavailable (after removing what it made) if a step fails."""
        with machine_lock():
            if sweep:
                sweep_stale()
            remove(self.name)
            subnet = self._subnet or pick_subnet()
            self.bridge_address = str(subnet[1])
            rates = [self.link_mbit] * self.num_hosts
            if self.slow_host_mbit is not None:
                rates[-1] = self.slow_host_mbit
            self.hosts = [Host(i, f"{self.name}_h{i}", str(subnet[10 + i]), f"{self.name}_v{i}",
                               rates[i - 1]) for i in range(1, self.num_hosts + 1)]
            try:
                self._build(subnet.prefixlen)
            except subprocess.CalledProcessError as e:
                remove(self.name)
                raise ClusterUnavailable(
                    f"building emulated hosts failed at `{' '.join(e.cmd)}`: "
                    f"{(e.stderr or '').strip()}") from None
            except BaseException:
                remove(self.name)
                raise

    def _build(self, prefixlen: int) -> None:
        _cmd(["ip", "link", "add", self.bridge, "type", "bridge"])
        _cmd(["ip", "addr", "add", f"{self.bridge_address}/{prefixlen}", "dev", self.bridge])
        _cmd(["ip", "link", "set", self.bridge, "up"])
        machine = socket.gethostname()
        for host in self.hosts:
            ns = host.namespace
            _cmd(["ip", "netns", "add", ns])
            _cmd(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", HOST_IFACE,
                  "netns", ns])
            _cmd(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{host.address}/{prefixlen}", "dev", HOST_IFACE])
            _cmd(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _cmd(["tc", "-n", ns, "qdisc", "add", "dev", HOST_IFACE, "root", *_tbf(host.mbit)])
            _cmd(["tc", "qdisc", "add", "dev", host.veth, "root", *_tbf(host.mbit)])
            # Horovod 0.28.1 builds process-set Gloo contexts without HOROVOD_GLOO_IFACE and
            # falls back to the machine's hostname (127.0.0.1 otherwise): make it resolve to
            # this host's own address inside the namespace (see shared/CLUSTER.md).
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost",
                     f"{host.address} {machine} {ns}"]
            lines += [f"{h.address} {h.namespace}" for h in self.hosts if h is not host]
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def destroy(self) -> List[str]:
        """Removes everything of this cluster; returns what could not be removed (empty when
        teardown is complete)."""
        with machine_lock():
            return remove(self.name)
