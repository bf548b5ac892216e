"""The store's DuckDB writer (helix_ray/store/db.py): memory handed back after a large
write, with nothing else changed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path


def test_release_memory_hands_back_what_a_large_insert_left(tmp_path: Path):
    """In a fresh process: a record of 300,000 memories' expansions leaves DuckDB's
    allocator holding tens of MiB; release_memory gives them back inside the open
    transaction, and the rows, the commit and the memory limit are as they were."""
    script = textwrap.dedent("""
        import json, sys
        import pyarrow as pa
        from helix_ray.store.db import StoreDB

        def heap():
            status = open("/proc/self/status").read()
            return int(status.split("RssAnon:")[1].split()[0]) / 1024

        n = 300_000
        ids = pa.array([f"doc-{i:07d}" for i in range(n)])
        queries = pa.array([json.dumps([f"what is {i}", f"where is memory {i} kept"]) for i in range(n)])
        with StoreDB(sys.argv[1]) as db:
            limit = db.con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
            db.con.begin()
            db.upsert_expansions(ids, queries, "rules")
            held = heap()
            db.release_memory()
            released = heap()
            db.con.commit()
            rows = db.con.execute("SELECT count(*), max(len(queries)) FROM expansions").fetchone()
            after = db.con.execute("SELECT current_setting('memory_limit')").fetchone()[0]
        print(json.dumps({"freed": held - released, "rows": rows, "same_limit": limit == after}))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    assert got["rows"] == [300_000, 2]
    assert got["same_limit"]
    assert got["freed"] > 16, got  # MiB: what DuckDB kept after the insert, handed back
