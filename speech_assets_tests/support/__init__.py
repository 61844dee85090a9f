"""Helpers shared by the tests and the benchmarks: real tiny corpora and shards made in code, and
in-process runs against a real Dagster instance. Nothing here is used by the assets themselves."""
