"""Where `make demo`'s time goes: wall and CPU seconds per Dagster step of `scripts/materialize_all.sh`.

    python bench/demo.py --out /tmp/demo            # a fresh data dir and instance under --out
    python bench/demo.py --out /tmp/demo --env MODEL_ASSETS=finetuned_asr   # again, one stage (reuses --out)

Runs the demo's script as `make demo` does (the venv's bin first on PATH), samples its process tree
every half second (each process's CPU, and its reaped children's), then reads the Dagster
instance's event log: each step's wall time (STEP_START to STEP_SUCCESS or STEP_FAILURE) and its
CPU seconds (the step's process and everything it started: torchrun workers, Flower's SuperLink
and SuperNodes, ONNX checks). A step's CPU is the most its process tree was seen to have used,
so a child that ends in the last half second before its step is missed. Prints a markdown table
per `dagster asset materialize` run and the totals with the load average; on a shared machine
compare CPU seconds, not wall.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def tree_cpu(pid: int, live: dict[int, tuple[int, float]], children: dict[int, list[int]]) -> float:
    """CPU seconds of ``pid`` (its own and its reaped children's) plus those of its live descendants."""
    return live[pid][1] + sum(tree_cpu(child, live, children) for child in children.get(pid, ()))


class Sampler(threading.Thread):
    """Every ``interval`` seconds: the most CPU each process tree under ``root`` was seen to use."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.most: dict[int, float] = defaultdict(float)
        self.names: dict[int, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            live: dict[int, tuple[int, float]] = {}
            try:
                processes = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    with process.oneshot():
                        t = process.cpu_times()
                        live[process.pid] = (process.ppid(), t.user + t.system + t.children_user + t.children_system)
                        self.names.setdefault(process.pid, " ".join(process.cmdline()[:6])[:120])
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            children: dict[int, list[int]] = defaultdict(list)
            for pid, (ppid, _) in live.items():
                if ppid in live and pid != self.root:
                    children[ppid].append(pid)
            for pid in live:
                self.most[pid] = max(self.most[pid], tree_cpu(pid, live, children))
            self.stop.wait(self.interval)


def step_rows(home: Path, most: dict[int, float]) -> list[tuple[str, list[tuple[str, float, float | None]], float]]:
    """Per run of the instance at ``home`` (oldest first): its selection, each step's (key, wall
    seconds, CPU seconds or None when its process was not seen) and the run's wall seconds."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(home)
    rows = []
    with dg.DagsterInstance.get() as instance:
        for run in reversed(instance.get_runs()):
            started: dict[str, tuple[float, int | None]] = {}
            steps, first, last = [], None, None
            for record in instance.all_logs(run.run_id):
                first = record.timestamp if first is None else first
                last = record.timestamp
                event = record.dagster_event
                if event is None or event.step_key is None:
                    continue
                if event.event_type == dg.DagsterEventType.STEP_START:
                    started[event.step_key] = (record.timestamp, event.pid)
                elif event.event_type in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
                    if event.step_key in started:
                        begun, pid = started[event.step_key]
                        steps.append((event.step_key, record.timestamp - begun, most.get(pid) if pid else None))
            label = ",".join(sorted(k.to_user_string() for k in run.asset_selection or [])) or run.job_name
            rows.append((label, steps, (last or 0) - (first or 0)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="holds data/ and dagster_home/ (made if missing)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the demo's environment")
    args = parser.parse_args()
    out = args.out.resolve()
    env = {
        **os.environ,
        "SPEECH_ASSETS_DATA_DIR": str(out / "data"),
        "DAGSTER_HOME": str(out / "dagster_home"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **dict(item.split("=", 1) for item in args.env),
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as `make demo` does
    known_runs = len(step_rows(out / "dagster_home", {})) if (out / "dagster_home" / "dagster.yaml").is_file() else 0
    load_before = os.getloadavg()
    started, cpu_before = time.monotonic(), os.times()
    demo = subprocess.Popen(["scripts/materialize_all.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    sampler = Sampler(demo.pid)
    sampler.start()
    output = demo.communicate()[0]
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join()
    cpu_after = os.times()
    cpu = (cpu_after.children_user - cpu_before.children_user) + (
        cpu_after.children_system - cpu_before.children_system
    )
    (out / "demo_output.txt").write_text(output)
    if demo.returncode != 0:
        print(output[-3000:])
        print(f"the demo failed: exit code {demo.returncode}")
        return 1
    runs = step_rows(out / "dagster_home", sampler.most)[known_runs:]
    print("| run | step | wall s | CPU s |\n| --- | --- | --- | --- |")
    for label, steps, run_wall in runs:
        for key, seconds, step_cpu in steps:
            shown = "n/a" if step_cpu is None else f"{step_cpu:.1f}"
            print(f"| {label[:60]} | {key} | {seconds:.1f} | {shown} |")
        print(f"| {label[:60]} | (whole run, start-up included) | {run_wall:.1f} | |")
    print(
        f"\nwhole demo: {wall:.1f} s wall, {cpu:.1f} CPU s; load average before {load_before[0]:.2f}, "
        f"after {os.getloadavg()[0]:.2f} (1 min); {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
