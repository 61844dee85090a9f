"""Stage 6 (pure code): the DuckDB statistics database, its queries, and checkpoint lineage."""
