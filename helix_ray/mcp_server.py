"""``helix mcp``: Helix as a Model Context Protocol server, for coding agents.

One set of tools (``recall``, ``remember``, ``forget``, ``feedback``, ``stats``) over a
small :class:`Backend` with two implementations:

================ ==============================================================
:class:`Local`   the store opened in this process as a :class:`helix_ray.Memory`:
                 the write and recall path ``helix serve`` runs, from
                 :mod:`helix_ray.live` (durable writes into the delta, recall over
                 the generation and the delta, background compaction); no Ray
:class:`Remote`  a running ``helix serve``, over its HTTP API with one API key
================ ==============================================================

The tenant is fixed when the server starts (``--user``, or the key's user): no tool
takes a user. A Helix error (a bad argument, a missing memory) comes back as an MCP tool
error carrying Helix's sentence; the server keeps running. Logs go to stderr: stdout
is the protocol.
"""

import asyncio
import contextlib
import json
import logging
import signal
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Protocol

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel, Field, ValidationError, model_validator

from helix_ray import __version__
from helix_ray.config import DEFAULT_BUDGET_TOKENS
from helix_ray.errors import HelixError, InvalidArgument, StoreError, fault

log = logging.getLogger(__name__)

#: Pending writes that start a compaction before its interval is up (as ``helix serve``'s Writer).
COMPACT_MAX_PENDING = 2000


class Backend(Protocol):
    """Where the tools' calls go. Each method returns the HTTP API's JSON shape and
    raises :class:`HelixError` with a sentence for the caller."""

    user: str

    async def recall(self, query: str, *, budget_tokens: int, k: int | None, project: str | None,
                     types: list[str] | None, since: str | None, until: str | None,
                     context: list[str] | None = None) -> dict[str, Any]: ...

    async def remember(self, record: dict[str, Any]) -> dict[str, Any]: ...

    async def warm(self) -> None:
        """Pay the first question's start-up costs now (the server's start), not at the
        agent's first ``recall``."""
        ...

    async def forget(self, memory_id: str) -> dict[str, Any]: ...

    async def feedback(self, query: str, memory_ids: list[str]) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- in process


