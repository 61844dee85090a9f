"""The probe's options and their rules, below the probe, its comparison and its protocol: each
of them imports this, and none imports another back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speech_assets.utils import Rule, at_least, broken_rules, one_of

PROBES = ("linear", "bilstm")  # the probe heads: a linear layer, or one BiLSTM layer then linear


@dataclass(frozen=True)
class ProbeOptions:
    """``steps`` AdamW steps of ``batch_size`` utterances at ``lr`` (linear warmup over the first
    10 %, then cosine decay); ``hidden``: BiLSTM width per direction; ``seeds``: one probe per seed
    (:func:`~speech_assets.evaluation.compare.compare_encoders`), each seed setting the probe's
    initialisation and the order it reads the utterances in); ``lrs``: learning rates to choose
    from, per model, on a development split of the training speakers, together with the stopping
    step (every ``steps // 8``; :func:`~speech_assets.evaluation.compare.compare_encoders`: SUPERB
    searches the learning rate per upstream model and tests its best development checkpoint);
    empty: ``lr``; ``steps`` is the most a probe trains. Torch-free, so the settings section
    (``[probe]``) takes its defaults and rules from here."""

    probe: str = "linear"
    steps: int = 400
    batch_size: int = 8
    lr: float = 2e-3
    hidden: int = 128
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = ()

    RULES: ClassVar[tuple[Rule, ...]] = (
        one_of("probe", PROBES),
        *at_least(1, "steps", "batch_size", "hidden"),
        Rule(("lr",), lambda lr: lr > 0, "lr must be > 0"),
        Rule(
            ("seeds",),
            lambda seeds: len(seeds) > 0 and len(set(seeds)) == len(seeds),
            "seeds must be distinct and at least one",
        ),
        Rule(
            ("lrs",),
            lambda lrs: len(set(lrs)) == len(lrs) and all(lr > 0 for lr in lrs),
            "lrs must be distinct and > 0",
        ),
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))  # settings give a list
        object.__setattr__(self, "lrs", tuple(float(lr) for lr in self.lrs))
        if problems := broken_rules(self.RULES, vars(self)):
            raise ValueError(f"invalid {type(self).__name__}: " + "; ".join(problems))
