"""k-means settings (:class:`KMeansConfig`), apart from the fitting code: the code location reads
them (``[kmeans]``, ``[iteration2]`` in ``speech_assets.defs.resources``) without faiss."""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

MAX_K = 1 << 15
"""Labels are stored as int16, so at most 32768 clusters."""

KMeansInit = Literal["k-means++", "random"]
KMEANS_INITS = typing.get_args(KMeansInit)
NOT_FIT_KWARGS = frozenset({"k", "seed", "max_fit_frames", "min_frames_per_centroid"})
"""The fields ``fit_kmeans`` does not take as keywords: ``k`` and ``seed`` are its arguments, the
fit sample's size and K's shrink are decided before it runs."""


@dataclass(frozen=True)
class KMeansConfig:
    """Per-client k-means settings (one config for every client).

    Attributes:
        k: requested number of clusters; shrinks per client via :func:`~speech_assets.targets.kmeans.effective_k`.
        max_fit_frames: memory bound — at most this many frames (whole utterances, seeded sample)
            are gathered for fitting, so a 1,000-hour client fits in RAM.
        seed: seeds the utterance sample, the frame subsample, the init and faiss.
        niter: Lloyd iterations.
        max_points_per_centroid: with ``min_train_frames``, the size of the seeded random
            subsample of the gathered frames that Lloyd's iterations run on:
            ``max(max_points_per_centroid * k, min_train_frames)`` frames (faiss' own speed knob and
            default, 256; the inertia is still measured on all gathered frames, see
            ``inertia_sample_frames``). ``0`` means train on all gathered frames.
        min_train_frames: lower bound of the training subsample (small K still trains on a
            solid sample).
        nredo: independent faiss runs; the best (lowest training objective) is kept.
        init: ``"k-means++"`` (scikit-learn's ``kmeans_plusplus``, as in the fairseq recipe, on
            ``init_sample_per_centroid * k`` training frames) or ``"random"`` (faiss' random
            frames; cheaper, but can merge well-separated clusters).
        init_sample_per_centroid: k-means++ sample size per centroid (its cost is
            ``sample * k * log k``).
        inertia_sample_frames: the fit's inertia per frame is exact over the gathered frames when
            there are at most this many (or it is ``0``), else estimated on a seeded uniform
            sample of this many (relative error about 0.1%). The labelling
            pass measures it exactly over every frame anyway
            (:attr:`KMeansQuality.labelled_inertia_per_frame`).
        min_frames_per_centroid: K shrinks so that each centroid has at least this many frames.
        num_threads: faiss/OpenMP threads during fit and labelling; ``None`` keeps the default.
    """

    k: Annotated[int, Field(ge=1, le=MAX_K)] = 100
    max_fit_frames: Annotated[int, Field(ge=1)] = 2_000_000
    seed: int = 0
    niter: Annotated[int, Field(ge=1)] = 15
    max_points_per_centroid: Annotated[int, Field(ge=0)] = 256
    min_train_frames: Annotated[int, Field(ge=0)] = 65_536
    nredo: Annotated[int, Field(ge=1)] = 1
    init: KMeansInit = "k-means++"
    init_sample_per_centroid: Annotated[int, Field(ge=1)] = 16
    inertia_sample_frames: Annotated[int, Field(ge=0)] = 262_144
    min_frames_per_centroid: Annotated[int, Field(ge=1)] = 39
    num_threads: int | None = None

    @model_validator(mode="after")
    def _redo_needs_random_init(self) -> Self:
        if self.nredo > 1 and self.init != "random":
            raise ValueError("nredo > 1 needs init='random'")
        return self

    def fit_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~speech_assets.targets.kmeans.fit_kmeans` taken from this
        config: every field but :data:`NOT_FIT_KWARGS`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in NOT_FIT_KWARGS}


ITERATION2_KMEANS = KMeansConfig(k=500, max_fit_frames=500_000)
"""HuBERT iteration 2's k-means defaults (``[iteration2]``): K=500 as in HuBERT's second iteration,
fitted on a sample of 50 Hz encoder-layer frames."""
