"""Process lifetime, under everything else: process trees and children that die with their launcher
(processes, supervise, orphan_guard, tether), a network namespace only its owner reaches (netns),
file and run-folder locks (locks), bounded waits (waiting), the garbage collector's view of a
loaded heap and per-thread reused buffers (heap: frozen_heap, scratch) and the fault-injection seam
for tests (faults). Run liveness, which needs Dagster, is defs/runs.py."""
