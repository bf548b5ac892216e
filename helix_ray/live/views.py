"""What a serving replica reads: generations (rows read by pread) and delta snapshots.

:class:`StoreViews` keeps, per replica, the generations it has open (the newest and the
one before, so a request pinned to the previous generation during a swap still finds
it), the delta snapshots it has read, and one :class:`ShellRecaller` per (generation,
delta version). A background task notices a new ``CURRENT`` and opens and warms the new
generation off the event loop before it becomes the replica's default, so no request
waits for a cold generation unless it explicitly asks for it. Swapping is a reference
assignment: a request holds the recaller it started with until it returns.

:class:`ShellRecaller` is :class:`helix_ray.recall.pipeline.Recaller` with two serving
needs and nothing else: it is cheap to construct (no router, columns built on first use)
and its scope mask also hides rows that the delta deleted or replaced. The Ranker's
recaller runs over a :class:`JoinedGeneration`: the generation's rows and the delta's
entries as one row space (delta rows are ``DELTA_BASE + seq``), so ``finish`` — fuse,
expand, rank, diversify, pack — runs unchanged over both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from helix_ray.config import RetrievalConfig
from helix_ray.errors import StoreError
from helix_ray.live.delta import DELTA_BASE, DeltaSegment, SegmentCache, effective
from helix_ray.live.delta_format import current_delta_version, delta_dir
from helix_ray.live.session_context import SessionRows
from helix_ray.heap import trim_heap_later
from helix_ray.index.csr import SESSION_EDGE_WEIGHT
from helix_ray.recall import scope as scope_mod
from helix_ray.recall.expand import ExtraEdges
from helix_ray.recall.pipeline import Recaller
from helix_ray.recall.warm import ROLE_FILES, read_through
from helix_ray.store.generation import Generation, open_good_generation
from helix_ray.store.pointer import Pointer, read_int
from helix_ray.token_encoder import PassageTokens

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- one generation


class GenerationView:
    """A generation plus what the shells derive from it once."""

    def __init__(self, generation: Generation, segments: SegmentCache | None = None,
                 sessions: SessionRows | None = None):
        self.generation = generation
        self.number = generation.number
        self._row_of: dict[str, int] = {}
        self._sessions = sessions if sessions is not None else SessionRows()  # see lone_session_row
        self._lone_rows: dict[tuple[str, str], int | None] = {}
        self._segments = segments if segments is not None else SegmentCache()  # see frozen
        # its segment files' keys there (SegmentCache.key), taken while they are sure to exist
        self.segment_keys = [SegmentCache.key(generation.path, name) for name in generation.segment_files]

    @functools.cached_property
    def columns(self):
        return self.generation.columns

    @functools.cached_property
    def frozen(self) -> DeltaSegment | None:
        """The rows this generation's segments hold (format 2, :meth:`Generation.segment_rows`),
        searched as delta entries are; None when it has none. Each segment file is parsed
        and analysed once per process (``segments``, a cache the views of a store share):
        the next generation of a fold links the same files, and adds one."""
        gen = self.generation
        if not gen.segment_files:
            return None
        parts = self._segments.get_many(gen.path, gen.segment_files, keys=self.segment_keys)
        keep = gen.segment_keep(np.concatenate([p.seq for p in parts]), [i for p in parts for i in p.ids])
        return DeltaSegment.join(0, parts, keep=keep)

    @property
    def session_nodes(self) -> dict[tuple[str, str], int]:
        """(user, session) → the graph's node of that session (:attr:`Generation.session_nodes`)."""
        return self.generation.session_nodes

    def lone_session_row(self, user: str, session: str) -> int | None:
        """The row of ``user``'s session ``session`` when this generation holds exactly
        one memory of it (so its graph has no node for the session), else None. Found
        as the Writer finds a written turn's session (``sessions``,
        :class:`~helix_ray.live.session_context.SessionRows`: a scan of the tenant's
        rows, or its index for a large tenant), once per session and generation."""
        key = (user, session)
        if key not in self._lone_rows:
            gen = self.generation
            offsets = self._sessions.offsets(gen, user, session) if user in gen.partitions \
                else np.zeros(0, np.int64)
            self._lone_rows[key] = gen.partitions[user][0] + int(offsets[0]) if len(offsets) == 1 else None
        return self._lone_rows[key]

    def rows_of(self, ids: frozenset[str]) -> np.ndarray:
        """Sorted rows of the ids this generation holds (ids it lacks are skipped)."""
        unknown = [i for i in ids if i not in self._row_of]
        if unknown:
            column = self.generation.memories.column("id")
            found = np.flatnonzero(pc.is_in(column, value_set=pa.array(unknown, pa.string())).to_numpy(
                zero_copy_only=False))
            for row in found:
                self._row_of[column[int(row)].as_py()] = int(row)
            for i in unknown:
                self._row_of.setdefault(i, -1)
        rows = [self._row_of[i] for i in ids]
        return np.array(sorted(r for r in rows if r >= 0), dtype=np.int64)

    def warm(self, role: str | None) -> None:
        """Build what ``role`` reads on every request and read its files into the page
        cache, so the first request does not pay for either (None: nothing; the caller
        warms in its own time)."""
        if role is None:
            return
        gen = self.generation
        read_through(gen.path, ROLE_FILES[role], once=True)  # a folded generation: its new files only
        _ = gen.memories, gen.vectors, gen.binary, gen.scope_columns  # the legs' and the ranker's filters
        if role in ("dense", "all"):  # each HNSW index's view (a tenant past hnsw_min_rows: a few per store)
            _ = [gen.dense_index(user) for user in gen.partitions if gen.has_dense_index(user)]
        if role in ("bm25", "all"):
            _ = gen.bm25
        if role in ("ranker", "all"):
            _ = self.columns, gen.minhash, gen.graph, gen._texts, gen.late, self.session_nodes
            self._sessions.index_large_tenants(gen)  # a written turn's session found in it (lone_session_row)
        if self.frozen is not None and role in ("bm25", "all"):  # its rows' postings, parsed and analysed once
            self.frozen.analyse(gen.bm25.analyzer)


