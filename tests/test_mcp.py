"""``helix mcp`` driven the way an agent drives it: the MCP SDK's own client, talking over
stdio to ``python -m helix_ray.cli mcp`` in a real subprocess, on a copy of the shipped
sample store. No Ray: the in-process server opens the store as a ``helix_ray.Memory``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

mcp = pytest.importorskip("mcp")
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "helix_ray" / "samples" / "atlas"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TOOLS = {"recall", "remember", "forget", "feedback", "stats"}


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory) -> Path:
    """The shipped sample (users dana and lee), ingested once in one process."""
    from helix_ray.ingest.run import ingest

    store = tmp_path_factory.mktemp("mcp") / "store"
    report = ingest([SAMPLES / "memories.jsonl", SAMPLES / "notes"], store, runner="local", show_progress=False)
    assert report.published, report
    return store


@pytest.fixture()
def store(sample_store, tmp_path) -> Path:
    """A private copy: the servers write into it."""
    copy = tmp_path / "store"
    shutil.copytree(sample_store, copy)
    return copy


def server_params(*args: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "helix_ray.cli", "mcp", *args], env=ENV,
                                 cwd=str(ROOT))


@asynccontextmanager
async def session(store: Path, user: str, *options: str) -> AsyncIterator[ClientSession]:
    async with stdio_client(server_params("--store", str(store), "--user", user, *options)) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            yield s


async def call(s: ClientSession, tool: str, **arguments: Any) -> Any:
    return await s.call_tool(tool, arguments)


def text(result: Any) -> str:
    return result.content[0].text


def recalled_ids(result: Any) -> list[str]:
    assert not result.is_error, text(result)
    return [item["id"] for item in result.structured_content["items"]]


def test_lists_the_tools_with_schemas_and_descriptions(store):
    async def run() -> None:
        async with session(store, "dana") as s:
            tools = {t.name: t for t in (await s.list_tools()).tools}
            assert set(tools) == TOOLS
            for tool in tools.values():
                assert len(tool.description or "") > 60, tool.name  # an LLM acts on it
                assert tool.input_schema.get("additionalProperties") is False, tool.name
            recall = tools["recall"].input_schema
            assert recall["required"] == ["query"]
            assert {"query", "budget_tokens", "k", "project", "types", "since", "until", "context"} \
                == set(recall["properties"])
            assert "user" not in recall["properties"] and "user" not in tools["remember"].input_schema["properties"]
            assert tools["recall"].output_schema is not None

    asyncio.run(run())


def test_remember_recall_forget_round_trip_without_a_new_generation(store):
    from helix_ray.store.db import StoreDB

    fact = f"We pinned uvicorn to 0.30 after the keep-alive bug (ticket {uuid.uuid4().hex[:8]})."
    current = (store / "CURRENT").read_text()

    async def run() -> None:
        async with session(store, "dana") as s:
            written = await call(s, "remember", text=fact, type="decision", project="atlas")
            assert not written.is_error, text(written)
            memory_id = text(written)
            found = await call(s, "recall", query="why did we pin uvicorn to 0.30?", k=5)
            assert memory_id in recalled_ids(found)  # the very next recall
            assert fact in text(found) and f"[{memory_id}] decision" in text(found)
            accessed.append(memory_id)
            forgot = await call(s, "forget", memory_id=memory_id)
            assert not forgot.is_error, text(forgot)
            assert memory_id not in recalled_ids(await call(s, "recall", query="why did we pin uvicorn to 0.30?"))
            stats = await call(s, "stats")
            assert not stats.is_error and json.loads(text(stats))["user"] == "dana"

    accessed: list[str] = []
    asyncio.run(run())
    # The write went to the delta: no ingest ran, no generation was published.
    assert (store / "CURRENT").read_text() == current
    assert any((store / "delta").glob("seg-*.arrow"))
    with StoreDB(store) as db:  # the recall's hits reached the access log (recency)
        assert db.row("SELECT count(*) FROM access_log WHERE id = ?", accessed) != (0,)


def test_an_agents_parallel_calls_are_all_answered_and_every_write_lands(store):
    """An agent may send tool calls without waiting for the previous one: the server
    answers them concurrently, over one store, and each write is there afterwards."""
    tag = uuid.uuid4().hex[:6]
    facts = [f"The {name} job (run {tag}) retries {n} times before paging." for n, name in
             enumerate(("ledger", "invoice", "mailer", "thumbnail"), start=2)]

    async def run() -> None:
        async with session(store, "dana") as s:
            calls = [call(s, "remember", text=fact, type="semantic") for fact in facts]
            calls += [call(s, "recall", query="how do I rotate the API keys", k=3) for _ in range(4)]
            answers = await asyncio.gather(*calls)
            assert all(not a.is_error for a in answers), [text(a) for a in answers if a.is_error]
            written = [text(a) for a in answers[:4]]
            assert len(set(written)) == 4
            assert all(recalled_ids(a) for a in answers[4:])
            for memory_id, fact in zip(written, facts):
                found = await call(s, "recall", query=fact, k=3)
                assert recalled_ids(found)[0] == memory_id, text(found)

    asyncio.run(run())


def test_a_recall_says_how_many_memories_the_budget_left_out(store):
    """A tight budget: the packed text ends with how many more memories ranked but did
    not fit, and the structured answer counts them, so the agent can ask again."""
    async def run() -> None:
        async with session(store, "dana") as s:
            tight = await call(s, "recall", query="how do I rotate the API keys", budget_tokens=60)
            roomy = await call(s, "recall", query="how do I rotate the API keys", budget_tokens=4000)
            over = tight.structured_content["over_budget"]
            assert over >= 1 and f"{over} more relevant" in text(tight) and "budget_tokens=60" in text(tight)
            assert roomy.structured_content["over_budget"] == 0 and "more relevant" not in text(roomy)
            assert len(recalled_ids(roomy)) >= len(recalled_ids(tight)) + over

    asyncio.run(run())


def test_a_recall_about_what_the_store_never_mentions_says_the_match_is_weak(store):
    """The agent is told when no memory is about its question, so it does not read the
    closest ones as the answer; a question the store answers carries no such note."""
    async def run() -> None:
        async with session(store, "dana") as s:
            off = await call(s, "recall", query="best hiking trails in Patagonia")
            on = await call(s, "recall", query="how do I rotate the API keys")
            assert off.structured_content["weak_match"] and "Weak match: the closest memory" in text(off)
            assert recalled_ids(off)  # the memories still come, for the agent to judge
            assert not on.structured_content["weak_match"] and "Weak match" not in text(on)

    asyncio.run(run())


def test_what_one_session_remembers_the_next_session_recalls(store):
    """An agent's two sessions are two server processes, one after the other (the client
    starts ``helix mcp`` per session): the first one's write survives its exit, and the
    second recalls it before any compaction folded it into a generation."""
    fact = f"The staging database is reset every Sunday at 02:00 UTC (ticket {uuid.uuid4().hex[:8]})."
    current = (store / "CURRENT").read_text()

    async def first() -> str:
        async with session(store, "dana") as s:
            written = await call(s, "remember", text=fact, type="semantic")
            assert not written.is_error, text(written)
            return text(written)

    async def second() -> list[str]:
        async with session(store, "dana") as s:
            found = await call(s, "recall", query="when is the staging database reset?", k=5)
            assert fact in text(found)
            return recalled_ids(found)

    memory_id = asyncio.run(first())
    assert memory_id in asyncio.run(second())
    assert (store / "CURRENT").read_text() == current


def test_a_server_for_one_user_never_reaches_another_users_memories(store):
    secret = f"The staging database password rotates on Fridays ({uuid.uuid4().hex[:8]})."

    async def run() -> None:
        async with session(store, "alice") as s:
            written = await call(s, "remember", text=secret)
            assert not written.is_error, text(written)
            alice_id = text(written)
            assert alice_id in recalled_ids(await call(s, "recall", query="staging database password"))
        async with session(store, "bob") as s:
            assert recalled_ids(await call(s, "recall", query="staging database password rotates")) == []
            assert recalled_ids(await call(s, "recall", query="why did we choose NATS for the event bus?")) == []
            claimed = await call(s, "recall", query="staging database password", user="alice")
            assert claimed.is_error and "Got user='alice'" in text(claimed)
            foreign = await call(s, "forget", memory_id=alice_id)
            assert foreign.is_error
        async with session(store, "alice") as s:  # bob's forget did not touch it
            assert alice_id in recalled_ids(await call(s, "recall", query="staging database password"))

    asyncio.run(run())


def test_project_given_at_start_files_what_remember_writes(store):
    async def run() -> None:
        async with session(store, "dana", "--project", "billing") as s:
            memory_id = text(await call(s, "remember", text="Invoices are generated nightly at 02:00 UTC."))
            question = "when are invoices generated?"
            assert memory_id in recalled_ids(await call(s, "recall", query=question, project="billing"))
            assert memory_id not in recalled_ids(await call(s, "recall", query=question, project="atlas"))

    asyncio.run(run())


def test_a_session_given_at_start_or_by_the_call_files_what_remember_writes(store):
    """``--session`` names the session ``remember`` files memories under (an agent's
    conversation), a call's ``session`` another; recall shows each memory's session."""
    async def run() -> None:
        async with session(store, "dana", "--session", "chat-7") as s:
            chosen = text(await call(s, "remember", text="We chose Postgres for the ledger because of its row locks."))
            moved = text(await call(s, "remember", text="The ledger migration to Postgres runs on Sunday nights.",
                                    session="chat-8"))
            items = (await call(s, "recall", query="Postgres for the ledger")).structured_content["items"]
            sessions = {item["id"]: item["session_id"] for item in items}
            assert sessions[chosen] == "chat-7" and sessions[moved] == "chat-8", items

    asyncio.run(run())


def test_bad_arguments_are_tool_errors_with_helix_sentences_and_the_server_goes_on(store):
    async def run() -> None:
        async with session(store, "dana") as s:
            cases = [({"query": ""}, "Got query=''"),
                     ({"query": "nats", "k": 0}, "Got k=0; it must be a whole number from 1 to 200"),
                     ({"query": "nats", "types": ["nope"]}, "Got types=['nope']; each must be one of episodic"),
                     ({"query": "nats", "budget_tokens": 0}, "Got budget_tokens=0")]
            for arguments, sentence in cases:
                result = await s.call_tool("recall", arguments)
                assert result.is_error and sentence in text(result), (arguments, text(result))
            bad_type = await call(s, "remember", text="x y z", type="opinion")
            assert bad_type.is_error and "opinion" in text(bad_type), text(bad_type)
            missing = await call(s, "forget", memory_id="no-such-id")
            assert missing.is_error and "no-such-id" in text(missing), text(missing)
            assert recalled_ids(await call(s, "recall", query="why did we choose NATS for the event bus?"))

    asyncio.run(run())


def test_a_long_document_is_remembered_as_chunks_and_forgotten_whole(store):
    """remember of a long text stores chunks (nothing cut); recall finds the chunk that
    answers and names its parent; forget of the parent id removes every chunk; context
    turns are taken, and a bad one is a tool error."""
    tag = uuid.uuid4().hex[:8]
    steps = [f"## Step {n}\n" + " ".join(f"Step {n} checks shard {m} of the {tag} cluster and logs it." for m in range(25))
             for n in range(1, 7)]
    doc = "\n\n".join([f"# Failover {tag}", *steps, "## Fencing\nFence the old primary with STONITH before promoting."])

    async def run() -> None:
        async with session(store, "dana") as s:
            written = await call(s, "remember", text=doc, type="procedural")
            assert not written.is_error, text(written)
            parent = text(written)
            found = await call(s, "recall", query=f"how do we fence the old primary in the {tag} failover?", k=5)
            items = found.structured_content["items"]
            assert items and items[0]["parent"] == parent and "STONITH" in items[0]["text"], items
            followed = await call(s, "recall", query="and what comes before promoting it?",
                                  context=[f"we are doing the {tag} failover", "the old primary is still up"])
            assert not followed.is_error and any(i["parent"] == parent for i in followed.structured_content["items"])
            bad = await s.call_tool("recall", {"query": "x", "context": "not a list"})
            assert bad.is_error
            assert not (await call(s, "forget", memory_id=parent)).is_error
            gone = await call(s, "recall", query=f"how do we fence the old primary in the {tag} failover?", k=5)
            assert all(i.get("parent") != parent for i in gone.structured_content["items"])

    asyncio.run(run())


CLIENT_THAT_DIES = textwrap.dedent("""
    import asyncio, sys
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    async def main():
        params = StdioServerParameters(command=sys.executable, args=["-m", "helix_ray.cli", "mcp", "--store",
                                       sys.argv[1], "--user", "dana"])
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                print("ready", flush=True)
                await s.call_tool("remember", {"text": "a memory written while the client dies " * 50})

    asyncio.run(main())
