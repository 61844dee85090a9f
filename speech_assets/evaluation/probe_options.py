"""The probe's options and their constraints, below the probe, its comparison and its protocol:
each of them imports this, and none imports another back."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

Probe = Literal["linear", "bilstm"]  # the probe heads: a linear layer, or one BiLSTM layer then linear
PROBES = typing.get_args(Probe)


def _distinct_seeds(seeds: Sequence[int]) -> Sequence[int]:
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError("seeds must be distinct and at least one")
    return seeds


def _distinct_positive(lrs: Sequence[float]) -> Sequence[float]:
    if len(set(lrs)) != len(lrs) or not all(lr > 0 for lr in lrs):
        raise ValueError("lrs must be distinct and > 0")
    return lrs


@pydantic_dataclass(frozen=True)
class ProbeOptions:
    """``steps`` AdamW steps of ``batch_size`` utterances at ``lr`` (linear warmup over the first
    10 %, then cosine decay); ``hidden``: BiLSTM width per direction; ``seeds``: one probe per seed
    (:func:`~speech_assets.evaluation.compare.compare_encoders`), each seed setting the probe's
    initialisation and the order it reads the utterances in); ``lrs``: learning rates to choose
    from, per model, on a development split of the training speakers, together with the stopping
    step (every ``steps // 8``; :func:`~speech_assets.evaluation.compare.compare_encoders`: SUPERB
    searches the learning rate per upstream model and tests its best development checkpoint);
    empty: ``lr`` for every model; ``steps`` is the most a probe trains. Torch-free, so the settings section
    (``[probe]``) takes its defaults and constraints from here; a list becomes a tuple."""

    probe: Probe = "linear"
    steps: Annotated[int, Field(ge=1)] = 400
    batch_size: Annotated[int, Field(ge=1)] = 8
    lr: Annotated[float, Field(gt=0)] = 2e-3
    hidden: Annotated[int, Field(ge=1)] = 128
    seeds: Annotated[tuple[int, ...], AfterValidator(_distinct_seeds)] = (0, 1, 2)
    lrs: Annotated[tuple[float, ...], AfterValidator(_distinct_positive)] = (0.002, 0.01)