# ----------------------------------------------------------------------------- recallers


def _has_filters(scope: scope_mod.Scope) -> bool:
    return (scope.project is not None and scope.project_mode == "filter") or scope.types is not None \
        or scope.since is not None or scope.until is not None or scope.pinned is not None


class ShellRecaller(Recaller):
    """A :class:`Recaller` for the retriever and ranker shells.

    It skips ``Recaller.__init__`` on purpose: that builds the skip-retrieval router
    (30 query embeddings) and every column of the generation, while the legs need
    neither (only the Embedder shell plans). ``hidden_rows`` (sorted generation rows)
    are masked out of both retrievers and of graph expansion.
    """

    def __init__(self, generation: Any, base: GenerationView, hidden_rows: np.ndarray,
                 config: RetrievalConfig | None = None, columns: Any = None):
        self.generation = generation
        self.embedder = None
        self._router = None
        self._token_encoder = None
        self.config = config or RetrievalConfig()
        self._base = base
        self.hidden_rows = hidden_rows
        self._columns = columns

    @property
    def columns(self):  # type: ignore[override]
        return self._columns if self._columns is not None else self._base.columns

    def _reachable(self, plan) -> np.ndarray | None:
        """The delta's entries in scope, over a joined generation (their session edges)."""
        delta = getattr(self.generation, "delta", None)
        if delta is None or not len(delta):
            return None
        return DELTA_BASE + delta.seq[delta.scope_mask(plan.scope, self.generation.number)]

    def _mask(self, plan) -> np.ndarray | None:
        start, end = self.generation.partitions[plan.user]
        mask = None
        if end > start and _has_filters(plan.scope):
            mask = scope_mod.build_mask(self._base.generation.scope_columns, start, end, plan.scope)
        hidden = self.hidden_rows[(self.hidden_rows >= start) & (self.hidden_rows < end)]
        if len(hidden):
            mask = np.ones(end - start, dtype=bool) if mask is None else mask.copy()
            mask[hidden - start] = False
        return mask


