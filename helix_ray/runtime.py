"""Starting or joining Ray, the same way for ingest, serve and tests."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def ensure_ray(*, num_cpus: int | None = None, quiet: bool = True, loopback: bool = False) -> str:
    """Join ``RAY_ADDRESS`` when set, else start a local Ray; return which.

    ``loopback`` puts the local node on 127.0.0.1 (Serve: its HTTP proxy and replicas
    then listen there).

    A local Ray gets as many logical CPUs as the machine has cores (at least 2). Every
    Helix actor and replica asks for a fraction of a CPU, so nothing waits for a whole
    core that a read task holds (the starvation of ray#44687 on 2 cores).
    """
    import ray

    if ray.is_initialized():
        return "existing"
    address = os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = dict(
        ignore_reinit_error=True,
        log_to_driver=not quiet,
        include_dashboard=False,
        configure_logging=True,
        logging_level=logging.WARNING if quiet else logging.INFO,
    )
    if address:
        sent = send_auth_token() or os.environ.get("RAY_AUTH_MODE") == "token"
        refused = _refused(address)  # Ray would retry a port nobody listens on for many minutes
        try:
            if refused:
                raise ConnectionError(f"nothing accepts connections there: {refused}")
            ray.init(address=address, **kwargs)
        except ConnectionError as exc:
            from helix_ray.errors import ClusterUnreachable

            hint = ("" if refused else
                    "; this process sent the auth token found on this machine, which must be the cluster's own"
                    if sent else "; a cluster started with token auth also needs its token here "
                    "(~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
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
    # runtime-env agent, which cost the first task ~1.3 s more (docs/benchmarks.md).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if loopback:
        kwargs["_node_ip_address"] = "127.0.0.1"
    ray.init(
        address="local",
        num_cpus=cpus,
        object_store_memory=int(os.environ.get("HELIX_OBJECT_STORE_BYTES", 512 * 1024 * 1024)),
        **kwargs,
    )
    return f"local ({cpus} CPUs)"


def _refused(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing accepts a TCP connection at a ``host:port`` (or ``ray://host:port``)
    address, or None when something does or the address has no port (``auto``). For a
    port nobody listens on, ``ray.init`` retried for more than 8 minutes here (Ray 2.60)
    before giving up; this answers in milliseconds."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return str(exc)


def send_auth_token(home: str | Path | None = None) -> bool:
    """Make this driver send Ray's auth token when joining a cluster, if one is at hand.

    Since Ray 2.59 a cluster started with ``ray start`` checks a token (written to
    ``~/.ray/auth_token``), but a process that joins it sends the token only when
    ``RAY_AUTH_MODE=token`` is set: without it, joining retried for ~20 s and failed with
    a bare "Failed to connect to Ray cluster" (measured on 2.60). A token sent to a cluster
    started without auth is ignored (measured too), so this sets ``RAY_AUTH_MODE=token``
    when it is unset and a token exists (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    the default file). An explicit ``RAY_AUTH_MODE`` always wins. Returns whether it set it.

    Ray reads the variable into its C++ config when ``ray`` is first imported, so once it
    is imported the config is read again (``Config.initialize``, as Ray's own auth tests
    do; nothing of Ray runs in this process before ``ray.init``).
    """
    if os.environ.get("RAY_AUTH_MODE") or not auth_token_at_hand(home):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray._raylet" in sys.modules:
        from ray._raylet import Config  # type: ignore[attr-defined]  # private: no public way to re-read it

        Config.initialize("")
    return True


def auth_token_at_hand(home: str | Path | None = None) -> bool:
    """Whether Ray would find an auth token here: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token``."""
    default = Path(home or Path.home()) / ".ray" / "auth_token"
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or default.is_file())


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
