"""No memory text or recall query reaches ``helix mcp``'s output at the default log level.

An agent host (Claude Desktop, an IDE) writes the stderr of the ``helix mcp`` it starts
into its own log file. One server, run over stdio by the MCP SDK's client as a host runs
it, its stderr in a file, on a new store (so it prints the warning that it starts one:
the control that the search reads what it printed), is called with every tool, with
arguments carrying unique markers: a short and a long (chunked) ``remember``, ``recall``
with context turns, ``feedback``, ``stats``, ``forget``, and calls that fail (arguments
the tool does not take or of the wrong type, a type and a metadata the ingest rules
refuse, unknown ids, an unknown tool). Once it stopped, its stderr and the store's log
files are searched for the markers. ``--server`` mode passes the same arguments to
``helix serve``, whose logs ``tests/test_serve_logs.py`` searches.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from helix_ray.ingest.normalize import MAX_METADATA_DEPTH
from helix_ray.store import audit
from tests.helpers import leaks

mcp = pytest.importorskip("mcp")
from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

from tests.test_mcp import TOOLS, server_params, text  # noqa: E402


async def _exercise(s: ClientSession, marks: dict[str, str]) -> None:
    """Every tool, each call carrying markers, with the answer it must get (so the
    markers went where they were meant to)."""
    async def ok(tool: str, **arguments: Any) -> Any:
        result = await s.call_tool(tool, arguments)
        assert not result.is_error, (tool, text(result))
        return result

    async def refused(tool: str, **arguments: Any) -> None:
        result = await s.call_tool(tool, arguments)
        assert result.is_error, (tool, arguments, result)

    memory, document, query, wrong = marks["memory"], marks["document"], marks["query"], marks["refused"]
    assert {t.name for t in (await s.list_tools()).tools} == TOOLS
    short_id = text(await ok("remember", text=f"{memory} the gateway rotates its keys nightly", type="decision",
                             metadata={"note": f"{memory} in the metadata"}))
    steps = [f"## Step {n}\n" + " ".join(f"Step {n} of {document} checks shard {m} and logs it." for m in range(25))
             for n in range(1, 7)]
    doc_id = text(await ok("remember", text="\n\n".join([f"# Failover {document}", *steps]), type="procedural"))
    found = await ok("recall", query=f"{query} when does the gateway rotate its keys?", k=5,
                     context=[f"{query} we talked about the gateway", f"{query} and its keys"])
    assert short_id in [i["id"] for i in found.structured_content["items"]]
    chunks = await ok("recall", query=f"{query} which shard does step 3 of {document} check?", k=5)
    assert any(i.get("parent") == doc_id for i in chunks.structured_content["items"]), "the document was chunked"
    await ok("feedback", query=f"{query} feedback", memory_ids=[short_id])
    await ok("stats")
    # Refused by the SDK's argument check, by Helix's checks, by the ingest rules, or unknown.
    await refused("remember", text=f"{wrong} of no known type", type=f"{wrong}-type")
    await refused("remember", text=f"{wrong} salience", salience=f"{wrong} salience")
    deep: Any = wrong
    for _ in range(MAX_METADATA_DEPTH + 1):
        deep = {"a": deep}
    await refused("remember", text=f"{wrong} too deep", metadata=deep)
    await refused("remember", text=f"{wrong} for another user", user=f"{wrong}-user", bogus=wrong)
    await refused("recall", query=f"{wrong} k", k=0)
    await refused("recall", query=f"{wrong} types", types=[f"{wrong}-type"])
    await refused("recall", query=f"{wrong} since", since=f"{wrong}-date")
    await refused("recall", query=f"{wrong} context", context=f"{wrong} not a list")
    await refused("recall", query=f"{wrong} budget", budget_tokens=f"{wrong} tokens")
    await refused("forget", memory_id=f"{wrong}-id")
    await refused("feedback", query=f"{wrong} feedback", memory_ids=[f"{wrong}-id"])
    await refused("feedback", query=f"{wrong} feedback", memory_ids=[])
    await refused(f"{wrong}_tool", text=f"{wrong} to an unknown tool")
    await ok("forget", memory_id=short_id)
    await ok("forget", memory_id=doc_id)


def test_no_memory_text_or_query_in_the_servers_output(tmp_path):
    store, err = tmp_path / "store", tmp_path / "mcp.err"
    marks = {kind: f"zq7{kind}{uuid.uuid4().hex[:16]}" for kind in ("memory", "document", "query", "refused")}
    params = server_params("--store", str(store), "--user", "dana")

    async def run() -> None:
        with open(err, "w") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):  # leaving it stops the server
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    await _exercise(s, marks)

    asyncio.run(run())
    logs = [p for p in store.rglob("*") if p.is_file() and p.suffix == ".log"]
    files = [err, *logs, *audit.files(store)]
    assert leaks([err], {"start": f"Starting a new, empty Helix store in {store}"}), \
        f"the search missed what helix mcp printed:\n{err.read_text()}"
    found = leaks(files, marks)
    print(f"{len(files)} files, {sum(p.stat().st_size for p in files)} bytes read: {len(found)} hits")
    assert not found, "memory text or queries in the logs:\n" + "\n".join(found)


class _Faulty:
    """A backend whose every call fails as a bug or a damaged disk would: with a message
    quoting the call's data."""

    user = "dana"

    def __init__(self, mark: str) -> None:
        self.mark = mark

    async def warm(self) -> None:
        return None

    async def _fail(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError(f"could not write {self.mark}: {args!r} {kwargs!r}")

    recall = remember = forget = feedback = _fail

    async def stats(self) -> dict[str, Any]:
        return await self._fail()

    def close(self) -> None:
        return None


def test_a_fault_in_a_tool_reaches_the_agent_and_the_log_without_its_data(caplog):
    """The agent reads the fault's kind; the log at ERROR says which tool and where it
    was raised, but neither holds the message, which quotes the memory or the query; the
    traceback is DEBUG's. (The SDK, given the exception, would log it whole at ERROR.)"""
    import logging

    from mcp import Client

    from helix_ray.mcp_server import build_server

    mark = f"zq7fault{uuid.uuid4().hex[:16]}"
    calls = {"recall": {"query": f"{mark} query"}, "remember": {"text": f"{mark} memory"},
             "forget": {"memory_id": f"{mark}-id"}, "feedback": {"query": mark, "memory_ids": [f"{mark}-id"]},
             "stats": {}}

    async def run() -> dict[str, Any]:
        async with Client(build_server(_Faulty(mark))) as client:
            return {tool: await client.call_tool(tool, arguments) for tool, arguments in calls.items()}

    with caplog.at_level(logging.DEBUG):
        results = asyncio.run(run())
    for tool, result in results.items():
        assert result.is_error and f"{tool} failed with an internal error (RuntimeError)" in text(result), tool
        assert mark not in text(result)
    shown = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not [r.getMessage() for r in shown if mark in r.getMessage() or r.exc_info], "data above DEBUG"
    errors = [r.getMessage() for r in shown if r.levelno >= logging.ERROR]
    assert sorted(m.split()[0] for m in errors) == sorted(calls), errors
    assert all("RuntimeError at " in m and "in _fail" in m for m in errors), errors
    assert sum(1 for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info) == len(calls)
