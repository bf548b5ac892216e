"""Starting or joining Ray, the same way for ingest, serve and tests."""

from __future__ import annotations

import logging
import os
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
        ray.init(address=address, **kwargs)
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
