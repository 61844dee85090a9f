from pathlib import Path

import pytest

from speech_assets.train import ClientTargets, TrainConfig


def _config(tmp_path: Path, **overrides: object) -> TrainConfig:
    values: dict[str, object] = {
        "run_dir": str(tmp_path / "run"),
        "shards": [str(tmp_path / "a.parquet")],
        "cmvn": str(tmp_path / "cmvn.npz"),
        "clients": {"c1": ClientTargets(str(tmp_path / "l1.parquet"), 50), "c0": {"labels": "l0.parquet", "k": 100}},
    }
    values.update(overrides)
    return TrainConfig(**values)  # type: ignore[arg-type]


def test_json_round_trip(tmp_path: Path) -> None:
    config = _config(tmp_path, grad_accum=4, nproc=2, data_versions={"manifest": "abc"}, git_sha="deadbeef")
    path = tmp_path / "config.json"
    text = config.to_json(path)
    loaded = TrainConfig.from_json(path)
    assert loaded == config
    assert path.read_text() == text
    assert list(loaded.clients) == ["c0", "c1"] and loaded.clients["c0"] == ClientTargets("l0.parquet", 100)
    assert loaded.mask_prob == 0.08 and loaded.mask_length == 10
    assert loaded.chance_accuracy == pytest.approx((1 / 100 + 1 / 50) / 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"precision": "fp8"}, "precision"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"nproc": "many"}, "nproc"),
        ({"preset": "giant"}, "preset"),
        ({"clients": {}}, "clients"),
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_invalid_values_are_rejected(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_unknown_fields_are_rejected(tmp_path: Path) -> None:
    data = _config(tmp_path).to_dict() | {"learning_rate": 1.0}
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_dict(data)


def test_paths_are_stored_as_their_strings(tmp_path: Path) -> None:
    """A caller may pass a ``Path`` for a file or folder; the config (stored as JSON) holds its string."""
    config = _config(tmp_path, run_dir=tmp_path / "run", shards=[tmp_path / "a.parquet"], cmvn=tmp_path / "c.npz")
    assert (config.run_dir, config.shards, config.cmvn) == (
        str(tmp_path / "run"),
        [str(tmp_path / "a.parquet")],
        str(tmp_path / "c.npz"),
    )
    config.to_json(tmp_path / "config.json")
    assert TrainConfig.from_json(tmp_path / "config.json") == config
