"""The live store: one Writer, the delta segment beside the generation, compaction, and the
per-process views that recall over generation + delta. No Ray, no HTTP: ``helix serve``
(the ``serve`` package beside this one) wraps these in deployments and endpoints, and an
open :class:`helix_ray.Memory` calls them in process (``helix mcp --store`` through one).

Module map, in flow order::

    inputs.py       what a front door takes in: MemoryIn, MAX_BATCH, settings, error sentences
    delta_format.py the delta's files: segment schema, manifests, tombstones
    delta.py        a loaded delta snapshot, searched beside the generation; the merge
    access_log.py   the recent recall hits the readers see (delta/ACCESSES.jsonl)
    settings.py     the live retrieval overrides (serve-settings.json)
    views.py        per-process generations and delta snapshots; the hot swap
    recall.py       the legs and finish over generation + delta; ``recall_over``
    writer.py       the single DuckDB writer: its state, the log replay, snapshots
    writes.py       the write path: add, patch, delete of memories
    compaction.py   folding the delta into the next generation
    compactor.py    the background thread that decides when to compact
    forget.py       erasing a user from the database, the delta and the generations

Imports flow down from here only: this package imports the store, ingest and recall
layers, never the serve package, Ray or an HTTP framework (tests/test_index_layer.py).
"""
