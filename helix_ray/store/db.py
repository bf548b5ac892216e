"""The store's DuckDB database: the durable record of what was ingested.

Tables: ``memories`` (every accepted memory, the generation's rows come from here and
from the previous generation), ``expansions`` (doc2query), ``entities`` (the graph's
entity nodes with their document frequency; the edges live only in the generation's
CSR files), ``quarantine`` (rejected records with their reason and
position: nothing is lost), ``duplicates`` (dropped → kept links), ``access_log``
(recall hits, folded into ``last_accessed_at`` / ``access_count`` at the next
generation), ``erased`` (ids of forgotten users' memories, :mod:`helix_ray.store.erase`),
``withdrawn`` (ids of memories a user deleted, which an ingest of the same text leaves deleted),
``source_names`` (the folder each of a user's document-set and repository names was
read from: :mod:`helix_ray.ingest.names`) and ``ingest_runs``.

DuckDB allows one writer process or many readers, not both: exactly one process opens
the file read-write (the ingest driver, a :class:`helix_ray.Memory`, or the Serve writer
deployment); query paths read the generation's files, never this database.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa

from helix_ray.errors import StoreError
from helix_ray.schema import parent_of
from helix_ray.store.integrity import RESTORE

DB_FILE = "helix.duckdb"

DDL = """
CREATE TABLE IF NOT EXISTS memories (
    id VARCHAR PRIMARY KEY, text VARCHAR NOT NULL, type VARCHAR NOT NULL, "user" VARCHAR NOT NULL,
    project VARCHAR, session_id VARCHAR, created_at TIMESTAMPTZ NOT NULL, last_accessed_at TIMESTAMPTZ,
    access_count INTEGER NOT NULL, salience REAL NOT NULL, confidence REAL NOT NULL, pinned BOOLEAN NOT NULL,
    source VARCHAR NOT NULL, metadata VARCHAR NOT NULL, content_hash VARCHAR NOT NULL, n_tokens INTEGER NOT NULL,
    deleted BOOLEAN NOT NULL DEFAULT FALSE, ingest_run VARCHAR
);
CREATE TABLE IF NOT EXISTS expansions (id VARCHAR PRIMARY KEY, backend VARCHAR, queries VARCHAR[]);
CREATE TABLE IF NOT EXISTS entities ("user" VARCHAR, key VARCHAR, df INTEGER, generation INTEGER);
DROP TABLE IF EXISTS edges;  -- a copy of the graph earlier versions kept: the generation holds the graph
CREATE TABLE IF NOT EXISTS quarantine (
    ingest_run VARCHAR, quarantined_at TIMESTAMPTZ, source VARCHAR, position VARCHAR, reason VARCHAR, raw VARCHAR
);
CREATE TABLE IF NOT EXISTS duplicates (dropped_id VARCHAR, kept_id VARCHAR, jaccard REAL, ingest_run VARCHAR);
CREATE TABLE IF NOT EXISTS access_log (id VARCHAR, "user" VARCHAR, accessed_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS feedback ("user" VARCHAR, query VARCHAR, memory_id VARCHAR, given_at TIMESTAMPTZ);
CREATE TABLE IF NOT EXISTS erased (id VARCHAR);
CREATE TABLE IF NOT EXISTS withdrawn (id VARCHAR PRIMARY KEY, "user" VARCHAR);
CREATE TABLE IF NOT EXISTS source_names (
    "user" VARCHAR NOT NULL, kind VARCHAR NOT NULL, name VARCHAR NOT NULL, folder VARCHAR NOT NULL,
    ingest_run VARCHAR, PRIMARY KEY ("user", kind, name)
);
CREATE TABLE IF NOT EXISTS recorded_generations (generation INTEGER, ingest_run VARCHAR);
CREATE TABLE IF NOT EXISTS ingest_runs (
    run_id VARCHAR PRIMARY KEY, started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, sources VARCHAR,
    counts VARCHAR, generation INTEGER, status VARCHAR
);
"""

MEMORY_COLUMNS = (
    "id, text, type, \"user\", project, session_id, created_at, last_accessed_at, access_count, "
    "salience, confidence, pinned, source, metadata, content_hash, n_tokens"
)


def sql_path(path: Path) -> str:
    """``path`` as a quoted SQL string literal (for ``ATTACH``)."""
    return "'" + str(path).replace("'", "''") + "'"


def copy_database(con: Any, source: str, target: Path) -> None:
    """Copy the database ``con`` has attached as ``source`` into the new file ``target``
    with DuckDB's ``COPY FROM DATABASE``: committed rows only (a write-ahead log's
    included), tables in their row order, so ``rowid`` positions stay; freed blocks of
    the source, which may hold deleted rows' bytes, are not copied."""
    con.execute(f"ATTACH {sql_path(target)} AS copy_target")
    try:
        con.execute(f"COPY FROM DATABASE {source} TO copy_target")
    finally:
        con.execute("DETACH copy_target")


