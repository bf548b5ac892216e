"""A multi-node Ray on this machine, made with ``ray start`` as on real hosts: for the
cluster tests and the scaling benchmark.

Each node is one ``ray start --block`` process (its own temp folder and ports, bound to
127.0.0.1). The cluster checks an auth token of its own (a file in its folder, never
``~/.ray``), which :meth:`LocalCluster.env` hands to processes that join it.
:meth:`LocalCluster.stop` sends each node a SIGTERM, which stops every process it
started; a node also gets a SIGTERM when the process that started it dies. Never ``ray
stop``: it kills every Ray process on the host, other users' included.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from helix_ray.runtime import spare_port  # not free_port: each node's processes bind port 0 while the next starts

STARTED = "Ray runtime started."


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux), so a node that a
    killed test or benchmark started still drains and stops what it started."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class LocalCluster:
    """``nodes`` Ray nodes (one head) of ``cpus`` logical CPUs each on 127.0.0.1.

    ``address`` is what ``RAY_ADDRESS`` takes; ``dashboard_url`` what ``serve deploy -a``
    and ``serve status -a`` take (the head runs a dashboard when ``dashboard`` is True).
    ``hidden``: folders the worker nodes do not see (each starts in a mount namespace of
    its own with an empty tmpfs over them; needs root), as hosts without a shared disk.
    Use it as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self, folder: str | Path | None = None, *, nodes: int = 2, cpus: int = 2,
                 memory_bytes: int = 4_000_000_000, object_store_bytes: int = 300_000_000, dashboard: bool = True,
                 hidden: tuple[str | Path, ...] = ()):
        if nodes < 1 or cpus < 1:
            raise ValueError(f"a cluster needs at least one node and one CPU per node (got nodes={nodes}, cpus={cpus})")
        # Ray's socket paths live under each node's temp folder and may not exceed 107
        # bytes: a pytest tmp_path is too deep. None: a new short folder under /tmp,
        # removed by stop() unless a node failed to start (its log is there).
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="helix-ray-") if folder is None else folder).resolve()
        self.nodes, self.cpus, self.dashboard = nodes, cpus, dashboard
        self.memory_bytes, self.object_store_bytes = memory_bytes, object_store_bytes
        self.port = spare_port()
        self.dashboard_port = spare_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.token_path = self.folder / "auth_token"
        self.hidden = tuple(str(Path(h).resolve()) for h in hidden)
        self._procs: list[tuple[subprocess.Popen, IO[str]]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment pointed at the cluster: ``RAY_ADDRESS`` and the
        cluster's token file (``RAY_AUTH_TOKEN_PATH``). Helix's commands then send the
        token by themselves; Ray's own CLIs also need ``RAY_AUTH_MODE=token``."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        return {**env, "RAY_ADDRESS": self.address, "RAY_AUTH_TOKEN_PATH": str(self.token_path), **extra}

    def _command(self, index: int) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        command = [
            ray, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
            f"--memory={self.memory_bytes}", f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={self.folder / f'node{index}'}", "--disable-usage-stats",
            # Nodes of one host must not share the agents' fixed default ports, nor a
            # worker port range (0/0: any free port, as ray.cluster_utils does).
            f"--dashboard-agent-listen-port={spare_port()}", f"--metrics-export-port={spare_port()}",
            f"--runtime-env-agent-port={spare_port()}", "--min-worker-port=0", "--max-worker-port=0",
        ]
        if index == 0:
            command += ["--head", f"--port={self.port}", f"--ray-client-server-port={spare_port()}"]
            command += (["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
                        if self.dashboard else ["--include-dashboard=false"])
        else:
            command += [f"--address={self.address}"]
            if self.hidden:
                mount = 'while [ "$1" != -- ]; do mount -t tmpfs tmpfs "$1" || exit 1; shift; done; shift; exec "$@"'
                command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh",
                           *self.hidden, "--", *command]
        return command

    def _start_node(self, index: int, timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        # The nodes' Serve proxies share the host's HTTP port: SO_REUSEPORT on, whatever
        # this process set for a one-node Ray of its own (serve.server.start_ray).
        env["SERVE_SOCKET_REUSE_PORT_ENABLED"] = "1"
        # A test cluster has no load balancer to tell: no drain period on SIGTERM.
        env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
        log_path = self.folder / f"node{index}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen(self._command(index), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_term_with_parent)
        if index < len(self._procs):  # a node started again in its place (restart_node)
            self._procs[index] = (proc, log)
        else:
            self._procs.append((proc, log))
        deadline = time.monotonic() + timeout_s
        while STARTED not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                how = f"exited {proc.returncode}" if proc.returncode is not None else f"not up after {timeout_s:.0f} s"
                raise RuntimeError(f"ray start for node {index} {how}; its log ({log_path}) ends:\n"
                                   + log_path.read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        """Start the nodes, head first; on any failure stop those already started."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.token_path.write_text(secrets.token_hex(32))
        try:
            for index in range(self.nodes):
                self._start_node(index, timeout_s)
        except BaseException:
            self.stop(keep_folder=True)
            raise
        return self

    def stop(self, timeout_s: float = 60.0, keep_folder: bool = False) -> None:
        """SIGTERM each node, workers first (a node stops what it started); SIGKILL its
        process group if it has not exited after ``timeout_s``."""
        for proc, log in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it left behind in its session, if anything
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            log.close()
        self._procs.clear()
        if self._own_folder and not keep_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def kill_node(self, index: int) -> int:
        """SIGKILL a node and every process it started (raylet, agents, the replicas and
        tasks on it), as a host that fails would: no drain, no word to the GCS, which
        finds out by its health checks. Index 0, the head, takes the GCS with it: the
        cluster is lost (its worker nodes' raylets give up on it within a minute).
        Returns how many processes were killed."""
        import psutil

        if not 0 <= index < len(self._procs):
            raise ValueError(f"kill_node takes a node's index, 0 (the head) to {len(self._procs) - 1} (got {index})")
        proc, log = self._procs[index]
        try:
            top = psutil.Process(proc.pid)
            victims = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            victims = []
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what started after the snapshot, in its session
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        log.close()
        return len(victims)

    @property
    def node_pids(self) -> list[int]:
        """Each node's ``ray start`` process, head first: a session leader, whose session
        keeps the processes the node started, those whose parent died included."""
        return [proc.pid for proc, _ in self._procs]

    def restart_node(self, index: int, timeout_s: float = 120.0) -> None:
        """Start worker node ``index`` again (after :meth:`kill_node`): a new node joins."""
        if not 0 < index < len(self._procs) or self._procs[index][0].poll() is None:
            raise ValueError(f"node {index} is not a stopped worker node of this cluster")
        self._start_node(index, timeout_s)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
