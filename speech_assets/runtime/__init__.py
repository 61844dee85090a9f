"""Process lifetime: children die with their launcher, run folders are locked, and runs whose
processes are gone give back their concurrency slots (no orphan, no stuck pool after kill -9)."""
