"""Starting or joining Ray, the same way for ingest, serve and tests."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from helix_ray.errors import ClusterUnreachable

log = logging.getLogger(__name__)

#: Whether Ray's own output reaches this process's stderr (:func:`show_ray_output`).
_ray_output = False


def show_ray_output(show: bool = True) -> None:
    """Let Ray's own output reach this process's stderr from now on (``helix --verbose``):
    its INFO lines, what its workers print, Ray Data's execution plans and progress. Off
    by default: Helix shows its own progress, and Ray's logs stay in its session folder
    (``/tmp/ray/session_latest/logs`` by default). A choice of the program, as a logging setup is:
    set it before Ray starts."""
    global _ray_output
    _ray_output = show


def ray_output_shown() -> bool:
    """What :func:`show_ray_output` last set."""
    return _ray_output


def ensure_ray(*, num_cpus: int | None = None, quiet: bool | None = None, loopback: bool = False) -> str:
    """Join ``RAY_ADDRESS`` when set, else start a local Ray; return which.

    ``quiet`` (default: unless :func:`show_ray_output` said otherwise) keeps Ray's INFO
    lines and its workers' output off this process's stderr. ``loopback`` puts the
    local node on 127.0.0.1 (Serve: its HTTP proxy and replicas then listen there).

    A local Ray gets as many logical CPUs as the machine has cores (at least 2). Every
    Helix actor and replica asks for a fraction of a CPU, so nothing waits for a whole
    core that a read task holds (on a small host an actor asking for a whole CPU can
    starve behind the read tasks).
    """
    import ray

    if ray.is_initialized():
        return "existing"
    if quiet is None:
        quiet = not _ray_output
    if not sys.stdout.isatty():  # Ray colours its workers' log prefixes: escape codes in a file
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = dict(
        ignore_reinit_error=True,
        log_to_driver=not quiet,
        include_dashboard=False,
        configure_logging=True,
        logging_level=logging.WARNING if quiet else logging.INFO,
    )
    if address:
        sent = send_auth_token(address)
        problem = _unreachable(address)  # Ray would retry a port nobody listens on for many minutes
        try:
            if problem:
                raise ConnectionError(problem)
            ray.init(address=address, **kwargs)
        except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
            if problem:
                hint = ""
            elif sent:
                hint = "; this process sent the Ray auth token found on this machine, which must be the cluster's own"
            else:
                hint = ("; a cluster started with token auth also needs its token here (~/.ray/auth_token, "
                        "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) and, for a cluster on another machine, "
                        "RAY_AUTH_MODE=token exported")
            raise ClusterUnreachable(
                f"Could not join the Ray cluster at RAY_ADDRESS={address!r} ({exc}). Check that it runs there "
                f"(`ray status --address {address}`) and that this machine reaches its port{hint}. Unset "
                "RAY_ADDRESS to start a new local Ray instead."
            ) from exc
        return f"joined {address}"
    cpus = num_cpus or max(2, os.cpu_count() or 2)
    # address="local": always a new Ray of our own. A bare ray.init() would join a cluster
    # someone else started with `ray start` on this host.
    # Workers must import helix_ray and pipelines from the repo checkout. They inherit this
    # process's environment (the local Ray is its child), so PYTHONPATH goes there rather
    # than into a job runtime_env: a runtime_env makes Ray start every worker through its
    # runtime-env agent, which delays the first task (docs/benchmarks.md).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if loopback:
        kwargs["_node_ip_address"] = "127.0.0.1"
    _token_auth_for_new_ray()
    ray.init(
        address="local",
        num_cpus=cpus,
        object_store_memory=int(os.environ.get("HELIX_OBJECT_STORE_BYTES", 512 * 1024 * 1024)),
        **kwargs,
    )
    return f"local ({cpus} CPUs)"


def _token_auth_for_new_ray() -> None:
    """Token authentication for the local Ray about to start, chosen explicitly.

    With ``RAY_AUTH_MODE`` unset, Ray turns token auth on for a new local Ray and logs a
    warning saying so and how to opt out; Helix makes the same choice itself (the mode
    for this process and its children, Ray's config read again), so Ray has nothing to
    warn about. An explicit ``RAY_AUTH_MODE`` wins."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    from ray._private.authentication.authentication_token_setup import (  # private: Ray's own switch, no public API
        _enable_token_auth,
    )

    _enable_token_auth()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bind_error(host: str, port: int) -> OSError | None:
    """Why a TCP listener could not bind ``host:port`` now (something listens there), or
    None. With ``SO_REUSEADDR``, as servers bind: connections in TIME_WAIT are no listener."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


#: Ports :func:`spare_port` has handed out in this process: each draw is new, so two
#: listeners that will bind later (the ports of one ``ray start``) never share one.
_SPARE_PORTS: set[int] = set()

#: Below this, Ray hands out worker ports by default (``--min-worker-port`` 10002 to
#: ``--max-worker-port`` 19999): a listener that binds later must not take one of them.
_RAY_WORKER_PORTS_END = 20_000


def spare_ports_range(ip_local_port_range: str) -> range | None:
    """Where :func:`spare_port` draws, given the kernel's ``ip_local_port_range``
    ("low high"): between Ray's worker ports and the ephemeral range, or above that
    range; None when neither leaves at least 1,000 ports."""
    try:
        low, high = (int(part) for part in ip_local_port_range.split()[:2])
    except ValueError:
        low, high = 32768, 60999
    for candidates in (range(_RAY_WORKER_PORTS_END, low), range(high + 1, 65536)):
        if len(candidates) >= 1000:
            return candidates
    return None


def reserve_port(port: int) -> None:
    """Keep :func:`spare_port` from handing out ``port`` in this process (a port chosen
    elsewhere, free until its listener starts)."""
    _SPARE_PORTS.add(int(port))


def spare_port(host: str = "0.0.0.0", attempts: int = 200) -> int:
    """A free TCP port for a listener that starts a while later, outside the kernel's
    ephemeral range: a port from :func:`free_port` is in that range, where any process
    binding port 0 in the meantime — Ray starts dozens — may take it first. Never one
    this process has handed out before; :func:`free_port` on a host with no room."""
    import random

    try:
        ports = spare_ports_range(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text())
    except OSError:
        ports = spare_ports_range("")
    if ports is None:
        port = free_port()
    else:
        # The system's randomness, not the module's: two servers starting at once must not draw alike.
        draws = (p for p in random.SystemRandom().sample(ports, min(attempts, len(ports))) if p not in _SPARE_PORTS)
        port = next((p for p in draws if bind_error(host, p) is None), 0)
        if not port:
            raise OSError(f"no free TCP port found in {ports.start}-{ports.stop - 1} on {host} after {attempts} tries")
    _SPARE_PORTS.add(port)
    return port


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (or ``ray://host:port``, ``[v6]:port``) of a ``RAY_ADDRESS``; None
    for forms without a port (``auto``)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _unreachable(address: str, wait_s: float = 20.0) -> str | None:
    """Why a ``RAY_ADDRESS`` cannot be a cluster, or None once something accepts a TCP
    connection at its port (or it has none to try, ``auto``). A refused or unanswered
    port is tried again for ``wait_s`` (a head started in the background a moment ago
    opens its port a few seconds later); for a port nobody listens on, ``ray.init``
    itself retries for many minutes before giving up (docs/operations.md)."""
    import socket

    scheme = address.partition("://")[0] if "://" in address else None
    if scheme not in (None, "ray"):
        return (f"it is a {scheme}:// URL, not a cluster address: RAY_ADDRESS is the head's GCS host:port (its "
                "`ray start --port`, 6379 by default), not the dashboard's URL")
    target = _host_port(address)
    if target is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection(target, timeout=2.0):
                return None
        except socket.gaierror as exc:
            return f"cannot resolve the host {target[0]!r}: {exc}"
        except OSError as exc:
            if time.monotonic() >= deadline:
                return f"nothing accepted connections there for {wait_s:.0f} s: {exc}"
        time.sleep(0.5)


#: Seconds a running driver waits for its Ray's GCS to accept connections again before it
#: counts that Ray as lost: longer than a network blip, well within the 60 s after which
#: Ray itself ends a driver whose GCS is gone (``gcs_rpc_server_reconnect_timeout_s``),
#: with a line of its own and none of the driver's cleanup.
GCS_LOST_AFTER_S = 10.0


def wait_for_gcs_loss(every_s: float = 1.0, lost_after_s: float = GCS_LOST_AFTER_S) -> str:
    """Block while the GCS of the Ray this driver runs on accepts TCP connections; once
    it has not for ``lost_after_s``, return where it was and why. Ray keeps no cluster
    state across a GCS's loss unless it was started with GCS fault tolerance (an
    external Redis), so a driver that outlives its GCS serves on borrowed time."""
    import ray

    address = ray.get_runtime_context().gcs_address
    while True:
        why = _unreachable(address, wait_s=lost_after_s)
        if why:
            return f"its GCS at {address}: {why}"
        time.sleep(every_s)


def gcs_answers() -> bool:
    """Whether the GCS of the Ray this driver runs on accepts a TCP connection now."""
    import ray

    return _unreachable(ray.get_runtime_context().gcs_address, wait_s=0.0) is None


def stop_own_ray() -> None:
    """``ray.shutdown()`` of a Ray this process started, then SIGKILL of each process it
    had started that outlived it. After the GCS is gone the node's agents outlive their
    raylet for a minute or more, parented to init."""
    import psutil
    import ray

    started = psutil.Process().children(recursive=True)
    ray.shutdown()
    for proc in started:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
        except psutil.Error:
            continue


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address) stands for; none if it resolves
    to nothing."""
    import socket

    try:
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def is_loopback(host: str) -> bool:
    """Whether ``host`` means this machine only: a loopback address (127.0.0.1, ::1) or
    a name all of whose addresses are (``localhost``). ``0.0.0.0`` and ``::``, every
    interface, are not."""
    import ipaddress

    ips = _addresses(host)
    return bool(ips) and all(ipaddress.ip_address(ip).is_loopback for ip in ips)


