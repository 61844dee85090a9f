"""The probe's options and their constraints, below the probe, its comparison and its protocol:
each of them imports this, and none imports another back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

Probe = Literal["linear", "bilstm"]  # the probe heads: a linear layer, or one BiLSTM layer then linear


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
    """At most ``steps`` AdamW steps (warmup over 10 %, then cosine) of ``batch_size`` utterances;
    ``hidden``: BiLSTM width per direction; ``seeds``: one probe per seed (its initialisation and
    batch order); ``lrs``: chosen from per model with the stopping step on a development split, as
    SUPERB does per upstream model (empty: ``lr`` for every model). Torch-free, so the ``[probe]``
    settings take their defaults and constraints from here."""

    probe: Probe = "linear"
    steps: Annotated[int, Field(ge=1)] = 400
    batch_size: Annotated[int, Field(ge=1)] = 8
    lr: Annotated[float, Field(gt=0)] = 2e-3
    hidden: Annotated[int, Field(ge=1)] = 128
    seeds: Annotated[tuple[int, ...], AfterValidator(_distinct_seeds)] = (0, 1, 2)
    lrs: Annotated[tuple[float, ...], AfterValidator(_distinct_positive)] = (0.002, 0.01)
