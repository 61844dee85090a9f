"""One report from bench/gpu.sh's sections: ``$OUT/report.json`` and a plain-text summary.

    python bench/gpu_report.py OUT_FOLDER

Reads what each section left in the folder (``sections.jsonl``, ``machine.json``, ``model.json``,
``compile.json``, ``trainer.json``, ``fp16.json``, ``ddp.json``, ``oom.json``); a missing or
broken file becomes an ``error`` entry, never a crash. Prints the trainer's old vs new rows and
fine-tuning's, the model alone's, and issue 49's targets (GPU, ``base`` in bf16), each PASS, MISS or UNMEASURED
(with why: a smoke run on the CPU, a section that failed, a figure no section measures).
"""

from __future__ import annotations

import json
import sys
from itertools import takewhile
from pathlib import Path
from typing import Any

SECTIONS = ("machine", "model", "compile", "trainer", "fp16", "ddp", "oom")
# issue 49's targets: (name, the least value that passes; 0: exactly zero)
TARGETS = (
    ("trainer MFU, base bf16", 0.30),
    ("trainer kernel-busy share", 0.90),
    ("trainer / model alone, audio s/s", 0.85),
    ("fine-tuning / pretraining, audio s/s per step", 1 / 1.5),
    ("trainer host syncs in one step (census)", 0),
)
TRAINER_FIELDS = (
    "audio_seconds_per_second",
    "step_ms",
    "mfu",
    "kernel_busy_share",
    "attention_kernel",
    "host_syncs",
    "sync_warnings",
    "padded_batch_share",
)


def read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return {"error": f"{path.name}: {error}"}


def rows_of(value: Any) -> list[dict[str, Any]]:
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def model_alone(rows: list[dict[str, Any]], attention: str, batch: float) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in rows
            if r.get("attention") == attention and not r.get("compiled") and abs(r.get("batch_seconds", 0) - batch) < 1
        ),
        None,
    )


def ratio(new: Any, old: Any) -> float | None:
    return new / old if isinstance(new, (int, float)) and isinstance(old, (int, float)) and old else None


def target(name: str, threshold: float, value: Any, why_unmeasured: str | None) -> dict[str, Any]:
    if why_unmeasured is None and value is None:
        why_unmeasured = "no section measured it"
    if why_unmeasured is not None:
        status = "UNMEASURED"
    elif threshold == 0:
        status = "PASS" if value == 0 else "MISS"
    else:
        status = "PASS" if value >= threshold else "MISS"
    return {"target": name, "threshold": threshold, "value": value, "status": status, "why": why_unmeasured}


def build(out: Path) -> dict[str, Any]:
    status: dict[str, Any] = {}
    sections_file = out / "sections.jsonl"
    if sections_file.exists():
        for line in sections_file.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            status[entry.pop("section")] = entry
    report: dict[str, Any] = {"sections": status}
    for name in SECTIONS:
        report[name] = read(out / f"{name}.json")
    model_rows = rows_of(report["model"])
    comparison = []
    for batch in sorted({r["batch_seconds"] for r in model_rows if "batch_seconds" in r}, reverse=True):
        old, new = model_alone(model_rows, "reference", batch), model_alone(model_rows, "sdpa", batch)
        if old and new:
            comparison.append(
                {
                    "batch_seconds": batch,
                    "old_audio_seconds_per_second": old.get("audio_seconds_per_second"),
                    "new_audio_seconds_per_second": new.get("audio_seconds_per_second"),
                    "speedup": ratio(new.get("audio_seconds_per_second"), old.get("audio_seconds_per_second")),
                    "old_mfu": old.get("mfu"),
                    "new_mfu": new.get("mfu"),
                    "old_attention_kernel": old.get("attention_kernel"),
                    "new_attention_kernel": new.get("attention_kernel"),
                }
            )
    report["model_old_vs_new"] = comparison

    trainer_rows = {r.get("variant"): r for r in rows_of(report["trainer"])}
    old, new = trainer_rows.get("old"), trainer_rows.get("new")
    report["trainer_old_vs_new"] = {
        "old": {key: old.get(key) for key in TRAINER_FIELDS} | {"error": old.get("error")} if old else None,
        "new": {key: new.get(key) for key in TRAINER_FIELDS} | {"error": new.get("error")} if new else None,
        "speedup": ratio((new or {}).get("audio_seconds_per_second"), (old or {}).get("audio_seconds_per_second")),
    }
    alone = model_alone(model_rows, "sdpa", (new or {}).get("batch_seconds", -1.0))
    trainer_vs_model = ratio((new or {}).get("audio_seconds_per_second"), (alone or {}).get("audio_seconds_per_second"))
    report["trainer_vs_model"] = {
        "batch_seconds": (new or {}).get("batch_seconds"),
        "trainer_audio_seconds_per_second": (new or {}).get("audio_seconds_per_second"),
        "model_alone_audio_seconds_per_second": (alone or {}).get("audio_seconds_per_second"),
        "ratio": trainer_vs_model,
        "note": "the trainer's utterances are 2-16 s, batched by its sampler; the model alone's all 12 s",
    }

    finetune = trainer_rows.get("finetune") or {}
    finetune_ratio = ratio(finetune.get("audio_seconds_per_second"), (new or {}).get("audio_seconds_per_second"))
    report["finetune_vs_pretraining"] = {
        "finetune": {key: finetune.get(key) for key in TRAINER_FIELDS} | {"error": finetune.get("error")}
        if finetune
        else None,
        "ratio": finetune_ratio,
    }
    machine = report["machine"] if isinstance(report["machine"], dict) else {}
    gpu = None if machine.get("smoke") == 0 else "a smoke run on the CPU; the targets are for a GPU"
    if not machine:
        gpu = "the machine section left no record"
    new = new or {}
    base_bf16 = None if not new or (new.get("preset"), new.get("precision")) == ("base", "bf16") else "not base in bf16"
    report["targets"] = [
        target(TARGETS[0][0], TARGETS[0][1], new.get("mfu"), gpu or base_bf16),
        target(TARGETS[1][0], TARGETS[1][1], new.get("kernel_busy_share"), gpu),
        target(TARGETS[2][0], TARGETS[2][1], trainer_vs_model, gpu),
        target(TARGETS[3][0], TARGETS[3][1], finetune_ratio, gpu),
        target(TARGETS[4][0], TARGETS[4][1], new.get("host_syncs"), None),
    ]
    return report


