"""Ray Data jobs: ingest (sources → a published generation) and compaction."""