class Local:
    """The store in this process, through :class:`helix_ray.Memory` (the in-process API,
    over :mod:`helix_ray.live`): a write is durable (DuckDB ``serve_log`` + inbox) and in
    the delta before it is answered, and the next recall finds it over the generation
    and the delta; the Writer's background compaction folds the delta into a generation,
    and each recall opens a newer generation if one was published. Holds the store's
    DuckDB file, as a server's Writer does."""

    def __init__(self, store: str | Path, user: str, *, compact_interval_s: float = 600.0):
        from helix_ray.config import IngestConfig
        from helix_ray.ingest.run import initialise
        from helix_ray.memory import Memory

        if not isinstance(user, str) or not user.strip():
            raise InvalidArgument("--user", user, "give the user whose memories this server reads and writes")
        self.user = user
        self.store = Path(store).expanduser().resolve()
        ingest = IngestConfig()
        if not (self.store / "CURRENT").is_file():
            if self.store.exists() and any(self.store.iterdir()):
                raise StoreError(f"{self.store} is a folder with files but no Helix store in it (no CURRENT file); "
                                 "give a new or empty folder, or the folder of an existing store.")
            log.warning("Starting a new, empty Helix store in %s", self.store)
            _holding(lambda: initialise(self.store, config=ingest), self.store)
        self.memory = _holding(lambda: Memory(self.store, ingest=ingest, compact_interval_s=compact_interval_s,
                                              compact_max_pending=COMPACT_MAX_PENDING, open_writer=True),
                               self.store)
        self._settings: Any = None  # a Pointer to the live settings file, made at the first recall
        self._checked: tuple[int, Any] | None = None  # (the Pointer's version, its checked settings)
        self._warmed: asyncio.Event | None = None  # set when the warm-up's question is answered

    def _config(self) -> Any:
        """The retrieval settings: a server's live overrides, if one ever ran on this store,
        read and checked again only when the file changes (one ``stat`` per recall)."""
        from helix_ray.live.inputs import check_settings
        from helix_ray.live.settings import read_settings, settings_path
        from helix_ray.store.pointer import Pointer

        if self._settings is None:
            self._settings = Pointer(settings_path(self.store), lambda _path: read_settings(self.store))
        overrides = self._settings.read()
        if self._checked is None or self._checked[0] != self._settings.version:
            self._checked = (self._settings.version, check_settings({}, overrides))
        return self._checked[1]

    async def warm(self) -> None:
        """Memory's warm-up (encoders, every stage, the generation's files into the page
        cache), then one question of this user (:mod:`helix_ray.recall.warm`); a recall
        that comes first waits for it."""
        from helix_ray.recall.warm import warm_recaller

        self._warmed = asyncio.Event()

        def warm_up() -> None:
            self.memory.ready()
            warm_recaller(self.memory.recaller, self.user)  # logs a failure: the first recall reports it

        try:
            await asyncio.to_thread(warm_up)
        except Exception:  # noqa: BLE001 - the first real recall reports what is wrong
            log.warning("warming the store failed; the first recall pays the start-up cost", exc_info=True)
        finally:
            self._warmed.set()

    async def recall(self, query: str, *, budget_tokens: int, k: int | None, project: str | None,
                     types: list[str] | None, since: str | None, until: str | None,
                     context: list[str] | None = None) -> dict[str, Any]:
        from helix_ray.recall.scope import check_context, make_scope

        if self._warmed is not None:
            await self._warmed.wait()
        config = self._config()
        request: dict[str, Any] = dict(budget_tokens=budget_tokens, k=config.default_k if k is None else k,
                                       project=project, types=types, since=since, until=until)
        make_scope(query=query, user=self.user, **request)  # what POST /v1/recall checks, before any stage
        turns = check_context(context)
        # Memory records what it returns as accessed (recency), as every front door does.
        result = await asyncio.to_thread(self.memory.recall, query, user=self.user, config=config,
                                         context=turns or None, **request)
        return result.as_dict()

    async def remember(self, record: dict[str, Any]) -> dict[str, Any]:
        from helix_ray.live.inputs import MemoryIn, request_error_sentence

        try:
            checked = MemoryIn.model_validate(record).model_dump(exclude_none=True)
        except ValidationError as exc:
            raise InvalidArgument("memory", record, request_error_sentence(exc.errors()).rstrip(".")) from None
        written = await asyncio.to_thread(self.memory.add, [{**checked, "user": self.user}])
        return {"ids": list(written.ids), "replaced": list(written.replaced), "delta_version": written.delta_version,
                "generation": written.generation}

    async def forget(self, memory_id: str) -> dict[str, Any]:
        written = await asyncio.to_thread(self.memory.delete, memory_id, user=self.user)
        return {"id": memory_id, "delta_version": written.delta_version, "generation": written.generation}

    async def feedback(self, query: str, memory_ids: list[str]) -> dict[str, Any]:
        recorded = await asyncio.to_thread(self.memory.feedback, query, user=self.user, memory_ids=memory_ids)
        return {"recorded": recorded}

    async def stats(self) -> dict[str, Any]:
        from helix_ray.store.generation import current_generation_number

        mine = await asyncio.to_thread(self.memory.user_stats, self.user)
        return {"generation": current_generation_number(self.store), "user": self.user, **mine}

    def close(self) -> None:
        self.memory.close()


def _holding(open_store: Any, store: Path) -> Any:
    """``open_store()``, with the way out when another process holds the store's DuckDB
    file (one writing process per store)."""
    try:
        return open_store()
    except StoreError as exc:
        raise StoreError(f"{exc} If another `helix mcp` holds it (an agent's other window), serve the store once "
                         f"to every window over HTTP: `helix mcp --store {store} --user USER --http`, and give each "
                         "agent http://127.0.0.1:8765/mcp as its MCP server. If `helix serve` runs on it, point this "
                         "server at that instead: `helix mcp --server http://127.0.0.1:8000 --key KEY` (a key from "
                         "`helix keys create`).") from None


# ----------------------------------------------------------------------------- over HTTP


