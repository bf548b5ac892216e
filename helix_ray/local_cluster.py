"""A multi-node Ray on this machine, made with ``ray start`` as on real hosts: for the
cluster tests and the scaling benchmark.

Each node is one ``ray start --block`` process (its own temp folder and ports, bound to
127.0.0.1); :meth:`LocalCluster.stop` sends each a SIGTERM, which drains the node and
stops every process it started. Never ``ray stop``: it kills every Ray process on the
host, other users' included (../shared/FIELD-NOTES.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from helix_ray.runtime import auth_token_at_hand

STARTED = "Ray runtime started."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    """``nodes`` Ray nodes (one head) of ``cpus`` logical CPUs each on 127.0.0.1.

    ``address`` is what ``RAY_ADDRESS`` takes; ``dashboard_url`` what ``serve deploy -a``
    and ``serve status -a`` take (the head runs a dashboard when ``dashboard`` is True).
    Use it as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self, folder: str | Path | None = None, *, nodes: int = 2, cpus: int = 2,
                 memory_bytes: int = 4_000_000_000, object_store_bytes: int = 300_000_000, dashboard: bool = True):
        if nodes < 1 or cpus < 1:
            raise ValueError(f"a cluster needs at least one node and one CPU per node (got nodes={nodes}, cpus={cpus})")
        # Ray's socket paths live under each node's temp folder and may not exceed 107
        # bytes: a pytest tmp_path is too deep. None: a new short folder under /tmp,
        # removed by stop() (logs and all).
        self._own_folder = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="helix-ray-") if folder is None else folder).resolve()
        self.nodes, self.cpus, self.dashboard = nodes, cpus, dashboard
        self.memory_bytes, self.object_store_bytes = memory_bytes, object_store_bytes
        self.port = free_port()
        self.dashboard_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self._procs: list[tuple[subprocess.Popen, IO[str]]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment pointed at the cluster (``RAY_ADDRESS``)."""
        return {**os.environ, "RAY_ADDRESS": self.address, **extra}

    def _command(self, index: int) -> list[str]:
        ray = str(Path(sys.executable).with_name("ray"))
        command = [
            ray, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
            f"--memory={self.memory_bytes}", f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={self.folder / f'node{index}'}", "--disable-usage-stats",
            # Two nodes of one host must not share the agents' fixed default ports.
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        if index == 0:
            command += ["--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}"]
            command += ([f"--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
                        if self.dashboard else ["--include-dashboard=false"])
        else:
            command += [f"--address={self.address}"]
        return command

    def _start_node(self, index: int, timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        if index > 0 and "RAY_AUTH_MODE" not in env and auth_token_at_hand():
            # A node joining a cluster started with token auth (the default for local
            # clusters since Ray 2.59) must send the token; one started without ignores it.
            env["RAY_AUTH_MODE"] = "token"
        self.folder.mkdir(parents=True, exist_ok=True)
        log_path = self.folder / f"node{index}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen(self._command(index), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        self._procs.append((proc, log))
        deadline = time.monotonic() + timeout_s
        while STARTED not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"ray start for node {index} did not come up ({'exited ' + str(proc.returncode) if proc.returncode is not None else f'{timeout_s:.0f} s'}); "
                                   f"its log ({log_path}) ends:\n{tail}")
            time.sleep(0.2)

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        for index in range(self.nodes):
            self._start_node(index, timeout_s)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM each node, workers first (a node drains, then stops what it started);
        SIGKILL its process group if it has not exited after ``timeout_s``."""
        for proc, log in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            log.close()
        self._procs.clear()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