""")


def test_a_client_that_dies_mid_call_leaves_no_server_process(store, tmp_path):
    import psutil

    script = tmp_path / "client.py"
    script.write_text(CLIENT_THAT_DIES)
    client = subprocess.Popen([sys.executable, str(script), str(store)], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        servers = psutil.Process(client.pid).children(recursive=True)
        assert servers, "the client started no server"
        time.sleep(0.05)  # the call is on its way
        client.kill()  # no goodbye: its pipes just close
        client.wait(timeout=10)
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"server processes still running: {[p.pid for p in alive]}"
    finally:
        for p in psutil.Process().children(recursive=True):
            if p.pid == client.pid or p.ppid() == client.pid:
                p.kill()


def test_the_in_process_server_imports_no_ray(store):
    probe = textwrap.dedent(f"""
        import asyncio, sys
        from helix_ray import mcp_server

        backend = mcp_server.Local({str(store)!r}, "dana")
        server = mcp_server.build_server(backend)
        async def main():
            await server.call_tool("remember", {{"text": "ray must not be imported here"}})
            await server.call_tool("recall", {{"query": "ray imported"}})
        asyncio.run(main())
        backend.close()
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
    """)
    out = subprocess.run([sys.executable, "-c", probe], env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_store_held_by_another_process_points_to_the_server_option(store):
    from helix_ray.store.db import StoreDB

    with StoreDB(store):  # as a running `helix serve`'s Writer holds it
        out = subprocess.run([sys.executable, "-m", "helix_ray.cli", "mcp", "--store", str(store), "--user", "dana"],
                             env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--server" in out.stderr and out.stdout == ""


def test_a_missing_user_is_named_as_the_missing_flag(store):
    out = subprocess.run([sys.executable, "-m", "helix_ray.cli", "mcp", "--store", str(store)], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.startswith("helix mcp: Got --user=None"), out.stderr


def test_the_streamable_http_transport_serves_the_same_tools(store):
    """One `helix mcp --http` serves the same tools, to several agent windows at once
    (what one remembers, the other recalls)."""
    from mcp.client.streamable_http import streamable_http_client

    from helix_ray.runtime import spare_port

    port = spare_port()
    server = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "mcp", "--store", str(store), "--user", "dana",
                               "--http", "--port", str(port)], env=ENV, cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def run() -> list[str]:
        deadline = time.monotonic() + 120
        while True:
            try:
                async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        assert {t.name for t in (await s.list_tools()).tools} == TOOLS
                        found = recalled_ids(await call(s, "recall", query="why did we choose NATS for the event bus?"))
                        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read2, write2):
                            async with ClientSession(read2, write2) as other:  # a second window
                                await other.initialize()
                                await call(other, "remember", text="The kestrel cache warms at 05:10 UTC.")
                                assert any("kestrel" in i["text"] for i in (await call(
                                    s, "recall", query="when does the kestrel cache warm?")).structured_content["items"])
                        return found
            except OSError:  # not listening yet
                pass
            except Exception as exc:  # noqa: BLE001 - the SDK wraps a refused connection in a group
                if "connect" not in repr(exc).lower() or time.monotonic() > deadline or server.poll() is not None:
                    raise
            await asyncio.sleep(0.5)

    try:
        assert asyncio.run(run())
    finally:
        server.terminate()
        code = server.wait(timeout=30)
    assert code == 0, "SIGTERM should close the store and exit cleanly"
    assert server.stderr is not None
    assert f"user 'dana' on http://127.0.0.1:{port}/mcp" in server.stderr.read().decode()


@pytest.mark.ray
def test_the_server_option_reaches_a_running_helix_serve_with_the_keys_user(store):
    """`helix mcp --server URL --key KEY` against a real `helix serve` on 127.0.0.1: the
    tools act as the key's user (remember, then recall finds it at once, forget), and no
    argument reaches another user's memories."""
    import signal

    import httpx

    from helix_ray.runtime import spare_port

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "helix_ray.cli", *args], capture_output=True, text=True,
                              check=True, timeout=300, env=ENV, cwd=str(ROOT)).stdout

    key = cli("keys", "create", "--store", str(store), "--user", "dana").split()[-1]
    port = spare_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    server = subprocess.Popen([sys.executable, "-m", "helix_ray.cli", "serve", "--store", str(store), "--port",
                               str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=str(ROOT))
    fact = f"The heron relay moved to port 7443 ({uuid.uuid4().hex[:8]})."
    try:
        deadline = time.monotonic() + 300
        healthy = False
        while not healthy and time.monotonic() < deadline and server.poll() is None:
            try:
                healthy = httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            except httpx.TransportError:
                time.sleep(1)
        assert healthy, "helix serve did not become healthy"

        async def run() -> None:
            async with stdio_client(server_params("--server", url, "--key", key)) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    written = await call(s, "remember", text=fact, type="decision")
                    assert not written.is_error, text(written)
                    memory_id = text(written)
                    assert memory_id in recalled_ids(await call(s, "recall", query="which port does the heron relay use?"))
                    other = await call(s, "recall", query="heron relay port", user="lee")
                    assert other.is_error
                    assert not (await call(s, "forget", memory_id=memory_id)).is_error
                    assert memory_id not in recalled_ids(await call(s, "recall", query="heron relay port"))

        asyncio.run(run())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()


def test_the_server_warms_the_store_when_it_starts(store):
    """At start, before any tool call, the server asks one question of its user through
    every stage: the first `recall` an agent makes does not load the encoders or the
    generation's columns."""
    from mcp import Client

    from helix_ray import mcp_server

    backend = mcp_server.Local(store, "dana")

    async def main() -> None:
        async with Client(mcp_server.build_server(backend)):
            for _ in range(600):  # no tool called: only the start can have warmed it
                if backend._warmed is not None and backend._warmed.is_set():
                    break
                await asyncio.sleep(0.1)
            assert backend._warmed is not None and backend._warmed.is_set(), "the warm-up ran at start"
            # the skip-retrieval router's reference embeddings: made by the first question only
            assert backend.memory.recaller._router is not None

    try:
        asyncio.run(main())
    finally:
        backend.close()


def test_a_second_server_on_a_held_store_says_how_to_share_it(tmp_path):
    """Protects: an agent's second window starting `helix mcp --store` on the store the
    first window's server holds died with DuckDB's lock error alone. It exits 2 saying how
    every window can share one server (MCP over HTTP), and the first goes on."""
    from helix_ray import Memory

    store = tmp_path / "store"
    with Memory(store, warm=False, compact_interval_s=None) as held:
        held.add([{"text": "Deploys freeze on Fridays.", "user": "me"}])
        second = subprocess.run([sys.executable, "-m", "helix_ray.cli", "mcp", "--store", str(store), "--user", "me"],
                                input="", capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"`helix mcp --store {store} --user USER --http`" in second.stderr
        assert "http://127.0.0.1:8765/mcp" in second.stderr
        assert held.recall("when do deploys freeze?", user="me").items