class Remote:
    """A running ``helix serve``: the same tools over its HTTP API, as the key's user
    (the server refuses any other)."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument("--server", url, "give the server's base URL, e.g. http://127.0.0.1:8000")
        if not key:
            raise InvalidArgument("--key", key, "give an API key of the server's store (`helix keys create`)")
        self.url, self.key, self.timeout_s = url.rstrip("/"), key, timeout_s
        self.user = str(self._call("GET", "/v1/stats").get("user") or "")  # checks the key now, not at the first tool

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            try:
                detail = json.load(exc).get("detail")
            except ValueError:
                detail = None
            raise HelixError(detail or f"{method} {path} answered HTTP {exc.code}") from None
        except urllib.error.URLError as exc:
            raise StoreError(f"Could not reach the Helix server at {self.url} ({exc.reason}); is `helix serve` "
                             "running there?") from None

    async def recall(self, query: str, *, budget_tokens: int, k: int | None, project: str | None,
                     types: list[str] | None, since: str | None, until: str | None,
                     context: list[str] | None = None) -> dict[str, Any]:
        request = dict(budget_tokens=budget_tokens, k=k, project=project, types=types, since=since, until=until,
                       context=context)
        body = {"query": query, **{name: v for name, v in request.items() if v is not None}}
        return await asyncio.to_thread(self._call, "POST", "/v1/recall", body)

    async def remember(self, record: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, "POST", "/v1/memories", record)

    async def forget(self, memory_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, "DELETE", "/v1/memories/" + urllib.parse.quote(memory_id, safe=""))

    async def feedback(self, query: str, memory_ids: list[str]) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, "POST", "/v1/feedback", {"query": query, "memory_ids": memory_ids})

    async def stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, "GET", "/v1/stats")

    async def warm(self) -> None:
        pass  # the server's replicas warm themselves before they report healthy

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- the tools


class RecalledItem(BaseModel):
    id: str
    type: str
    created_at: str
    score: float
    project: str | None = None
    session_id: str | None = None
    parent: str | None = None
    text: str


class RecallOut(BaseModel):
    context: str = Field(description="The packed memories as text, best at both ends.")
    items: list[RecalledItem]
    total_tokens: int
    budget_tokens: int
    over_budget: int = Field(0, description="Relevant memories ranked but left out to keep within budget_tokens.")
    weak_match: bool = Field(False, description="The closest memory is far from the query: the store likely holds "
                                                "nothing on it, and these memories are not its answer.")


def format_context(items: list[dict[str, Any]]) -> str:
    """The packed memories as an agent reads them: a header line per memory (id, type,
    date, score) and its text."""
    if not items:
        return "(no memories matched)"
    blocks = []
    for item in items:
        head = f"[{item['id']}] {item['type']} · {str(item['created_at'])[:10]} · score {float(item['score']):.3f}"
        if item.get("project"):
            head += f" · project {item['project']}"
        blocks.append(head + "\n" + item["text"])
    return "\n\n".join(blocks)


async def _helix(tool: str, call: Any) -> Any:
    """Await a backend call; a Helix error becomes the tool error the agent reads. Any
    other is a fault: the agent reads its kind, and the log says where it was raised but
    not its message, which can quote the memory or the query (the SDK would log it
    whole, traceback and message, at ERROR); the whole traceback goes to DEBUG."""
    try:
        return await call
    except HelixError as exc:
        raise ToolError(str(exc)) from None
    except Exception as exc:
        log.error("%s failed: %s", tool, fault(exc))
        log.debug("%s failed", tool, exc_info=exc)
        raise ToolError(f"{tool} failed with an internal error ({type(exc).__name__}); the server's log (stderr) "
                        "says where. Retry once; if it fails again, the store or the server needs attention.") \
            from None


_TYPES = "episodic (what happened), semantic (facts), procedural (how to), decision (what was chosen and why), code"


def build_server(backend: Backend, *, project: str | None = None, session: str | None = None) -> MCPServer:
    """The MCP server with Helix's tools over ``backend``; ``project`` and ``session``:
    the project and the session ``remember`` files memories under when the call names
    none."""
    default_project, default_session = project, session  # the tools' own arguments shadow them

    async def recall(
        query: Annotated[str, Field(description="What to recall, as a question or keywords (non-empty).")],
        budget_tokens: Annotated[int, Field(description="Token budget of the packed context (> 0).")]
        = DEFAULT_BUDGET_TOKENS,
        k: Annotated[int | None, Field(description="Memories selected before packing, 1-200 (default 10).")] = None,
        project: Annotated[str | None, Field(description="Only memories of this project.")] = None,
        types: Annotated[list[str] | None, Field(description=f"Only these memory types: {_TYPES}.")] = None,
        since: Annotated[str | None, Field(description="ISO-8601: only memories created at or after it.")] = None,
        until: Annotated[str | None, Field(description="ISO-8601: only memories created at or before it "
                                                       "(a date alone means the end of that day).")] = None,
        context: Annotated[list[str] | None, Field(description="The conversation's recent turns, oldest first, "
                                                   "when the query is a follow-up ('and the other one?'): "
                                                   "each is searched too, the latest weighing most.")] = None,
    ) -> Annotated[CallToolResult, RecallOut]:
        """Recall this user's memories relevant to a query: earlier decisions, facts, procedures,
        conversations and code notes. Call it before answering anything that earlier sessions may
        have settled. Returns the packed context as text (a header line per memory: [id] type ·
        date · score, then its text) and the same memories as structured items; use an id with
        `forget` or `feedback`."""
        out = await _helix("recall", backend.recall(query, budget_tokens=budget_tokens, k=k, project=project,
                                                    types=types, since=since, until=until, context=context))
        from helix_ray.recall.result import weak_match_note  # numpy: not at the server's import

        packed = format_context(out["items"])
        over = int(out.get("flags", {}).get("over_budget", 0))
        weak = weak_match_note(out.get("flags", {})) if out["items"] else None
        if over and not weak:  # more of what is not about the question is not worth asking for
            packed += (f"\n\n({over} more relevant {'memory' if over == 1 else 'memories'} did not fit "
                       f"budget_tokens={out['budget_tokens']}; recall again with a larger budget to read "
                       f"{'it' if over == 1 else 'them'}.)")
        if weak:
            packed += f"\n\n({weak[0].upper()}{weak[1:]}.)"
        data = RecallOut(context=packed, items=[RecalledItem.model_validate(i) for i in out["items"]],
                         total_tokens=out["total_tokens"], budget_tokens=out["budget_tokens"], over_budget=over,
                         weak_match=weak is not None)
        return CallToolResult(content=[TextContent(type="text", text=packed)],
                              structured_content=data.model_dump(mode="json"))

    async def remember(
        text: Annotated[str, Field(description="The memory, self-contained: say what and why, as a later "
                                               "session with no context will read it.")],
        type: Annotated[str | None, Field(description=f"One of: {_TYPES}. Left out: derived from the text.")] = None,
        project: Annotated[str | None, Field(description="The project it belongs to.")] = None,
        salience: Annotated[float | None, Field(description="How important, 0-1 (derived when left out).")] = None,
        pinned: Annotated[bool | None, Field(description="Always kept and preferred over near-duplicates.")] = None,
        metadata: Annotated[dict[str, Any] | None, Field(description="Any JSON object kept with it.")] = None,
        session: Annotated[str | None, Field(description="The conversation or task it belongs to: a recall that "
                                             "finds one memory of a session also reaches the others.")] = None,
    ) -> str:
        """Store a memory for this user: a decision and its reason, a fact learned, a procedure
        that worked, a fix. It is durable before this returns and found by the very next
        `recall`. Returns the memory's id."""
        record = {"text": text, "type": type, "project": project or default_project, "salience": salience,
                  "pinned": pinned, "metadata": metadata, "session_id": session or default_session}
        out = await _helix("remember", backend.remember({k: v for k, v in record.items() if v is not None}))
        return out["ids"][0]

    async def forget(memory_id: Annotated[str, Field(description="The id, as `recall` or `remember` gave it.")]
                     ) -> str:
        """Delete one of this user's memories (wrong, outdated or unwanted): no later recall
        returns it. Returns a confirmation."""
        await _helix("forget", backend.forget(memory_id))
        return f"forgot {memory_id}"

    async def feedback(
        query: Annotated[str, Field(description="The query of the recall.")],
        memory_ids: Annotated[list[str], Field(description="Ids from that recall that answered it (1-100).")],
    ) -> str:
        """Say which memories of a recall actually answered its query. Helix learns from these
        labelled queries to recall better (the query adapter). Returns how many were recorded."""
        out = await _helix("feedback", backend.feedback(query, memory_ids))
        return f"recorded {out['recorded']}"

    async def stats() -> dict[str, Any]:
        """Counts of this user's memories: ``user_memories``, those the current generation
        holds; ``pending_writes``, the writes and deletions made since it was built, which
        recall already reflects (a new store shows 0 memories and 1 pending write after
        its first ``remember``); the store's current generation."""
        return await _helix("stats", backend.stats())

    @contextlib.asynccontextmanager
    async def warm_at_start(_server: MCPServer) -> AsyncIterator[None]:
        warming = asyncio.create_task(backend.warm())  # tools answer meanwhile; recall waits for it
        try:
            yield None
        finally:
            warming.cancel()

    return MCPServer(
        "helix", version=__version__, log_level="WARNING", lifespan=warm_at_start,
        tools=[_strict(Tool.from_function(fn)) for fn in (recall, remember, forget, feedback, stats)],
        instructions=f"Long-term memory of user {backend.user!r} across sessions. Call `recall` before answering "
                     "questions about this project's history, decisions, conventions or earlier work; call "
                     "`remember` when something worth keeping is decided, learned or fixed.")