def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:  # as wide as the spec's figure would be
        return "n/a".rjust(int("".join(takewhile(str.isdigit, spec)) or 0))
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def summary(report: dict[str, Any]) -> str:
    lines = ["== report"]
    for name, entry in report["sections"].items():
        state = (
            f"skipped: {entry['skipped']}" if "skipped" in entry else f"rc {entry.get('rc')}, {entry.get('seconds')} s"
        )
        lines.append(f"section {name}: {state}")
    for row in rows_of(report["model"]) + rows_of(report["compile"]):
        if "error" in row:
            lines.append(f"model {row.get('attention')} {row.get('batch_seconds')} s: ERROR {row['error']}")
            continue
        lines.append(
            f"model {row['attention']:9s}{' compiled' if row.get('compiled') else ''} "
            f"batch {row['batch_seconds']:g} s: "
            f"{fmt(row.get('audio_seconds_per_second'))} s/s, MFU {fmt(row.get('mfu'), '.1%')}, "
            f"kernel-busy {fmt(row.get('kernel_busy_share'), '.0%')}, attention {fmt(row.get('attention_kernel'))}, "
            f"syncs {row.get('sync_warnings')}, graphs {row.get('compiled_graphs', 'n/a')}"
        )
    for entry in report["model_old_vs_new"]:
        lines.append(f"model alone new/old at {entry['batch_seconds']:g} s: x{fmt(entry['speedup'])}")
    trainer = report["trainer_old_vs_new"]
    lines.append(
        f"{'trainer':8s} {'s/s':>8s} {'step ms':>8s} {'MFU':>6s} {'busy':>5s} {'attention':>10s} "
        f"{'syncs':>5s} {'warns':>5s} {'padded':>6s}"
    )
    for variant in ("old", "new", "finetune"):
        row = trainer[variant] if variant != "finetune" else report["finetune_vs_pretraining"]["finetune"]
        if row is None or row.get("error"):
            lines.append(f"{variant:8s} ERROR {(row or {}).get('error', 'no row')}")
            continue
        lines.append(
            f"{variant:8s} {fmt(row['audio_seconds_per_second'], '8.1f')} {fmt(row['step_ms'], '8.1f')} "
            f"{fmt(row['mfu'], '6.1%')} {fmt(row['kernel_busy_share'], '5.0%')} {fmt(row['attention_kernel']):>10s} "
            f"{fmt(row['host_syncs']):>5s} {fmt(row['sync_warnings']):>5s} {fmt(row['padded_batch_share'], '6.0%')}"
        )
    lines.append(
        f"trainer new/old: x{fmt(trainer['speedup'])}; fine-tuning/pretraining (new): "
        f"x{fmt(report['finetune_vs_pretraining']['ratio'])}"
    )
    t = report["trainer_vs_model"]
    lines.append(
        f"trainer {fmt(t['trainer_audio_seconds_per_second'])} s/s vs the model alone "
        f"{fmt(t['model_alone_audio_seconds_per_second'])} s/s at {fmt(t['batch_seconds'])} s: x{fmt(t['ratio'])}"
    )
    for row in rows_of(report["fp16"]):
        lines.append(
            f"fp16 trainer: {fmt(row.get('audio_seconds_per_second'))} s/s, host syncs {fmt(row.get('host_syncs'))} "
            f"{row.get('host_sync_sites') or ''}"
        )
    for entry in report["targets"]:
        why = f" ({entry['why']})" if entry["why"] else ""
        bound = "== 0" if entry["threshold"] == 0 else f">= {fmt(entry['threshold'])}"
        lines.append(f"target {entry['target']} {bound}: {fmt(entry['value'])} {entry['status']}{why}")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1])
    report = build(out)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report))
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
