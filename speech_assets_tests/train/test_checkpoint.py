import random
from pathlib import Path

import numpy as np
import torch

from speech_assets.layout import RunFiles
from speech_assets.model.encoders import weights_sha256
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.presets import get_preset
from speech_assets.train.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)


def _model(seed: int) -> HubertPretrainModel:
    torch.manual_seed(seed)
    return HubertPretrainModel(get_preset("tiny"), {"a": 8, "b": 12})


def test_checkpoint_round_trip_is_weights_only_safe(tmp_path: Path) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model(torch.randn(2, 40, 80), torch.tensor([40, 30]), torch.tensor([0, 1])).logits[0].sum().backward()
    optimizer.step()
    scheduler.step()
    state = {
        "step": 7,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cuda", enabled=False).state_dict(),
        "rng": [capture_rng_state(torch.device("cpu"))],
        "sampler": {"epoch": 1, "position": 3},
        "config": {"preset": "tiny", "clients": {"a": {"labels": "x", "k": 8}}},
        "data_versions": {"manifest": "abc"},
    }
    path = save_checkpoint(RunFiles(tmp_path).checkpoint(7), state)
    assert path.name == "step_00000007.pt"
    assert not list(path.parent.glob("*.tmp"))
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7 and loaded["data_versions"] == {"manifest": "abc"}
    assert weights_sha256(loaded["model"]) == weights_sha256(model.state_dict())
    restored = _model(1)
    restored.load_state_dict(load_checkpoint(path)["model"])
    new_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    new_optimizer.load_state_dict(loaded["optimizer"])
    assert new_optimizer.param_groups[0]["betas"] == (0.9, 0.98)


def test_rng_state_restores_all_generators() -> None:
    state = capture_rng_state(torch.device("cpu"))
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state, torch.device("cpu"))
    second = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1]) and first[2] == second[2]


def test_latest_and_prune(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10, 15, 20):
        save_checkpoint(RunFiles(tmp_path).checkpoint(step), {"step": step})
    (tmp_path / "checkpoints" / ".step_00000025.pt.abc.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == RunFiles(tmp_path).checkpoint(20)
    removed = prune_checkpoints(tmp_path, keep=2)
    # the old checkpoints, and a killed write's temp file (never read as a checkpoint)
    assert [p.name for p in removed] == ["step_00000005.pt", "step_00000010.pt", ".step_00000025.pt.abc.tmp"]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [15, 20]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000015.pt", "step_00000020.pt"]