def on_this_machine(address: str) -> bool:
    """Whether a ``RAY_ADDRESS`` names a cluster on this machine: ``auto``, a loopback
    host, or a name or address of one of this machine's network interfaces."""
    target = _host_port(address)
    if target is None:
        return address.strip() in ("", "auto", "local")
    ips = _addresses(target[0])
    if is_loopback(target[0]):
        return True
    import psutil

    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(ips) and ips <= own


def send_auth_token(address: str) -> bool:
    """Make this driver send Ray's auth token when it joins a cluster on this machine;
    return whether it sends one.

    Since Ray 2.59 a local cluster started with ``ray start`` checks a token, but a driver
    sends it only in token mode. Ray turns that on by itself (when ``RAY_AUTH_MODE`` is
    unset and a token exists) only for a cluster it finds on its own (``address="auto"``),
    never for an explicit address such as ``RAY_ADDRESS``: joining a local cluster then
    retries and fails with a bare "Failed to connect".
    Helix applies Ray's own rule (``maybe_enable_token_auth_if_token_available``: token
    mode when a token exists, and Ray's config read again; without the warning Ray logs
    when it does so) to an explicit address too, but only one on this machine (:func:`on_this_machine`): the token grants full control of the cluster that
    made it, and is not sent to another host unless ``RAY_AUTH_MODE=token`` says so. A
    token sent to a cluster without auth is ignored. An explicit
    ``RAY_AUTH_MODE`` always wins.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None or not on_this_machine(address):
        return (mode or "").lower() == "token"
    from ray._private.authentication.authentication_token_setup import (  # private: Ray's own rule, no public API
        _enable_token_auth,
    )
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # compiled; no stub

    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        return False
    _enable_token_auth()
    return True


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the tightest CPU quota
    of its cgroup and every ancestor (:func:`cgroup_cpu_quota`: a container's limit, or one
    set on a nested group), rounded down (a spinning thread on a 1.5-CPU quota is throttled)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def cgroup_cpu_quota(root: str | Path = "/sys/fs/cgroup", membership: str | Path = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota, in cores, of this process's cgroup and its ancestors, or
    None when none is set (or this is not Linux). cgroup v2: ``cpu.max`` ("max 100000" or
    "150000 100000") in each folder from the process's group up to the root; cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none) under the ``cpu`` controller's
    mount. A group path that is not visible (another cgroup namespace) is read from the
    mount's root."""
    root = Path(root)
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2
            folders, read = [root / "unified", root], _cpu_max
        elif "cpu" in controllers.split(","):  # v1
            folders, read = [root / controllers, root / "cpu", root / "cpu,cpuacct"], _cfs_quota
        else:
            continue
        mount = next((f for f in folders if f.is_dir()), None)
        if mount is not None:
            here = mount / group.strip("/")
            if not here.is_dir():
                here = mount
            while True:
                quota = read(here)
                if quota is not None:
                    found.append(quota)
                if here == mount:
                    break
                here = here.parent
    return min(found) if found else None


def _cpu_max(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cfs_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota < 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
