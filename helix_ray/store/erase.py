"""Forgetting a user: every row of theirs leaves the store's database at once.

:func:`forget_user` deletes, in one transaction, the user's memories (chunks
included: a chunk is a memory of its own), their doc2query expansions and entities,
duplicate links, feedback, quarantined records that name
the user, the online writes' log (``serve_log``) and the folders their document sets and
repositories were read from (``source_names``); access-log rows are blanked, not
deleted, because a generation records how far into the log it has folded by row
position. The ingest-ready copies of online writes in ``inbox/`` lose the user's
lines. The database file is then rewritten into a fresh one (:func:`rewrite_database`):
DuckDB reuses freed blocks but does not wipe them, so deleted text stays readable in
the file until it is.

What the user's rows in the served generation (and the graph's edges, which only its
files hold) become is the next compaction's work:
the ids are kept in ``erased`` (ids only) so that no later generation carries those
rows over, and a generation built after this holds none of them. The single writer
runs the whole erasure (:mod:`helix_ray.live.forget`: ``DELETE /v1/users/{user}`` and
``helix forget-user``), the delta, the API keys in ``keys.json`` and the query adapter
included.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from helix_ray.errors import InvalidArgument
from helix_ray.store.db import DB_FILE, StoreDB, copy_database, sql_path
from helix_ray.store.pointer import write_text_atomic

#: Tables whose rows name the user in a ``"user"`` column, besides ``memories``.
USER_TABLES = ("entities", "feedback", "serve_log", "source_names")


def forget_user(store: str | Path, user: str, *, db: StoreDB) -> dict[str, int]:
    """Delete every row of ``user`` from ``store``'s database in one transaction, and
    their lines from the inbox files; return how many of each went.

    ``db``: the store's open writer (:class:`helix_ray.live.writer.WriterCore`'s). The
    file still holds the deleted rows' bytes in freed blocks: the caller closes its
    connection and calls :func:`rewrite_database` before opening it again."""
    if not isinstance(user, str) or not user.strip():
        raise InvalidArgument("user", user, "it must be a non-empty user id")
    counts = _delete_rows(db, user)
    counts["inbox_lines"] = _scrub_inbox(Path(store), user)
    return counts


def _delete_rows(db: StoreDB, user: str) -> dict[str, int]:
    con = db.con
    tables = {row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    con.begin()
    try:
        con.execute('CREATE TEMP TABLE forgotten AS SELECT id FROM memories WHERE "user" = ?'
                    + (' UNION SELECT id FROM serve_log WHERE "user" = ?' if "serve_log" in tables else ""),
                    [user, user] if "serve_log" in tables else [user])
        statements: dict[str, tuple[str, list[Any]]] = {
            "expansions": ("DELETE FROM expansions WHERE id IN (SELECT id FROM forgotten)", []),
            "withdrawn": ('DELETE FROM withdrawn WHERE "user" = ? OR id IN (SELECT id FROM forgotten)', [user]),
            "duplicates": ("DELETE FROM duplicates WHERE dropped_id IN (SELECT id FROM forgotten) "
                           "OR kept_id IN (SELECT id FROM forgotten)", []),
            "access_log": ('UPDATE access_log SET id = NULL, "user" = NULL '
                           'WHERE "user" = ? OR id IN (SELECT id FROM forgotten)', [user]),
            "feedback": ('DELETE FROM feedback WHERE "user" = ? OR memory_id IN (SELECT id FROM forgotten)', [user]),
            "quarantine": ("DELETE FROM quarantine WHERE try(json_extract_string(raw, '$.user')) = ?", [user]),
            **{t: (f'DELETE FROM {t} WHERE "user" = ?', [user]) for t in USER_TABLES if t in tables},
            "memories": ('DELETE FROM memories WHERE "user" = ?', [user]),
        }
        counts = {"ids": _one(db, "SELECT count(*) FROM forgotten"),
                  "chunks": _one(db, "SELECT count(*) FROM memories WHERE \"user\" = ? AND contains(id, '#chunk')",
                                 [user])}
        con.execute("INSERT INTO erased SELECT id FROM forgotten WHERE id NOT IN (SELECT id FROM erased)")
        for table, (sql, params) in statements.items():
            counts[table] = _one(db, sql, params)
        con.execute("DROP TABLE forgotten")
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return counts


def _one(db: StoreDB, sql: str, params: list[Any] | None = None) -> int:
    """A statement's row count (DuckDB returns it as the result of a DELETE/UPDATE)."""
    row = db.row(sql, params)
    return int(row[0]) if row is not None else 0


def rewrite_database(store: str | Path) -> None:
    """Copy the store's database into a fresh file and put that in its place: only live
    rows are copied, so the old file's freed blocks (deleted rows' bytes) go with it. The
    file must be closed by every process (DuckDB then lets this one open it)."""
    import duckdb

    path = Path(store) / DB_FILE
    fresh = path.with_name(f".{DB_FILE}.{uuid.uuid4().hex[:8]}")
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {sql_path(path)} AS old")
        con.execute("CHECKPOINT old")  # no write-ahead log left to replay onto the new file
        copy_database(con, "old", fresh)
        con.execute("DETACH old")
        os.replace(fresh, path)
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise
    finally:
        con.close()


def _scrub_inbox(store: Path, user: str) -> int:
    """Remove ``user``'s records from the JSONL files under ``inbox/`` (each rewritten
    and renamed into place); return how many lines went."""
    removed = 0
    inbox = store / "inbox"
    for path in sorted(inbox.rglob("*.jsonl")) if inbox.is_dir() else []:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _user_of(line) != user]
        if len(kept) == len(lines):
            continue
        removed += len(lines) - len(kept)
        write_text_atomic(path, "".join(kept))
    return removed


def _user_of(line: str) -> Any:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("user") if isinstance(record, dict) else None