class DatabaseHeld(StoreError):
    """Another process holds the database file (DuckDB admits one writing process)."""


def _damaged(path: Path, mode: str, exc: Exception) -> StoreError:
    return StoreError(f"Cannot open {path} ({mode}): it is damaged ({str(exc).splitlines()[0]}). "
                      f"`helix doctor --store {path.parent}` checks the whole store. {RESTORE}.")


#: A memories row deleted by a user or a newer ingest, not one dropped as another's
#: near-duplicate (whose row is marked deleted too).
DELETED_NOT_DROPPED = "deleted AND id NOT IN (SELECT dropped_id FROM duplicates)"

#: A ``serve_log`` row ``a`` that is a write no compaction has folded yet and no later
#: entry of its id undoes: the memory the delta serves.
PENDING_PUT = ("a.op = 'put' AND a.folded_into IS NULL "
               "AND NOT EXISTS (SELECT 1 FROM serve_log b WHERE b.id = a.id AND b.seq > a.seq)")


def in_family(id_column: str, parent: str) -> str:
    """SQL, true when ``id_column`` is ``parent`` or the id of one of its chunks: the ids
    from ``<parent>#chunk`` to ``<parent>#chunl`` (all that start with ``<parent>#chunk``),
    a range of the primary key rather than a pattern matched against each row."""
    return f"({id_column} = {parent} OR ({id_column} > {parent} || '#chunk' AND {id_column} < {parent} || '#chunl'))"