class _Joined:
    """One column over generation rows (ids < DELTA_BASE) and delta entries."""

    def __init__(self, base: Any, extra: Any, delta: DeltaSegment):
        self.base, self.extra, self.delta = base, extra, delta

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):  # a range of generation rows (scope masks slice a tenant's range)
            return self.base[key]
        if isinstance(key, (int, np.integer)):
            k = int(key)
            if k < DELTA_BASE:
                return self.base[k]
            pos = int(self.delta.positions(np.array([k]))[0])
            if pos < 0:
                raise KeyError(f"delta row {k} is not in delta snapshot {self.delta.version}")
            return self.extra[pos]
        rows = np.asarray(key, dtype=np.int64)
        in_delta = rows >= DELTA_BASE
        if not in_delta.any():
            return self.base[rows]  # a numpy array or a StringColumn: both take an array of rows
        extra = np.asarray(self.extra)
        base_part = rows[~in_delta]
        base_values = np.asarray(self.base[base_part])
        dtype = base_values.dtype if base_values.dtype == extra.dtype else np.result_type(base_values, extra) \
            if base_values.dtype != object and extra.dtype != object else object
        out = np.empty((len(rows),) + extra.shape[1:], dtype=dtype)
        out[~in_delta] = base_values
        out[in_delta] = extra[self.delta.positions(rows[in_delta])]
        return out


class _PaddedIndptr:
    """CSR row pointers where every node past the graph (a delta row) has no edges."""

    def __init__(self, indptr: np.ndarray):
        self.indptr = indptr
        self.last = len(indptr) - 1

    def __getitem__(self, node: Any) -> Any:
        if isinstance(node, (int, np.integer)):
            return self.indptr[min(int(node), self.last)]
        if isinstance(node, slice):
            return self.indptr[node]
        return np.asarray(self.indptr[np.minimum(np.asarray(node, dtype=np.int64), self.last)])

    def __len__(self) -> int:
        return len(self.indptr)


class _JoinedGraph:
    """The generation's graph with the delta's entries on it: each live entry with a
    session is linked to its session's node, as ingest links a session's memories (the
    edges that carry the graph's worth on conversations: docs/quality.md). The node is
    the generation's for that session, or, for a session it has none of, one made for
    this snapshot (numbered past the graph's nodes) once two memories share it: two
    entries, or an entry and the generation's one row of that session (ingest gives a
    session a node from its second memory on). The entries' other edges (mentions, kNN,
    temporal) come with the compaction that rebuilds the generation."""

    def __init__(self, graph, delta: DeltaSegment, view: GenerationView):
        self.indptr = _PaddedIndptr(graph.indptr)
        self.indices, self.weights, self.types = graph.indices, graph.weights, graph.types
        self.extra = _session_edges(delta, view, graph.num_nodes)


def _session_edges(delta: DeltaSegment, view: GenerationView, first_free: int) -> ExtraEdges:
    """The delta's session edges (both ways), new session nodes numbered from ``first_free``."""
    members: dict[tuple[str, str], list[int]] = {}
    live = delta.live(view.number)
    for i in np.flatnonzero(live).tolist():
        session = delta.sessions[i]
        if session:
            members.setdefault((str(delta.users[i]), str(session)), []).append(DELTA_BASE + int(delta.seq[i]))
    rows: list[int] = []
    hubs: list[int] = []
    known = view.session_nodes if members else {}
    hidden: frozenset[str] | None = None
    for key, entries in members.items():
        hub = known.get(key)
        if hub is None:
            lone = view.lone_session_row(*key)
            if lone is not None:
                hidden = delta.hidden_ids(view.number) if hidden is None else hidden
                if view.generation.memories.column("id")[lone].as_py() not in hidden:
                    entries = [lone, *entries]  # a generation row's node is its row number
            if len(entries) < 2:
                continue
            hub, first_free = first_free, first_free + 1
        rows += entries
        hubs += [hub] * len(entries)
    a, b = np.array(rows, np.int64), np.array(hubs, np.int64)
    return ExtraEdges(np.concatenate([a, b]), np.concatenate([b, a]), np.full(2 * len(a), SESSION_EDGE_WEIGHT))


