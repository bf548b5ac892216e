"""Starting or joining Ray, the same way for ingest, serve and tests."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def ensure_ray(*, num_cpus: int | None = None, quiet: bool = True) -> str:
    """Join ``RAY_ADDRESS`` when set, else start a local Ray; return which.

    A local Ray gets as many logical CPUs as the machine has cores (at least 2). Every
    Helix actor and replica asks for a fraction of a CPU, so nothing waits for a whole
    core that a read task holds (the starvation of ray#44687 on 2 cores).
    """
    import ray

    if ray.is_initialized():
        return "existing"
    address = os.environ.get("RAY_ADDRESS")
    kwargs = dict(
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
    # Workers must import helix_ray and pipelines from the repo checkout.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"env_vars": {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}}
    ray.init(
        address="local",
        num_cpus=cpus,
        object_store_memory=int(os.environ.get("HELIX_OBJECT_STORE_BYTES", 512 * 1024 * 1024)),
        runtime_env=env,
        **kwargs,
    )
    return f"local ({cpus} CPUs)"