class StoreDB:
    """The single writer of a store's DuckDB file."""

    def __init__(self, store: Path, *, read_only: bool = False):
        import duckdb

        self.path = Path(store) / DB_FILE
        Path(store).mkdir(parents=True, exist_ok=True)
        mode = "read-only" if read_only else "read-write"
        try:
            self.con = duckdb.connect(str(self.path), read_only=read_only)
        except duckdb.IOException as exc:
            if "lock" not in str(exc).lower():
                raise _damaged(self.path, mode, exc) from None
            raise DatabaseHeld(
                f"Cannot open {self.path} ({mode}): {exc}. "
                "DuckDB allows one writing process or many readers: stop the other process "
                "(an ingest, a `helix serve`) or send the write through it."
            ) from None
        except duckdb.Error as exc:  # a block whose checksum does not match
            raise _damaged(self.path, mode, exc) from None
        if not read_only:
            try:
                self.con.execute(DDL)
            except duckdb.Error as exc:
                self.con.close()
                raise _damaged(self.path, mode, exc) from None

    def sibling(self) -> "StoreDB":
        """Another connection to this database, for another thread (a DuckDB connection
        serves one thread at a time; its cursors are connections of their own, each with
        its own transactions). Closing it leaves this one open."""
        other = object.__new__(StoreDB)
        other.path = self.path
        other.con = self.con.cursor()
        return other

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "StoreDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- runs
    def start_run(self, sources: Iterable[str]) -> str:
        run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.con.execute(
            "INSERT INTO ingest_runs VALUES (?, now(), NULL, ?, NULL, NULL, 'running')",
            [run_id, json.dumps(list(sources))],
        )
        return run_id

    def finish_run(self, run_id: str, counts: dict[str, Any], generation: int | None, status: str) -> None:
        self.con.execute(
            "UPDATE ingest_runs SET finished_at = now(), counts = ?, generation = ?, status = ? WHERE run_id = ?",
            [json.dumps(counts), generation, status, run_id],
        )

    # ---------------------------------------------------------------- writes
    def upsert_memories(self, table: pa.Table, run_id: str, *, ids: pa.Array | None = None) -> None:
        """``table``'s memories (only those of ``ids``, when given: selected by DuckDB,
        not copied here), replacing those stored under the same ids. Inside a
        transaction (:meth:`_replace`)."""
        if table.num_rows == 0:
            return
        select = f"SELECT {MEMORY_COLUMNS}, FALSE, ? FROM incoming"
        with self._registered("incoming", table):
            if ids is None:
                self._replace("memories", "incoming", select, [run_id])
                return
            with self._registered("incoming_ids", pa.table({"id": ids})):
                self._replace("memories", "incoming_ids", select + " WHERE id IN (SELECT id FROM incoming_ids)",
                              [run_id])

    def upsert_expansions(self, ids: pa.Array | list[str], queries: pa.Array | pa.ChunkedArray | list[str],
                          backend: str) -> None:
        """Each memory's doc2query ``queries``, given as a JSON list of strings per id:
        DuckDB parses them, so a million memories' queries are never Python lists.
        Inside a transaction (:meth:`_replace`)."""
        if not len(ids):
            return
        if not isinstance(queries, pa.ChunkedArray):
            queries = pa.array(queries, pa.string())
        table = pa.table({"id": pa.array(ids, pa.string()), "queries": queries})
        with self._registered("incoming_x", table):
            self._replace("expansions", "incoming_x",
                          "SELECT id, ?, CAST(queries AS JSON)::VARCHAR[] FROM incoming_x", [backend])

    def release_memory(self) -> None:
        """Hand back to the system what DuckDB's allocator keeps after a large statement.
        DuckDB holds on to the memory a statement freed, for the next one, and flushes
        it when its memory limit is set. ``RESET`` sets the limit to the default it
        already is (Helix sets none: a fixed limit fails inserts into a large store's
        primary key), so nothing else changes."""
        self.con.execute("RESET memory_limit")

    def _replace(self, name: str, view: str, select: str, params: list[Any]) -> None:
        """The rows of ``select`` into table ``name``, in place of those with the same
        ids as ``view``'s: deleted, then inserted. The caller holds a transaction, so
        that no one sees (and no crash leaves) the rows deleted and not yet inserted.
        DuckDB's ``INSERT OR REPLACE`` checks each row against the key's index, and
        holds several times the memory and takes several times as long for it
        (docs/benchmarks.md, "What the driver holds")."""
        self.con.execute(f"DELETE FROM {name} WHERE id IN (SELECT id FROM {view})")
        self.con.execute(f"INSERT INTO {name} {select}", params)

    def expansions_for(self, ids: list[str]) -> dict[str, list[str]]:
        if not ids:
            return {}
        with self._registered("wanted", pa.table({"id": ids})):
            rows = self.con.execute("SELECT e.id, e.queries FROM expansions e JOIN wanted USING (id)").fetchall()
        return {i: list(q or []) for i, q in rows}

    def add_quarantine(self, rows: list[dict[str, Any]], run_id: str) -> None:
        if not rows:
            return
        now = dt.datetime.now(dt.timezone.utc)
        table = pa.Table.from_pylist(
            [{"ingest_run": run_id, "quarantined_at": now, **r} for r in rows],
            schema=pa.schema([("ingest_run", pa.string()), ("quarantined_at", pa.timestamp("us", tz="UTC")),
                              ("source", pa.string()), ("position", pa.string()),
                              ("reason", pa.string()), ("raw", pa.string())]),
        )
        # Re-ingesting the same bad file must not pile up copies of the same rejection.
        with self._registered("incoming_q", table):
            self.con.execute(
                "INSERT INTO quarantine SELECT * FROM incoming_q i WHERE NOT EXISTS (SELECT 1 FROM quarantine q "
                "WHERE q.source = i.source AND q.position = i.position AND q.reason = i.reason AND q.raw = i.raw)"
            )

    def add_duplicates(self, links: list[tuple[str, str, float]], run_id: str) -> None:
        if not links:
            return
        table = pa.table({
            "dropped_id": [a for a, _, _ in links], "kept_id": [b for _, b, _ in links],
            "jaccard": pa.array([j for _, _, j in links], pa.float32()), "ingest_run": [run_id] * len(links),
        })
        self._append("duplicates", table)

    def replace_entities(self, entities: pa.Table, generation: int) -> None:
        """The entity nodes of generation ``generation``'s graph (``user``, ``key``, ``df``)."""
        self.con.execute("DELETE FROM entities")
        self._append("entities", entities.append_column("generation", pa.array([generation] * entities.num_rows, pa.int32())))

    def log_access(self, hits: list[tuple[str, str, dt.datetime]]) -> None:
        if not hits:
            return
        table = pa.table({
            "id": [h[0] for h in hits], "user": [h[1] for h in hits],
            "accessed_at": pa.array([h[2] for h in hits], pa.timestamp("us", tz="UTC")),
        })
        self._append("access_log", table)

    def add_feedback(self, user: str, query: str, memory_ids: list[str]) -> None:
        """``user`` asked ``query`` and these memories were the ones that helped: the
        labelled queries a query adapter learns from (``helix adapt --from-feedback``)."""
        self.con.begin()
        try:
            self.con.executemany('INSERT INTO feedback VALUES (?, ?, ?, now())', [[user, query, m] for m in memory_ids])
            self.con.commit()
        except BaseException:
            self.con.rollback()
            raise

    def record_source_names(self, names: list[tuple[str, str, str, str]], run_id: str) -> None:
        """``(user, kind, name, folder)``: ``user``'s ``name`` of ``kind`` names ``folder``
        from now on (read by ingest run ``run_id``)."""
        if not names:
            return
        self.con.executemany("INSERT OR REPLACE INTO source_names VALUES (?, ?, ?, ?, ?)",
                             [[*named, run_id] for named in names])

    def delete(self, ids: list[str], *, withdrawn_by: dict[str, str] | None = None) -> None:
        """Mark ``ids`` deleted and drop their feedback: one statement each, set against a
        registered list (a statement per id scans the table once per id).
        ``withdrawn_by`` (id → user): a user deleted them (not a newer version, nor a
        source that no longer holds them), so that a source read again with their text
        unchanged does not bring them back (:meth:`withdrawn`)."""
        if not ids:
            return
        with self._registered("gone", pa.table({"id": pa.array(ids, pa.string())})):
            self.con.execute("UPDATE memories SET deleted = TRUE WHERE id IN (SELECT id FROM gone)")
            self.con.execute("DELETE FROM feedback WHERE memory_id IN (SELECT id FROM gone)")
        if withdrawn_by:
            marked = pa.table({"id": pa.array(list(withdrawn_by), pa.string()),
                               "user": pa.array(list(withdrawn_by.values()), pa.string())})
            with self._registered("marked", marked):
                self.con.execute('INSERT INTO withdrawn SELECT DISTINCT id, "user" FROM marked '
                                 "WHERE id NOT IN (SELECT id FROM withdrawn)")

    def reinstate(self, ids: list[str]) -> None:
        """The memories of ``ids`` (each id's whole family: the memory and every chunk
        of it, whichever a write stores) written again by a user: no longer
        :meth:`withdrawn`."""
        parents = sorted({parent_of(i) or i for i in ids})
        if parents and self.any_withdrawn():
            with self._registered("again", pa.table({"p": pa.array(parents, pa.string())})):
                self.con.execute(f"DELETE FROM withdrawn w USING again a WHERE {in_family('w.id', 'a.p')}")

    def _append(self, name: str, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        view = f"incoming_{name}"
        with self._registered(view, table):
            self.con.execute(f"INSERT INTO {name} SELECT * FROM {view}")

    @contextmanager
    def _registered(self, view: str, table: pa.Table) -> Iterator[None]:
        """``table`` queryable as ``view`` for the block's duration."""
        self.con.register(view, table)
        try:
            yield
        finally:
            self.con.unregister(view)

    # ---------------------------------------------------------------- reads
    def row(self, sql: str, params: list[Any] | None = None) -> tuple[Any, ...] | None:
        """The first row of a query (None: no row), its result read to the end. DuckDB 2.0
        refuses to register an Arrow table (:meth:`_append`) on a connection whose last
        result was left unfinished, as ``fetchone()`` leaves even a one-row result."""
        rows = self.con.execute(sql, params or []).fetchall()
        return rows[0] if rows else None

    def known_hashes(self) -> dict[str, tuple[str, bool]]:
        """id → (content_hash, deleted) for every memory the store has seen. A memory
        dropped as a duplicate of another is not "deleted": ingesting it again is no news."""
        rows = self.con.execute(
            f"SELECT id, content_hash, {DELETED_NOT_DROPPED} FROM memories"
        ).fetchall()
        return {i: (h, d) for i, h, d in rows}

    def deleted_ids(self) -> set[str]:
        """Every memory marked deleted — also one dropped as a duplicate once, then written
        again and deleted (:meth:`known_hashes` counts a dropped one as not deleted, so
        compaction needs this list to leave such a memory out of later generations) — and
        every memory of a forgotten user (``erased``; one written again since is not)."""
        return {row[0] for row in self.con.execute(
            "SELECT id FROM memories WHERE deleted UNION "
            "SELECT id FROM erased WHERE id NOT IN (SELECT id FROM memories)").fetchall()}

    def erased_ids(self) -> set[str]:
        """The ids of forgotten users' memories (``erased``) that a generation may still
        hold, even one written again since: no later generation keeps any byte derived
        from their old text (their late-interaction tokens: :mod:`helix_ray.store.late`)."""
        return {row[0] for row in self.con.execute("SELECT id FROM erased").fetchall()}

    def access_summary(self, after: int = 0) -> tuple[dict[str, tuple[dt.datetime, int]], int]:
        """Per memory id, its latest access and how many there were, over the access-log
        rows from position ``after`` on (those a previous generation has not folded
        yet), and the position the next fold starts from. The log is append-only, so a
        position (``rowid``) names the same access for good: a forgotten user's rows are
        blanked (id null), not deleted."""
        # Times leave DuckDB as epoch microseconds: its TIMESTAMPTZ → Python path needs pytz.
        upto = self.row("SELECT coalesce(max(rowid) + 1, 0) FROM access_log")
        end = int(upto[0]) if upto is not None else 0
        rows = self.con.execute("SELECT id, epoch_us(max(accessed_at)), count(*) FROM access_log "
                                "WHERE rowid >= ? AND rowid < ? AND id IS NOT NULL GROUP BY id",
                                [int(after), end]).fetchall()
        utc = dt.timezone.utc
        return {i: (dt.datetime.fromtimestamp(t / 1e6, tz=utc), c) for i, t, c in rows}, max(end, int(after))

    def last_accesses(self, after: int = 0) -> dict[str, int]:
        """Per memory id, its latest access (epoch µs) over the access-log rows from
        position ``after`` on (see :meth:`access_summary`)."""
        summary, _ = self.access_summary(after)
        return {i: int(t.timestamp() * 1_000_000) for i, (t, _) in summary.items()}

    def counts(self) -> dict[str, Any]:
        """What the store holds. ``memories`` (and ``by_type``, ``by_user``) count the
        live memories, those written and not yet folded into a generation too
        (:meth:`pending_new`): what recall can return."""
        q = self.con.execute

        def one(sql: str) -> Any:
            row = self.row(sql)
            assert row is not None  # an aggregate without GROUP BY returns exactly one row
            return row[0]

        # A deleted memory written again counts as a memory from the write on, not as deleted.
        relived = f" AND id NOT IN (SELECT a.id FROM serve_log a WHERE {PENDING_PUT})" if self._has_serve_log() else ""
        by_type = dict(q("SELECT type, count(*) FROM memories WHERE NOT deleted GROUP BY 1").fetchall())
        by_user = dict(q('SELECT "user", count(*) FROM memories WHERE NOT deleted GROUP BY 1').fetchall())
        for user, kind, n in self.pending_new():
            by_type[kind] = by_type.get(kind, 0) + n
            by_user[user] = by_user.get(user, 0) + n
        return {
            "memories": sum(by_user.values()),
            # A record dropped as another's near-duplicate counts under "duplicates" only.
            "deleted": one(f"SELECT count(*) FROM memories WHERE {DELETED_NOT_DROPPED}{relived}"),
            "quarantined": one("SELECT count(*) FROM quarantine"),
            "duplicates": one("SELECT count(*) FROM duplicates"),
            "entities": one("SELECT count(*) FROM entities"),
            "accesses": one("SELECT count(*) FROM access_log"),
            "feedback": one("SELECT count(DISTINCT (\"user\", query)) FROM feedback"),
            "ingest_runs": one("SELECT count(*) FROM ingest_runs"),
            "by_type": dict(sorted(by_type.items())),
            "by_user": dict(sorted(by_user.items())),
        }

    def pending_new(self) -> list[tuple[str, str, int]]:
        """(user, type, count) of the memories written (``Memory.add``, ``POST``) that
        no generation holds yet and the ``memories`` table holds no live row of: the
        delta serves them until a compaction records them here."""
        if not self._has_serve_log():
            return []
        return [(str(u), str(t), int(n)) for u, t, n in self.con.execute(
            "SELECT a.\"user\", coalesce(json_extract_string(a.record, '$.type'), ''), count(*) FROM serve_log a "
            f"WHERE {PENDING_PUT} "
            "AND NOT EXISTS (SELECT 1 FROM memories m WHERE m.id = a.id AND NOT m.deleted) GROUP BY 1, 2").fetchall()]

    def _has_serve_log(self) -> bool:
        """Whether the online writes' log exists (a store no Writer has opened has none)."""
        return self.row("SELECT count(*) FROM information_schema.tables WHERE table_name = 'serve_log'") != (0,)

    def record_generation(self, number: int, run_id: str) -> None:
        """Inside the transaction that records what generation ``number`` holds: the
        database now describes it (see :meth:`recorded_generation`)."""
        self.con.execute("INSERT INTO recorded_generations VALUES (?, ?)", [int(number), run_id])

    def recorded_generation(self) -> int | None:
        """The newest generation the database describes (None: none yet)."""
        row = self.row("SELECT max(generation) FROM recorded_generations")
        return None if row is None or row[0] is None else int(row[0])

    def any_withdrawn(self) -> bool:
        """Whether a user's delete is on record at all (most stores: none)."""
        return self.row("SELECT count(*) FROM withdrawn") != (0,)

    def withdrawn(self, ids: list[str]) -> set[str]:
        """Those of ``ids`` a user deleted (:meth:`delete` ``withdrawn``) and nobody wrote again."""
        if not ids:
            return set()
        with self._registered("asked_withdrawn", pa.table({"id": pa.array(ids, pa.string())})):
            return {row[0] for row in self.con.execute(
                "SELECT w.id FROM withdrawn w JOIN asked_withdrawn a ON w.id = a.id").fetchall()}

    def dropped_as_duplicates(self, ids: list[str]) -> set[str]:
        """Those of ``ids`` that an ingest dropped as a duplicate of another memory."""
        if not ids:
            return set()
        with self._registered("asked_ids", pa.table({"id": list(ids)})):
            rows = self.con.execute("SELECT DISTINCT d.dropped_id FROM duplicates d JOIN asked_ids a "
                                    "ON d.dropped_id = a.id").fetchall()
        return {r[0] for r in rows}

    def foreign_ids(self, pairs: pa.Table) -> dict[str, str]:
        """Of ``pairs`` (a table of ``id`` and ``user``), the ids that name a live memory of
        *another* user, with that user."""
        if not pairs.num_rows:
            return {}
        with self._registered("incoming_owners", pairs.select(["id", "user"])):
            return dict(self.con.execute(
                'SELECT m.id, m."user" FROM memories m JOIN incoming_owners i ON m.id = i.id '
                'WHERE NOT m.deleted AND m."user" <> i."user"').fetchall())

    def owners(self, ids: list[str]) -> dict[str, str]:
        """id → user of each live (not deleted) memory among ``ids``."""
        if not ids:
            return {}
        return dict(self.con.execute(
            f'SELECT id, "user" FROM memories WHERE NOT deleted AND id IN ({", ".join("?" * len(ids))})',
            list(ids)).fetchall())

    def files(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        """id → (user, ``metadata.file``: the file a Markdown section was read from, None
        for a memory read from no file) of each live memory among ``ids``."""
        if not ids:
            return {}
        rows = self.con.execute(f'SELECT id, "user", metadata FROM memories WHERE NOT deleted AND id IN '
                                f'({", ".join("?" * len(ids))})', list(ids)).fetchall()
        return {i: (user, json.loads(metadata).get("file")) for i, user, metadata in rows}

    def source_folders(self, keys: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], str]:
        """``(user, kind, name)`` → the folder recorded for it, of those of ``keys`` the
        store has recorded (:meth:`record_source_names`)."""
        if not keys:
            return {}
        asked = pa.table({column: [key[i] for key in keys] for i, column in enumerate(("user", "kind", "name"))})
        with self._registered("asked_names", asked):
            rows = self.con.execute('SELECT s."user", s.kind, s.name, s.folder FROM source_names s '
                                    'JOIN asked_names USING ("user", kind, name)').fetchall()
        return {(user, kind, name): folder for user, kind, name, folder in rows}

    def feedback_pairs(self, users: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every (user, query) given feedback — of ``users`` only, if given — with the
        memories named for it, oldest first. A store without a ``feedback`` table, opened
        read-only, has none."""
        import duckdb

        where, params = "", []
        if users is not None:
            users = sorted(set(users))
            if not users:
                return []
            where, params = f'WHERE "user" IN ({", ".join("?" * len(users))})', users
        try:
            rows = self.con.execute(
                f'SELECT "user", query, list(DISTINCT memory_id ORDER BY memory_id) FROM feedback {where} '
                'GROUP BY "user", query ORDER BY min(given_at), "user", query', params).fetchall()
        except duckdb.CatalogException:
            return []
        return [{"user": u, "query": q, "memory_ids": list(ids)} for u, q, ids in rows]

    def quarantine(self, limit: int = 100, reason: str | None = None) -> list[dict[str, Any]]:
        """Rejected records, oldest first: ``reason`` reads ``"<code>: <sentence>"``; with
        ``reason`` given, only those of that code. ``quarantined_at`` is ISO-8601 text in
        UTC (a TIMESTAMPTZ fetched as a datetime needs pytz)."""
        where, params = ("WHERE split_part(reason, ':', 1) = ?", [reason]) if reason else ("", [])
        cur = self.con.execute(
            "SELECT source, position, reason, raw, ingest_run, "
            "strftime(timezone('UTC', quarantined_at), '%Y-%m-%dT%H:%M:%S.%fZ') AS quarantined_at FROM quarantine "
            f"{where} ORDER BY quarantined_at, rowid LIMIT ?", [*params, limit])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    def quarantine_reasons(self) -> dict[str, int]:
        """Reason code → how many quarantined records carry it, the most frequent first."""
        return dict(self.con.execute(
            "SELECT split_part(reason, ':', 1), count(*) FROM quarantine GROUP BY 1 ORDER BY 2 DESC, 1").fetchall())