class JoinedColumns:
    """:class:`helix_ray.store.generation.MemoryColumns` over generation + delta rows."""

    def __init__(self, base, delta: DeltaSegment):
        d = len(delta)
        self.ids = _Joined(base.ids, delta.ids, delta)
        self.types = _Joined(base.types, delta.types, delta)
        self.projects = _Joined(base.projects, delta.projects, delta)
        self.sessions = _Joined(base.sessions, delta.sessions, delta)
        self.created_at = _Joined(base.created_at, delta.created_at, delta)
        self.last_accessed_at = _Joined(base.last_accessed_at, np.zeros(d, np.int64), delta)
        self.salience = _Joined(base.salience, delta.salience, delta)
        self.confidence = _Joined(base.confidence, delta.confidence, delta)
        self.pinned = _Joined(base.pinned, delta.pinned, delta)
        self.n_tokens = _Joined(base.n_tokens, delta.n_tokens, delta)
        self.documents = _Joined(base.documents, np.full(d, None, dtype=object), delta)


class JoinedTokens:
    """Late-interaction tokens over generation rows and delta entries (ids ≥ DELTA_BASE),
    with :meth:`helix_ray.token_encoder.PassageTokens.lookup`'s contract."""

    def __init__(self, base: Any, delta: DeltaSegment):
        self.base, self.delta = base, delta

    def lookup(self, rows: np.ndarray):
        rows = np.asarray(rows, dtype=np.int64)
        in_base = np.flatnonzero(rows < len(self.base))
        at_delta = np.flatnonzero(rows >= DELTA_BASE)
        found = self.delta.positions(rows[at_delta]) if len(at_delta) else np.zeros(0, np.int64)
        at_delta, found = at_delta[found >= 0], found[found >= 0]
        blocks = [self.base.take(rows[in_base])]
        if len(found):
            blocks.append(self.delta.late.take(found))  # decodes those entries' blobs only
        return np.concatenate([in_base, at_delta]), PassageTokens.concat(blocks)


class JoinedGeneration:
    """The generation-shaped object ``Recaller.finish`` reads, over generation + delta."""

    def __init__(self, view: GenerationView, delta: DeltaSegment):
        gen = view.generation
        self.base = gen
        self.delta = delta
        self.number = gen.number
        self.manifest = gen.manifest
        parts = dict(gen.partitions)
        for user in delta.users_with_entries(gen.number):
            parts.setdefault(user, (gen.size, gen.size))  # a tenant the generation has no row of yet
        self.partitions = parts
        self.vectors = _Joined(gen.vectors, delta.vectors, delta)
        width = gen.minhash.shape[1] if gen.minhash.ndim == 2 else 0
        signatures = delta.minhash
        if signatures.shape[1] != width:  # built with another num_perm: never a near-duplicate
            own = (0xFFFFFFFF - delta.seq % (1 << 31)).astype(np.uint32)
            signatures = np.repeat(own[:, None], width, axis=1)
        self.minhash = _Joined(gen.minhash, signatures, delta)
        self.graph = _JoinedGraph(gen.graph, delta, view)
        self.late = JoinedTokens(gen.late, delta) if gen.late is not None else None

    @property
    def size(self) -> int:
        return self.base.size

    def text(self, row: int) -> str:
        if row < DELTA_BASE:
            return self.base.text(row)
        return self.delta.texts[int(self.delta.positions(np.array([row]))[0])]


# ----------------------------------------------------------------------------- per replica


