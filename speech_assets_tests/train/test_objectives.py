"""Held-out masked prediction: the leak-free accuracy next to the older masked and interior ones."""

from collections import Counter

import pytest
import torch

from speech_assets.features.cmvn import Cmvn
from speech_assets.model.hubert import HubertPretrainModel
from speech_assets.model.loss import IGNORE_INDEX
from speech_assets.model.masking import leak_free, pipeline_label_radius
from speech_assets.model.presets import get_preset
from speech_assets.train.data import UtteranceDataset, build_index, collate, eval_batches
from speech_assets.train.engine import Distributed
from speech_assets.train.objectives import MaskedPrediction, majority_labels
from speech_assets_tests.support.training_data import SyntheticCorpus

BATCH_SECONDS = 8.0
JOB = Distributed(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
KEYS = ("frames", "masked_accuracy", "majority_accuracy")


@pytest.fixture(scope="module")
def heldout(small_corpus: SyntheticCorpus) -> UtteranceDataset:
    """Every labelled utterance of the small corpus (2 clients, 16 utterances) as the held-out set."""
    index = build_index(small_corpus.shards, {n: c.labels for n, c in small_corpus.clients.items()}, 1500)
    return UtteranceDataset(index, index.utterances, Cmvn.load(small_corpus.cmvn), max_frames=1500)


def _objective(corpus: SyntheticCorpus, mask_prob: float, mask_length: int) -> MaskedPrediction:
    torch.manual_seed(0)
    model = HubertPretrainModel(get_preset("tiny"), {n: c.k for n, c in corpus.clients.items()})
    return MaskedPrediction(
        model, JOB.device, seed=0, mask_prob=mask_prob, mask_length=mask_length, unmasked_weight=0.0
    )


def _recount(objective: MaskedPrediction, dataset: UtteranceDataset, majority: list[int]) -> dict[str, list[int]]:
    """Leak-free frames and majority hits per client, counted again from the evaluation's masks."""
    counts = {"frames": [0, 0], "hits": [0, 0]}
    for local_index, indices in enumerate(eval_batches(dataset.seconds, BATCH_SECONDS, 1, 0)):
        batch = collate([dataset[i] for i in indices])
        mask = objective.masking.draw(batch.lengths, "heldout", local_index)
        scored = leak_free(mask, 3) & (batch.targets != IGNORE_INDEX)
        for client in (0, 1):
            rows = scored & (batch.clients == client)[:, None]
            counts["frames"][client] += int(rows.sum())
            counts["hits"][client] += int((rows & (batch.targets == majority[client])).sum())
    return counts


def test_evaluate_reports_leak_free_accuracy_overall_and_per_client(small_corpus, heldout) -> None:
    objective = _objective(small_corpus, 0.08, 10)
    majority = [1, 2]
    result = objective.evaluate(heldout, majority, BATCH_SECONDS, JOB, "fp32")
    assert pipeline_label_radius(objective.model.frontend) == 3
    # the older keys stay
    assert {"masked_accuracy", "majority_accuracy", "interior_frames", "interior_masked_accuracy"} <= set(result)
    expected = _recount(objective, heldout, majority)
    assert result["leak_free_frames"] == sum(expected["frames"]) > 0
    assert result["leak_free_majority_accuracy"] == pytest.approx(sum(expected["hits"]) / sum(expected["frames"]))
    assert 0.0 <= result["leak_free_masked_accuracy"] <= 1.0
    # leak-free frames are interior frames are masked frames
    assert result["leak_free_frames"] < result["interior_frames"]
    for client, (name, row) in enumerate(result["per_client"].items()):
        assert {f"leak_free_{key}" for key in KEYS} <= set(row), name
        assert row["leak_free_frames"] == expected["frames"][client]
        assert 0 < row["leak_free_frames"] <= row["interior_frames"] <= row["masked_frames"]
        assert row["leak_free_majority_accuracy"] == pytest.approx(
            expected["hits"][client] / expected["frames"][client]
        )
    # typical share with HuBERT's mask: well over half of the masked frames
    masked = sum(row["masked_frames"] for row in result["per_client"].values())
    assert 0.4 < result["leak_free_frames"] / masked < 0.85


@pytest.mark.parametrize(("mask_length", "per_utterance"), [(7, 1), (6, 0), (9, 3)])
def test_one_span_gives_length_minus_2r_leak_free_frames(small_corpus, heldout, mask_length, per_utterance) -> None:
    """``mask_prob = 0``: exactly one span per utterance; a span of ``2R + 1 = 7`` frames has one
    leak-free frame (its centre) wherever it lies, a shorter one none."""
    objective = _objective(small_corpus, 0.0, mask_length)
    result = objective.evaluate(heldout, [0, 0], BATCH_SECONDS, JOB, "fp32")
    assert result["leak_free_frames"] == per_utterance * len(heldout)
    assert result["interior_frames"] == (mask_length - 2) * len(heldout)
    if per_utterance == 0:
        assert result["leak_free_masked_accuracy"] is None and result["leak_free_majority_accuracy"] is None
        assert all(row["leak_free_masked_accuracy"] is None for row in result["per_client"].values())
    else:
        assert result["leak_free_masked_accuracy"] is not None


def test_the_proximal_term_pulls_towards_the_reference_and_ignores_the_heads() -> None:
    import torch

    from speech_assets.train.objectives import proximal_term

    model = torch.nn.ModuleDict({"encoder": torch.nn.Linear(3, 2), "heads": torch.nn.Linear(2, 4)})
    reference = {name: p.detach().clone() for name, p in model.named_parameters() if not name.startswith("heads")}
    assert float(proximal_term(model, reference, 0.5)) == 0.0
    with torch.no_grad():
        model["encoder"].weight.add_(1.0)
        model["heads"].weight.add_(5.0)  # not in the reference: no pull
    term = proximal_term(model, reference, 0.5)
    assert float(term) == pytest.approx(0.5 / 2 * 6)  # six weights, each 1 away
    term.backward()
    assert torch.allclose(model["encoder"].weight.grad, torch.full((2, 3), 0.5))  # mu * (w - w_ref)
    assert model["heads"].weight.grad is None


def test_majority_labels_are_each_clients_most_frequent_training_label(heldout: UtteranceDataset) -> None:
    index, refs = heldout.index, heldout.utterances[1:]  # not every utterance: only the ones given count
    counts: list[Counter[int]] = [Counter() for _ in index.clients]
    for ref in refs:
        counts[ref.client].update(int(label) for label in index.labels[ref.client][ref.utt_id] if label >= 0)
    found = majority_labels(index, refs)
    assert [count[label] for count, label in zip(counts, found, strict=True)] == [max(c.values()) for c in counts]
