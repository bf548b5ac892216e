"""Building and loading the index files of a generation: BM25 (:mod:`.bm25`), HNSW
(:mod:`.hnsw`), int8 and binary quantisation (:mod:`.quantize`) and the memory graph
(:mod:`.csr`).

This layer imports nothing from the store, ingest, recall or serve: the store writes
and opens these files, ingest builds them, recall searches them.
"""
