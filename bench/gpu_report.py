"""One report from bench/gpu.sh's sections: ``$OUT/report.json`` and a plain-text summary.

    python bench/gpu_report.py OUT_FOLDER

Reads what each section left in the folder (``sections.jsonl``, ``machine.json``, ``model.json``,
``compile.json``, ``trainer.json``, ``fp16.json``, ``ddp.json``, ``oom.json``); a missing or
broken file becomes an ``error`` entry, never a crash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SECTIONS = ("machine", "model", "compile", "trainer", "fp16", "ddp", "oom")


def read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return {"error": f"{path.name}: {error}"}


def model_alone(rows: list[dict[str, Any]], attention: str, batch: float) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in rows
            if r.get("attention") == attention and not r.get("compiled") and abs(r.get("batch_seconds", 0) - batch) < 1
        ),
        None,
    )


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
    model_rows = [r for r in report["model"] if isinstance(r, dict)] if isinstance(report["model"], list) else []
    comparison = []
    for batch in sorted({r["batch_seconds"] for r in model_rows if "batch_seconds" in r}, reverse=True):
        old, new = model_alone(model_rows, "reference", batch), model_alone(model_rows, "sdpa", batch)
        if old and new and old.get("audio_seconds_per_second") and new.get("audio_seconds_per_second"):
            comparison.append(
                {
                    "batch_seconds": batch,
                    "old_audio_seconds_per_second": old["audio_seconds_per_second"],
                    "new_audio_seconds_per_second": new["audio_seconds_per_second"],
                    "speedup": new["audio_seconds_per_second"] / old["audio_seconds_per_second"],
                    "old_mfu": old.get("mfu"),
                    "new_mfu": new.get("mfu"),
                    "old_attention_kernels": old.get("attention_kernels"),
                    "new_attention_kernels": new.get("attention_kernels"),
                }
            )
    report["old_vs_new"] = comparison
    trainer = report["trainer"][0] if isinstance(report["trainer"], list) and report["trainer"] else None
    compile_rows = report["compile"] if isinstance(report["compile"], list) else []
    if trainer:
        alone = next((r for r in compile_rows if not r.get("compiled") and "audio_seconds_per_second" in r), None)
        report["trainer_vs_model"] = {
            "batch_seconds": trainer.get("batch_seconds"),
            "trainer_audio_seconds_per_second": trainer.get("audio_seconds_per_second"),
            "trainer_mfu": trainer.get("mfu"),
            "model_alone_audio_seconds_per_second": alone.get("audio_seconds_per_second") if alone else None,
            "model_alone_mfu": alone.get("mfu") if alone else None,
            "note": "the trainer's utterances are 2-16 s and padded; the model alone's are all 12 s",
            "epoch_at_end": trainer.get("epoch_at_end"),
        }
    return report


def summary(report: dict[str, Any]) -> str:
    lines = ["== report"]
    for name, entry in report["sections"].items():
        state = (
            f"skipped: {entry['skipped']}" if "skipped" in entry else f"rc {entry.get('rc')}, {entry.get('seconds')} s"
        )
        lines.append(f"section {name}: {state}")

    def fmt(value: Any, spec: str = ".3g") -> str:
        return "n/a" if value is None else format(value, spec)

    for row in report["model"] if isinstance(report["model"], list) else []:
        if "error" in row:
            lines.append(f"model {row.get('attention')} {row.get('batch_seconds')} s: ERROR {row['error']}")
            continue
        lines.append(
            f"model {row['attention']:9s} batch {row['batch_seconds']:6g} s: "
            f"{fmt(row.get('audio_seconds_per_second'))} s/s, MFU {fmt(row.get('mfu'), '.1%')}, "
            f"kernel-busy {fmt(row.get('kernel_busy_share'), '.0%')}, "
            f"positional conv {fmt(row.get('position_conv_share'), '.1%')}, syncs {row.get('sync_warnings')}, "
            f"alloc retries {row.get('alloc_retries')}, attention {(row.get('attention_kernels') or ['?'])[0][:60]}"
        )
    for row in report["compile"] if isinstance(report["compile"], list) else []:
        if "error" not in row:
            lines.append(
                f"sdpa {'compiled' if row.get('compiled') else 'eager   '} batch {row['batch_seconds']:g} s: "
                f"{fmt(row.get('audio_seconds_per_second'))} s/s, graphs {row.get('compiled_graphs', 'n/a')}"
            )
    for entry in report["old_vs_new"]:
        lines.append(f"new/old at {entry['batch_seconds']:g} s: x{entry['speedup']:.2f}")
    if "trainer_vs_model" in report:
        t = report["trainer_vs_model"]
        lines.append(
            f"trainer {fmt(t['trainer_audio_seconds_per_second'])} s/s (MFU {fmt(t['trainer_mfu'], '.1%')}) vs model "
            f"alone {fmt(t['model_alone_audio_seconds_per_second'])} s/s (MFU {fmt(t['model_alone_mfu'], '.1%')}); "
            f"epoch at end {t['epoch_at_end']}"
        )
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1])
    report = build(out)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report))
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
