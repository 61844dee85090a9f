"""bench/learning.py's fine-tuning stage: its summary of finetuned_asr's rows and the targets it
checks (pure; the stage itself runs with ``python bench/learning.py --smoke``)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from speech_assets_tests.conftest import REPO


@pytest.fixture(scope="module")
def learning():
    sys.path.insert(0, str(REPO / "bench"))  # learning.py imports its sibling machine.py
    spec = importlib.util.spec_from_file_location("bench_learning", REPO / "bench" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name)
    sys.path.remove(str(REPO / "bench"))


def rows(cer: dict[tuple[str, float], float], beam_wer: float = 0.7) -> list[dict]:
    """finetuned_asr's rows: two seeds (CER +- 0.01), greedy WER 0.9 and beam WER ``beam_wer``."""
    out = []
    for (model, minutes), value in cer.items():
        for seed in (0, 1):
            for decoder, wer in (("greedy", 0.9), ("beam_3gram", beam_wer)):
                for split in ("train", "heldout"):
                    out.append(
                        {
                            "model": model,
                            "labelled_minutes": minutes,
                            "seed": seed,
                            "decoder": decoder,
                            "split": split,
                            "cer": value + 0.01 * seed - (0.5 if split == "train" else 0),
                            "wer": wer,
                            "utterances": 40,
                            "steps": 300,
                            "labelled_seconds": minutes * 60,
                            "checkpoint_sha256": "x",
                        }
                    )
    return out


GOOD = {
    ("pretrained", 5.0): 0.55,
    ("scratch", 5.0): 0.95,
    ("pretrained", 20.0): 0.40,
    ("scratch", 20.0): 0.70,
    ("pretrained", 60.0): 0.30,
    ("scratch", 60.0): 0.45,
}
PROBE = {"pretrained": {"cer": {"mean": 0.6, "sd": 0.01, "low": 0.59, "high": 0.61, "n": 3}}}


@pytest.mark.parametrize(
    ("change", "beam_wer", "probe", "missed"),
    [
        ({}, 0.7, PROBE, set()),
        ({("scratch", 20.0): 0.50}, 0.7, PROBE, {"pretrained CER <= 0.7x", "narrows"}),  # 0.80x at 20 min
        ({("pretrained", 20.0): 0.65, ("scratch", 20.0): 0.99}, 0.7, PROBE, {"frozen probe"}),
        ({("scratch", 60.0): 0.80}, 0.7, PROBE, {"narrows"}),  # the gap widens from 20 to 60 min
        ({}, 0.95, PROBE, {"WER below greedy"}),
        ({}, 0.7, {}, set()),  # no probe: that target is unmeasured, not passed
    ],
)
def test_finetune_targets(learning, change: dict, beam_wer: float, probe: dict, missed: set[str]) -> None:
    entries = learning.finetune_summary(rows(GOOD | change, beam_wer))
    held = next(e for e in entries if (e["model"], e["minutes"], e["decoder"]) == ("pretrained", 20.0, "greedy"))
    assert held["cer"]["mean"] == pytest.approx((GOOD | change)[("pretrained", 20.0)] + 0.005) and held["cer"]["n"] == 2
    targets = learning.check_finetune_targets(entries, probe)
    assert {t.name for t in targets if t.status == "MISS"} == {
        t.name for t in targets if any(part in t.name for part in missed)
    }
    assert any(part in t.name for t in targets if t.status == "MISS" for part in missed) or not missed
    assert any(t.status == "UNMEASURED" for t in targets) == (not probe)
    assert len([t for t in targets if t.status == "PASS"]) == 4 - len(missed) - (not probe)
    report = {"finetune": entries, "finetune_targets": [t.__dict__ for t in targets], "probe": {}}
    assert "| 20 min (20.0 min) | pretrained | 2 |" in "\n".join(learning.finetune_markdown(report))


def test_no_finetune_rows_is_unmeasured(learning) -> None:
    assert [t.status for t in learning.check_finetune_targets([], PROBE)] == ["UNMEASURED"]
