"""k-means settings (:class:`KMeansConfig`), apart from the fitting code: the code location reads
them (``[kmeans]``, ``[iteration2]`` in ``speech_assets.defs.resources``) without faiss."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

MAX_K = 1 << 15  # labels are stored as int16

KMeansInit = Literal["k-means++", "random"]


@dataclass(frozen=True)
class KMeansConfig:
    """Per-client k-means settings (one config for every client)."""

    k: Annotated[int, Field(ge=1, le=MAX_K)] = 100  # shrinks per client (kmeans.effective_k)
    # memory bound: frames gathered for the fit (whole utterances, seeded), so a 1,000-hour client fits in RAM
    max_fit_frames: Annotated[int, Field(ge=1)] = 2_000_000
    seed: int = 0  # the utterance sample, the frame subsample, the init and faiss
    niter: Annotated[int, Field(ge=1)] = 15  # Lloyd iterations
    # Lloyd runs on max(max_points_per_centroid * k, min_train_frames) of the gathered frames (faiss'
    # speed knob); 0 = all
    max_points_per_centroid: Annotated[int, Field(ge=0)] = 256
    min_train_frames: Annotated[int, Field(ge=0)] = 65_536
    nredo: Annotated[int, Field(ge=1)] = 1  # independent faiss runs; the lowest objective is kept
    # k-means++ as in the fairseq recipe; "random" is cheaper but can merge well-separated clusters
    init: KMeansInit = "k-means++"
    init_sample_per_centroid: Annotated[int, Field(ge=1)] = 16  # k-means++ costs sample * k * log k
    # the fit's inertia is estimated on this many gathered frames (~0.1% error); 0 = all
    inertia_sample_frames: Annotated[int, Field(ge=0)] = 262_144
    min_frames_per_centroid: Annotated[int, Field(ge=1)] = 39  # K shrinks to keep this many frames per centroid
    num_threads: int | None = None  # faiss/OpenMP threads; None = the default

    @model_validator(mode="after")
    def _redo_needs_random_init(self) -> Self:
        if self.nredo > 1 and self.init != "random":
            raise ValueError("nredo > 1 needs init='random' (one k-means++ init would seed every run)")
        return self


# HuBERT iteration 2's k-means defaults (``[iteration2]``): K=500 as in HuBERT's second iteration
ITERATION2_KMEANS = KMeansConfig(k=500, max_fit_frames=500_000)