class StoreViews:
    """The generations and delta snapshots one replica serves from.

    ``role`` says what to warm when a generation opens: "dense", "bm25", "ranker", "all"
    or None (nothing: an open ``Memory`` warms in the background). A replica follows
    ``CURRENT`` with :meth:`watch` on its event loop; a caller without one calls
    :meth:`refresh_now`, and holds a lock of its own around the calls (or, to warm a new
    generation before it serves it, :meth:`prepare` off that lock and :meth:`install`
    under it).
    """

    def __init__(self, store: str | Path, *, role: str | None, expect_embedder: str | None = None,
                 expect_dim: int | None = None, keep_generations: int = 2, keep_recallers: int = 8):
        self.store = Path(store)
        self.role = role
        self.expect: dict[str, Any] = {"expect_embedder": expect_embedder, "expect_dim": expect_dim}
        self.keep_generations = keep_generations
        self.keep_recallers = keep_recallers
        self.generations: OrderedDict[int, GenerationView] = OrderedDict()
        self.deltas: OrderedDict[int, DeltaSegment] = OrderedDict()
        # (generation, delta version) → its segments and that snapshot joined: delta_for
        self.effective: OrderedDict[tuple[int, int], DeltaSegment] = OrderedDict()
        self.segments = SegmentCache()  # delta segment files parsed once, shared by the snapshots held
        self.frozen = SegmentCache()  # generations' segment files, shared by the views held (GenerationView.frozen)
        self.sessions = SessionRows()  # a written session's rows in a generation (GenerationView.lone_session_row)
        self.recallers: OrderedDict[tuple[int, int, bool], ShellRecaller] = OrderedDict()
        self._loading: dict[int, asyncio.Future] = {}
        self._gen_pointer = Pointer(self.store / "CURRENT", read_int)
        self._delta_pointer = Pointer(delta_dir(self.store) / "CURRENT", read_int)
        self.latest: int | None = None
        self._damaged_current: int | None = None  # a CURRENT found damaged, not tried again
        self._unready: int | None = None  # a delta snapshot _follow_delta failed on, not tried again
        # Open synchronously at start: the replica is not ready before.
        generation = open_good_generation(self.store, **self._expect())
        if generation is not None:
            self.install(self._view(generation))

    # ---------------------------------------------------------------- generations
    def _expect(self) -> dict[str, Any]:
        return {k: v for k, v in self.expect.items() if v}

    def _open(self, number: int) -> GenerationView:
        return self._view(Generation(self.store / "generations" / f"{number:06d}", **self._expect()))

    def _view(self, generation: Generation) -> GenerationView:
        view = GenerationView(generation, self.frozen, self.sessions)
        view.warm(self.role)
        return view

    def install(self, view: GenerationView) -> None:
        """Serve ``view`` from now on if it is newer than what is served; keep it opened either way."""
        self.generations[view.number] = view
        self.generations.move_to_end(view.number)
        if self.latest is None or view.number > self.latest:
            self.latest = view.number  # the swap: one reference, after the view is warm
        dropped = False
        while len(self.generations) > self.keep_generations:
            oldest = next(iter(self.generations))
            if oldest == self.latest:
                break
            self.generations.pop(oldest)  # requests still using it hold their own reference
            for key in [k for k in self.recallers if k[0] == oldest]:
                self.recallers.pop(key)
            dropped = True
        if dropped:  # once those requests return, hand what the generation held back to the OS
            self.frozen.retain(key for held in self.generations.values() for key in held.segment_keys)
            trim_heap_later()

    async def generation(self, number: int | None = None, opened: Generation | None = None) -> GenerationView | None:
        """Generation ``number`` (default: this replica's newest), opened if needed
        (``opened``: already open)."""
        number = self.latest if number is None else number
        if number is None:
            return None
        view = self.generations.get(number)
        if view is not None:
            return view
        future = self._loading.get(number)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(None, self._load, number, opened)
            self._loading[number] = future
            future.add_done_callback(functools.partial(self._loaded, number))
        # Shielded: a caller cancelled while it waits (a client gone, the ingress giving
        # up on a leg) must not cancel the load every other request of the swap waits for.
        view, _ = await asyncio.shield(future)
        return view

    def _load(self, number: int, opened: Generation | None) -> tuple[GenerationView, Ready | None]:
        """Off the event loop: generation ``number`` opened and warmed, and what its first
        request would make (:meth:`ready`)."""
        view = self._open(number) if opened is None else self._view(opened)
        return view, self.ready(view)

    def _loaded(self, number: int, future: asyncio.Future) -> None:
        """A load ended: install its view, whoever awaited it (this runs before any of them resumes)."""
        self._loading.pop(number, None)
        if not future.cancelled() and future.exception() is None:
            view, ready = future.result()
            self.install(view)
            self.keep(ready)

    def _newer_current(self) -> int | None:
        """The number ``CURRENT`` names, when it is newer than this replica's and not
        known to be damaged."""
        number = self._gen_pointer.read()
        if number is None or number == self._damaged_current or (self.latest is not None and number <= self.latest):
            return None
        return number

    def _good(self, number: int) -> Generation | None:
        """The newest whole generation newer than this replica's (the current one, unless
        it is damaged: see :func:`open_good_generation`); None: keep what it serves."""
        good = open_good_generation(self.store, newer_than=self.latest, **self._expect())
        if good is None or good.number != number:
            self._damaged_current = number
        return good

    async def refresh(self) -> bool:
        """Open the store's current generation if it is newer, off the event loop; True
        if it swapped."""
        number = self._newer_current()
        if number is None:
            return False
        good = await asyncio.get_running_loop().run_in_executor(None, self._good, number)
        if good is None:
            return False
        await self.generation(good.number, good)
        log.info("%s replica now serves generation %d", self.role, good.number)
        return True

    def refresh_now(self) -> bool:
        """:meth:`refresh` in the caller's thread (one ``stat`` when nothing changed)."""
        view = self.prepare()
        if view is None:
            return False
        self.install(view)
        return True

    def prepare(self) -> GenerationView | None:
        """The store's current generation opened (and warmed for ``role``) when it is
        newer than the one served, not yet served: :meth:`install` swaps to it. None: keep
        what is served."""
        number = self._newer_current()
        good = None if number is None else self._good(number)
        return None if good is None else self._view(good)

    async def watch(self, interval_s: float = 0.5) -> None:
        """Background task: follow ``CURRENT`` every ``interval_s`` seconds, and the delta's:
        a new snapshot is read, joined and given its recallers off the event loop too."""
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bad publish must not stop the watcher
                log.exception("could not open the store's new generation; still serving %s", self.latest)
            await self._follow_delta()
            await asyncio.sleep(interval_s)

    async def _follow_delta(self) -> None:
        """Make what the first request over a new delta snapshot would make (:meth:`ready`);
        a snapshot it fails on is not tried again (the next request reads it itself, and
        reports what it finds)."""
        view = self.generations.get(self.latest) if self.latest is not None else None
        version = self.delta_version()
        if view is None or version in self.deltas or version == self._unready:
            return
        try:
            self.keep(await asyncio.get_running_loop().run_in_executor(None, self.ready, view))
        except Exception:  # noqa: BLE001 - the watcher goes on
            self._unready = version
            log.warning("could not read delta snapshot %d ahead of requests", version, exc_info=True)

    # ---------------------------------------------------------------- delta
    def delta_version(self) -> int:
        return self._delta_pointer.read() or 0

    def delta(self) -> DeltaSegment:
        """The newest delta snapshot (one ``stat`` when it did not change)."""
        for attempt in range(3):
            version = self.delta_version()
            seg = self.deltas.get(version)
            if seg is not None:
                return seg
            try:
                seg = DeltaSegment.load(self.store, version, self.segments)
            except StoreError:  # replaced and pruned between reading CURRENT and the file
                if attempt == 2:
                    raise
                self._delta_pointer = Pointer(delta_dir(self.store) / "CURRENT", read_int)
                continue
            return self._remember_delta(seg)
        raise AssertionError("unreachable")

    def _remember_delta(self, seg: DeltaSegment) -> DeltaSegment:
        seg = self.deltas.setdefault(seg.version, seg)
        while len(self.deltas) > 4:
            self.deltas.popitem(last=False)
        self.segments.retain(name for held in self.deltas.values() for name in held.segments)
        return seg

    def delta_for(self, view: GenerationView) -> DeltaSegment:
        """What recall searches beside ``view``'s files: the newest delta snapshot, joined
        with the rows of the generation's segments when it has any
        (:func:`helix_ray.live.delta.effective`)."""
        live = self.delta()
        if view.frozen is None:
            return live
        key = (view.number, live.version)
        seg = self.effective.get(key)
        if seg is None:
            seg = self._remember_joined(key, effective(live, view.frozen, view.generation.dead, view.number))
        return seg

    def _remember_joined(self, key: tuple[int, int], seg: DeltaSegment) -> DeltaSegment:
        seg = self.effective.setdefault(key, seg)
        while len(self.effective) > 4:
            self.effective.popitem(last=False)
        return seg

    def pending_ids(self, view: GenerationView) -> set[str]:
        """Ids of the newest snapshot's entries that ``view``'s generation holds neither
        in its files nor in its segments (what an answer tags as from the delta)."""
        live = self.delta()
        if not len(live):
            return set()
        pending = live.live(view.number)
        if view.frozen is not None:
            pending &= ~np.isin(live.seq, view.frozen.seq)
        return set(live.ids[pending].tolist())

    # ---------------------------------------------------------------- recallers
    def recaller(self, view: GenerationView, delta: DeltaSegment, *, joined: bool = False) -> ShellRecaller:
        key = (view.number, delta.version, joined)
        rec = self.recallers.get(key)
        if rec is None:
            rec = self._remember_recaller(key, _new_recaller(view, delta, joined))
        return rec

    def _remember_recaller(self, key: tuple[int, int, bool], rec: ShellRecaller) -> ShellRecaller:
        rec = self.recallers.setdefault(key, rec)
        while len(self.recallers) > self.keep_recallers:
            self.recallers.popitem(last=False)
        return rec

    # ---------------------------------------------------------------- ahead of requests
    def ready(self, view: GenerationView) -> Ready | None:
        """What the first request over ``view`` and the newest delta snapshot would make
        on the event loop, made by the caller's thread instead (a replica's loader: the
        swap's first requests do not wait for it): the snapshot read, joined with the
        view's segments, and the recallers of this replica's role over it. None for no
        role (``Memory`` makes them after its compaction) or a snapshot gone meanwhile
        (the request reads the newer one). Only reads the dicts; :meth:`keep` files it."""
        legs = _ROLE_LEGS.get(self.role or "", ())
        if not legs:
            return None
        version = self.delta_version()
        live = self.deltas.get(version)
        if live is None:
            try:
                live = DeltaSegment.load(self.store, version, self.segments)
            except StoreError:
                return None
        key = (view.number, live.version)
        seg = live if view.frozen is None else self.effective.get(key)
        if seg is None:
            seg = effective(live, view.frozen, view.generation.dead, view.number)
        return Ready(live, key if view.frozen is not None else None, seg,
                     {(view.number, seg.version, joined): _new_recaller(view, seg, joined) for joined in legs})

    def keep(self, ready: Ready | None) -> None:
        """File what :meth:`ready` made (on the thread that serves requests); what a
        request made meanwhile stays."""
        if ready is None:
            return
        self._remember_delta(ready.live)
        if ready.joined_key is not None:
            self._remember_joined(ready.joined_key, ready.joined)
        for key, rec in ready.recallers.items():
            self._remember_recaller(key, rec)


#: Which recallers a role's requests use (``joined``: the Ranker's, over generation + delta).
_ROLE_LEGS = {"dense": (False,), "bm25": (False,), "ranker": (True,), "all": (False, True)}


@dataclasses.dataclass
class Ready:
    """What :meth:`StoreViews.ready` made for one generation and delta snapshot."""

    live: DeltaSegment
    joined_key: tuple[int, int] | None  # (generation, version) when ``joined`` is a join
    joined: DeltaSegment
    recallers: dict[tuple[int, int, bool], ShellRecaller]


def _new_recaller(view: GenerationView, delta: DeltaSegment, joined: bool) -> ShellRecaller:
    hidden = view.rows_of(delta.hidden_ids(view.number)) if len(delta) or delta.tombstones \
        else np.zeros(0, np.int64)
    if joined:
        return ShellRecaller(JoinedGeneration(view, delta), view, hidden, columns=JoinedColumns(view.columns, delta))
    return ShellRecaller(view.generation, view, hidden)


__all__ = ["StoreViews", "Ready", "ShellRecaller", "JoinedGeneration", "GenerationView", "Pointer",
           "current_delta_version"]