def _strict(tool: Tool) -> Tool:
    """``tool`` refusing arguments it does not take (the SDK drops them silently), with a
    sentence naming them; in particular a ``user``: the tenant is fixed at start."""
    base = tool.fn_metadata.arg_model
    allowed = [f.alias or name for name, f in base.model_fields.items()]

    def known(cls: Any, data: Any) -> Any:
        unknown = sorted(set(data) - set(allowed)) if isinstance(data, dict) else []
        if unknown:
            tenant = (" The user is fixed when the server starts (--user, or the API key's user)."
                      if "user" in unknown else "")
            raise ValueError(f"Got {', '.join(f'{k}={data[k]!r}' for k in unknown)}; {tool.name} takes "
                             f"{', '.join(allowed) or 'no arguments'}.{tenant}")
        return data

    # Named as the SDK names it: the name heads the error the agent reads.
    Arguments = type(base.__name__, (base,), {"_known": model_validator(mode="before")(classmethod(known))})  # type: ignore[arg-type]
    tool.fn_metadata.arg_model = Arguments
    tool.parameters = {**tool.parameters, "additionalProperties": False}
    return tool


def open_backend(*, store: str | None = None, user: str | None = None, server: str | None = None,
                 key: str | None = None) -> Backend:
    """The in-process backend (``store`` and ``user``) or the HTTP one (``server`` and ``key``)."""
    if server is not None:
        if store is not None or user is not None:
            raise InvalidArgument("--server", server, "it takes --key and no --store or --user (the key's user is "
                                  "the tenant)")
        return Remote(server, key or "")
    if store is None or user is None:
        missing = "--store" if store is None else "--user"
        raise InvalidArgument(missing, None, "give --store DIR and --user USER (or --server URL --key KEY)")
    return Local(store, user)


def _exit_on_sigterm() -> None:
    """SIGTERM (how a client or a supervisor stops a server) closes the store as the end
    of input does, instead of ending the process where it stands."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)


def run_stdio(backend: Backend, *, project: str | None = None, session: str | None = None) -> None:
    """Serve MCP over stdin/stdout until the client closes it; then close the store."""
    _exit_on_sigterm()
    try:
        build_server(backend, project=project, session=session).run("stdio")
    finally:
        backend.close()


def run_http(backend: Backend, *, project: str | None = None, session: str | None = None,
             port: int = 8765) -> None:
    """Serve MCP's streamable HTTP transport on 127.0.0.1:``port`` (path ``/mcp``)."""
    _exit_on_sigterm()
    try:
        build_server(backend, project=project, session=session).run("streamable-http", host="127.0.0.1", port=port)
    finally:
        backend.close()
