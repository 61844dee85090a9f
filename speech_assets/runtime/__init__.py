"""Process lifetime, under everything else: process trees and children that die with their launcher
(processes, supervise, orphan_guard, tether), file and run-folder locks (locks), bounded waits
(waiting) and the fault-injection seam for tests (faults). Run liveness, which needs Dagster, is
defs/runs.py."""
