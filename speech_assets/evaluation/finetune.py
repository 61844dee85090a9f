"""CTC fine-tuning of a pretrained encoder into a character recogniser, and its from-scratch baseline.

``python -m speech_assets.evaluation.finetune --config CONFIG.json`` (a FinetuneConfig, or a
FinetuneBatch of several runs): ``init`` ``scratch`` is the baseline, a random encoder of the same
architecture. The greedy dev CER selects the step (:class:`Selection`) that is scored and kept.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from speech_assets.evaluation.finetune_results import DID_NOT_TRAIN_CER
from speech_assets.evaluation.probe import score
from speech_assets.evaluation.text import VOCAB_SIZE, decode_greedy, encode, normalise
from speech_assets.features.cmvn import Normaliser, UtteranceCmvn, from_record
from speech_assets.features.shards import read_shard_table
from speech_assets.layout import RunFiles
from speech_assets.model.encoders import load_encoder
from speech_assets.model.hubert import HubertPretrainModel, output_lengths
from speech_assets.model.loss import IGNORE_INDEX
from speech_assets.model.masking import span_mask
from speech_assets.model.presets import ModelPreset
from speech_assets.train.checkpoint import load_checkpoint
from speech_assets.train.config import FinetuneBatch, FinetuneConfig
from speech_assets.train.data import (
    Batch,
    BatchBuilder,
    BatchRequest,
    CorpusIndex,
    DurationBucketSampler,
    Example,
    UtteranceDataset,
    UtteranceRef,
    collate,
    eval_batches,
    mask_generator,
    row_places,
)
from speech_assets.train.engine import (
    BatchStream,
    Distributed,
    Evaluation,
    Fit,
    default_workers,
    fixed_batch,
    seed_everything,
)
from speech_assets.train.objectives import ctc_loss
from speech_assets.train.tracking import PipesReporter
from speech_assets.train.worker import worker
from speech_assets.utils import atomic_write_text, sha256_strings

log = logging.getLogger("speech_assets.train")
CHECKPOINT_KIND = "ctc"
HEAD = "ctc"
COMMAND = "python -m speech_assets.evaluation.finetune"
PARTS = ("train", "dev", "heldout")  # of the labelled file


@dataclass(frozen=True)
class Candidate:
    utt_id: str
    speaker_id: str
    seconds: float


def ctc_feasible(num_frames: int, text: str) -> bool:
    """Whether CTC can align ``text``'s tokens to ``num_frames`` 100 Hz frames: the 50 Hz output
    needs a frame per token plus a blank between each pair of repeated tokens, and at least one token."""
    tokens = encode(text)
    repeats = sum(a == b for a, b in zip(tokens, tokens[1:]))
    return bool(tokens) and len(tokens) + repeats <= (num_frames + 1) // 2


def labelled_subset(candidates: Sequence[Candidate], heldout: Collection[str], minutes: float, seed: int) -> list[str]:
    """Sorted ids of a seeded subset of ``candidates`` outside ``heldout`` of at least ``minutes`` of
    audio. One seed's subsets are nested (as Libri-light's 10 min / 1 h / 10 h sets are)."""
    if not minutes > 0:
        raise ValueError(f"labelled minutes must be > 0, got {minutes}")
    held = set(heldout)
    pool = sorted((c for c in candidates if c.speaker_id not in held), key=lambda c: c.utt_id)
    order = np.random.default_rng([int(seed), 0xC7C]).permutation(len(pool))
    chosen, total = [], 0.0
    for index in order.tolist():
        if total >= minutes * 60:
            break
        chosen.append(pool[index].utt_id)
        total += pool[index].seconds
    return sorted(chosen)


def tri_stage(max_steps: int, stages: Sequence[float], init_scale: float, final_scale: float) -> Callable[[int], float]:
    """fairseq's tri-stage LR multiplier: linear from ``init_scale`` to 1 over the first
    ``stages[0]`` of ``max_steps``, 1 for the next ``stages[1]``, then exponential decay to
    ``final_scale`` over the last ``stages[2]``."""
    warmup, hold = round(stages[0] * max_steps), round(stages[1] * max_steps)
    decay = max(1, max_steps - warmup - hold)
    rate = -math.log(final_scale) / decay

    def factor(step: int) -> float:
        if step < warmup:
            return init_scale + (1 - init_scale) * step / warmup
        if step < warmup + hold:
            return 1.0
        return math.exp(-rate * min(step - warmup - hold, decay))

    return factor


@dataclass
class Selection:
    """Model selection on the dev set: every ``(step, dev CER)``, the best step, evaluations since it."""

    patience: int
    history: list[list[float]] = field(default_factory=list)
    best_step: int | None = None
    best_cer: float = math.inf
    stale: int = 0

    def update(self, step: int, cer: float) -> bool:
        """True once ``patience`` evaluations did not improve on the best (a tie keeps the earlier step); nothing
        counts while the best is on CTC's blank plateau, where a from-scratch model sits for hundreds of steps."""
        self.history.append([step, cer])
        if cer < self.best_cer:  # NaN never improves
            self.best_step, self.best_cer, self.stale = step, cer, 0
        elif self.best_cer < DID_NOT_TRAIN_CER:
            self.stale += 1
        return self.stale >= self.patience

    @property
    def stopped(self) -> bool:
        return self.best_step is not None and self.stale >= self.patience

    def to_dict(self) -> dict[str, Any]:
        return {"history": self.history, "best_step": self.best_step, "best_cer": self.best_cer, "stale": self.stale}

    @classmethod
    def from_dict(cls, patience: int, stored: Mapping[str, Any] | None) -> Selection:
        return cls(patience, **copy.deepcopy(dict(stored or {})))


def text_overlap(heldout: Mapping[str, str], *others: Mapping[str, str]) -> int:
    """How many utterances of ``others`` have a normalised transcript that is also a held-out one."""
    held = {normalise(t) for t in heldout.values()}
    return sum(normalise(t) in held for texts in others for t in texts.values())


def oov_rate(heldout: Mapping[str, str], lexicon_texts: Sequence[str]) -> float | None:
    """The share of held-out word tokens the beam decoder's lexicon cannot output."""
    words = {w for text in lexicon_texts for w in normalise(text).split()}
    tokens = [w for text in heldout.values() for w in normalise(text).split()]
    return sum(w not in words for w in tokens) / len(tokens) if tokens else None


class TranscribedDataset(UtteranceDataset):
    """Whole utterances, normalised, with their transcripts' token ids as ``labels (S,)``."""

    def __init__(
        self, index: CorpusIndex, utterances: Sequence[UtteranceRef], cmvn: Normaliser, texts: Mapping[str, str]
    ) -> None:
        super().__init__(index, utterances, cmvn, max_frames=max((u.num_frames for u in utterances), default=1))
        self.tokens = {u.utt_id: encode(texts[u.utt_id]) for u in utterances}
        self.texts = [texts[u.utt_id] for u in utterances]

    def __getitem__(self, item: int) -> Example:
        ref = self.utterances[item]
        feats = self.cmvn.apply(self.logmel(ref), "logmel")
        return Example(ref.utt_id, 0, torch.from_numpy(feats), torch.tensor(self.tokens[ref.utt_id], dtype=torch.long))


@dataclass
class CtcBatch(Batch):
    """A batch masked for its step: bands zeroed in ``feats``, frames in ``mask``; ``ctc_lengths``:
    ``(input, target)`` lengths on the host, where the CTC kernel reads them (they stay there)."""

    ctc_lengths: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class CtcMasking:
    """Fine-tuning's masks, from ``(seed, step, rank, micro)``: drawn by the loader's workers."""

    seed: int
    mask_prob: float
    mask_length: int
    channel_prob: float
    channel_length: int
    rank: int = 0

    def masks(self, lengths: torch.Tensor, *parts: int | str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(B, L)`` frame and ``(B, 80)`` band masks (``None`` at probability 0), in this RNG order."""
        generator = mask_generator(self.seed, "ctc", *parts)
        mask = channels = None
        if self.mask_prob > 0:
            mask = span_mask(output_lengths(lengths), self.mask_prob, self.mask_length, generator)
        if self.channel_prob > 0:
            bands = torch.full_like(lengths, 80)
            channels = span_mask(bands, self.channel_prob, self.channel_length, generator, min_spans=0)
        return mask, channels

    def __call__(self, batch: Batch, step: int, micro: int) -> CtcBatch:
        mask, channels = self.masks(batch.lengths, step, self.rank, micro)
        feats = (
            batch.feats if channels is None else batch.feats.masked_fill(channels.to(batch.feats.device)[:, None], 0)
        )
        counts = (batch.targets != IGNORE_INDEX).sum(dim=1)
        return CtcBatch(
            **{f.name: getattr(batch, f.name) for f in fields(Batch)}
            | {"feats": feats, "mask": mask, "masked_for": (self, step, micro)},
            ctc_lengths=(output_lengths(batch.lengths), counts),
        )


class CtcBatches(BatchBuilder):
    """What the loader's workers run for fine-tuning: batches masked for the step they train at."""

    def __getitem__(self, request: BatchRequest) -> Batch:  # type: ignore[override]
        batch = super().__getitem__(replace(request, masking=None))
        masking: Any = request.masking
        return batch if masking is None or request.slot is None else masking(batch, *request.slot)


class CtcForward(nn.Module):
    """An encoder with a CTC head ``model.heads[0]``: ``feats (B, T, 80)``, ``lengths (B,)``, optional
    ``mask (B, L)`` -> log-probabilities ``(B, L, V)`` float32. ``frozen="no_grad"`` trains only the
    head; ``"zero"`` gives the encoder an exact zero gradient instead (DDP needs a gradient for every
    parameter it wraps). ``padded``: as :meth:`HubertPretrainModel.encode`'s."""

    def __init__(self, model: HubertPretrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        feats: torch.Tensor,
        lengths: torch.Tensor,
        mask: torch.Tensor | None = None,
        frozen: str = "",
        padded: bool | None = None,
    ) -> torch.Tensor:
        with torch.no_grad() if frozen == "no_grad" else contextlib.nullcontext():
            hidden = self.model.encode(feats, lengths, mask, padded).hidden
        hidden = hidden.detach() + 0.0 * hidden if frozen == "zero" else hidden
        return torch.log_softmax(self.model.heads[0](hidden).float(), dim=-1)


@dataclass
class CtcTraining:
    """CTC fine-tuning: the encoder frozen for ``freeze_steps`` steps, :class:`CtcMasking`'s masks
    (drawn here when the loader did not). Statistics ``(3,)``: micro-batches, summed loss, frozen
    micro-batches. Nothing in a step reads the device."""

    device: torch.device
    _: KW_ONLY
    freeze_steps: int
    masking: CtcMasking

    def __call__(self, model: nn.Module, batch: Batch, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(batch, CtcBatch) or batch.masked_for != (self.masking, step, micro):
            batch = self.masking(batch, step, micro)
        frozen = step < self.freeze_steps
        batch = batch.to(self.device)
        mode = ("zero" if isinstance(model, DistributedDataParallel) else "no_grad") if frozen else ""
        log_probs = model(batch.feats, batch.lengths, batch.mask, mode, batch.padded)
        loss = ctc_loss(log_probs, batch.lengths, batch.targets, batch.ctc_lengths)
        value = loss.detach().double()
        return loss, torch.stack([torch.ones_like(value), value, torch.full_like(value, float(frozen))])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        count = float(totals[0].clamp(min=1))
        return {"loss": float(totals[1]) / count, "frozen": float(totals[2]) / count}


def transcribed_index(shards: Sequence[str], wanted: Collection[str]) -> CorpusIndex:
    """Where each of the ``wanted`` utterances lives in ``shards`` (whole length, one client)."""
    wanted, refs = set(wanted), []
    for shard, path in enumerate(shards):
        rows = read_shard_table(path, columns=["utt_id", "speaker_id", "num_frames"]).to_pylist()
        refs += [
            UtteranceRef(row["utt_id"], shard, g, r, int(row["num_frames"]), 0, row["speaker_id"])
            for row, (g, r) in zip(rows, row_places(path), strict=True)
            if row["utt_id"] in wanted
        ]
    missing = sorted(wanted - {r.utt_id for r in refs})
    if missing:
        raise ValueError(f"{len(missing)} labelled or held-out utterances are in no shard: {missing[:5]}")
    return CorpusIndex(list(shards), [HEAD], refs, [{}], 0)


def build_model(config: FinetuneConfig) -> tuple[HubertPretrainModel, dict[str, Any], Normaliser]:
    """The encoder (random for ``scratch``) with a fresh CTC head, its identity and its normalisation."""
    loaded = load_encoder(config.encoder)
    preset = ModelPreset(**loaded.checkpoint["preset"]) if "preset" in loaded.checkpoint else loaded.model.preset
    torch.manual_seed(config.seed)
    model = HubertPretrainModel(preset, {HEAD: VOCAB_SIZE})
    if config.init == "pretrained":
        encoder_state = {k: v for k, v in loaded.model.state_dict().items() if not k.startswith("heads.")}
        missing, unexpected = model.load_state_dict(encoder_state, strict=False)
        if unexpected or any(not k.startswith("heads.") for k in missing):
            raise ValueError(f"{config.encoder}: the encoder does not fit ({missing=}, {unexpected=})")
    cmvn = from_record(loaded.checkpoint.get("normalisation")) or UtteranceCmvn()
    return model.train(), {"sha256": loaded.sha256, "speakers": loaded.checkpoint.get("speakers")}, cmvn


@torch.no_grad()
def log_probabilities(
    model: HubertPretrainModel, dataset: TranscribedDataset, device: torch.device, batch_seconds: float = 32.0
) -> list[np.ndarray]:
    """CTC log-probabilities ``(L_i, 29)`` float32 of every utterance of ``dataset`` (eval mode, no masks)."""
    forward = CtcForward(model).eval()
    out: list[np.ndarray | None] = [None] * len(dataset)
    for batch_indices in eval_batches(dataset.seconds, batch_seconds, 1, 0):
        batch = collate([dataset[i] for i in batch_indices])
        log_probs = forward(batch.feats.to(device), batch.lengths.to(device), padded=batch.padded).cpu().numpy()
        for row, (index, length) in enumerate(zip(batch_indices, output_lengths(batch.lengths).tolist(), strict=True)):
            out[index] = log_probs[row, :length]
    forward.train()
    return [x for x in out if x is not None]


def greedy(log_probs: Sequence[np.ndarray]) -> list[str]:
    return [decode_greedy(lp.argmax(axis=-1).tolist()) for lp in log_probs]


def score_rows(
    sets: Mapping[str, TranscribedDataset],
    log_probs: Mapping[str, Sequence[np.ndarray]],
    beam: Callable[[Sequence[np.ndarray]], list[str]] | None = None,
    beam_name: str = "",
) -> list[dict[str, Any]]:
    """One row (``decoder, split, cer, wer, utterances``) per split and decoder."""
    rows = []
    decoders = {"greedy": greedy} | ({beam_name: beam} if beam is not None else {})
    for split, dataset in sets.items():
        if len(dataset) == 0:
            continue
        for name, decode in decoders.items():
            s = score(dataset.texts, decode(log_probs[split]))
            rows.append({"decoder": name, "split": split, "cer": s.cer, "wer": s.wer, "utterances": s.utterances})
    return rows


def finetune(config: FinetuneConfig) -> dict[str, Any] | None:
    """Fine-tune in this process (alone or as one torchrun rank); ``result.json``'s content on rank 0."""
    with worker(config.run_dir, config.device, command=COMMAND) as job:
        return FineTuning(job, config).run(PipesReporter(log) if job.is_main else None)


def finished_result(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's ``result.json`` when it finished (its checkpoint is there), else None."""
    path = RunFiles(run_dir).result
    if path.is_file():
        result = json.loads(path.read_text())
        if result.get("checkpoint") and Path(result["checkpoint"]).is_file():
            return result
    return None


def finetune_batch(batch: FinetuneBatch) -> list[dict[str, Any]] | None:
    """The runs of ``batch`` one after another, each as :func:`finetune` would train it: with all
    ranks (DDP), or with ``batch.parallel`` this rank's share, each as a job of one process. The
    results of the runs this process led; ``None`` on a DDP batch's other ranks."""
    from speech_assets.runtime.locks import hold_as_worker

    with worker(batch.run_dir, batch.device, command=COMMAND) as job, contextlib.ExitStack() as held:
        configs = [batch.run_config(folder) for folder in batch.runs]
        # parallel: this process's share, each run a job of one process (rank 0 of 1: no DDP, its own files)
        mine = configs[job.rank :: job.world_size] if batch.parallel else configs
        runner = replace(job, rank=0, world_size=1) if batch.parallel else job
        job.batch = (batch.batch_seconds, batch.grad_accum)
        for config in mine:
            held.callback(hold_as_worker(config.run_dir).close)  # as a lone run's workers hold theirs
        reporter = PipesReporter(log) if job.is_main else None
        results = []
        for config in mine:
            if (finished := finished_result(config.run_dir)) is not None:
                log.info("%s: finished before", config.run_dir)
                results.append(finished)
                continue
            with run_log(Path(config.run_dir)) if runner.is_main else contextlib.nullcontext():
                if runner.is_main:
                    config.to_json(RunFiles(config.run_dir).config)  # what this attempt runs
                results.append(FineTuning(runner, config).run(None))
        if not runner.is_main:
            return None
        keys = ("checkpoint", "checkpoint_sha256", "step", "init", "seed", "heldout_cer", "heldout_wer")
        done = [{"run_dir": str(c.run_dir), **{k: r.get(k) for k in keys}} for c, r in zip(mine, results, strict=True)]
        summary = json.dumps({"runs": done, "checkpoint_sha256": None}, indent=2, sort_keys=True)
        atomic_write_text(RunFiles(batch.run_dir).rank_result(job.rank), summary + "\n")
        if reporter is not None:
            # the other processes' runs may still train: the asset reads every run's result.json after the launch
            reporter.report(
                {"runs": len(configs), "run_dirs": {"folders": [str(c.run_dir) for c in configs]}},
                data_version=sha256_strings(sorted(c.run_dir for c in configs)),
            )
        return results


@contextlib.contextmanager
def run_log(run_dir: Path) -> Iterator[None]:
    """The main process's records (INFO and up) to the run's ``train.log`` too while it trains."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / RunFiles.log.name, encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s"))
    level = log.level
    log.setLevel(logging.INFO)  # a parallel batch's other processes log only warnings elsewhere
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()


class FineTuning(Fit):
    """One fine-tuning run on this rank of ``job``. Its dev CER is scored on a snapshot of the weights
    in the background (:class:`~speech_assets.train.engine.Evaluation`; ``background_evaluation``):
    the steps go on meanwhile and patience stops the run one evaluation late, with the selection a
    synchronous run makes (an evaluation is recorded before the next checkpoint prunes)."""

    materialized = ("steps_trained", "dev_cer", "lr", "heldout_cer", "heldout_wer")
    background_evaluation = True

    def __init__(self, job: Distributed, config: FinetuneConfig) -> None:
        precision = fixed_batch(job, config)
        self.job = job
        self.texts = texts = json.loads(Path(config.labelled).read_text(encoding="utf-8"))
        texts.setdefault("dev", {})
        self.index = index = transcribed_index(config.shards, {u for part in PARTS for u in texts[part]})
        seed_everything(config.seed)
        model, self.encoder, self.cmvn = build_model(config)
        refs = {part: [u for u in index.utterances if u.utt_id in texts[part]] for part in PARTS}
        train_refs, dev_refs, self.heldout_refs = refs["train"], refs["dev"], refs["heldout"]
        self.speakers = {split: sorted({u.speaker_id for u in found}) for split, found in refs.items()}
        train_speakers, dev_speakers = set(self.speakers["train"]), set(self.speakers["dev"])
        if leaked := sorted((train_speakers | dev_speakers) & set(self.speakers["heldout"])):
            raise ValueError(f"labelled or dev utterances of held-out speakers {leaked[:10]}")
        if dev_labelled := sorted(train_speakers & dev_speakers):
            raise ValueError(f"dev utterances of labelled speakers {dev_labelled[:10]}")
        if not train_refs:
            raise ValueError("no labelled utterances")
        self.overlap = text_overlap(texts["heldout"], texts["train"], texts["dev"])
        if self.overlap:
            log.warning("%d labelled or dev utterances read a held-out sentence", self.overlap)
        self.dataset = TranscribedDataset(index, train_refs, self.cmvn, texts["train"])
        self.dev_set = TranscribedDataset(index, dev_refs, self.cmvn, texts["dev"])
        sampler = DurationBucketSampler(
            self.dataset.seconds, config.batch_seconds, num_replicas=job.world_size, rank=job.rank, seed=config.seed
        )
        sampler.num_workers = default_workers(job)
        stream = BatchStream(self.dataset, sampler, config.seed, device=job.device, builder=CtcBatches)
        self.model = model = model.to(job.device)
        frozen = (0, False) if config.init == "scratch" else (config.freeze_steps, config.freeze_frontend)
        self.freeze_steps, self.freeze_frontend = frozen  # a random encoder frozen is no baseline
        model.frontend.requires_grad_(not self.freeze_frontend)
        model.mask_embedding.requires_grad_(config.mask_prob > 0)
        masking = CtcMasking(
            config.seed,
            config.mask_prob,
            config.mask_length,
            config.channel_mask_prob,
            config.channel_mask_length,
            job.rank,
        )
        objective = CtcTraining(job.device, freeze_steps=self.freeze_steps, masking=masking)
        resumed = self.start(
            model,
            job,
            config,
            stream,
            objective,
            precision=precision,
            schedule=tri_stage(config.max_steps, config.stages, config.init_lr_scale, config.final_lr_scale),
            forward=CtcForward(model),
            speakers=self.speakers,
            cmvn=self.cmvn,
            identity=lambda stored: [stored.get(name) for name in ("encoder", "init", "labelled", "seed", "lr")],
            evaluate=Evaluation(self.score_dev, self.record_dev, self.background_evaluation)
            if len(self.dev_set)
            else None,
            kind=CHECKPOINT_KIND,
        )
        self.selection = Selection.from_dict(config.patience, (resumed or {}).get("selection"))
        self.engine.stopped = self.selection.stopped
        self.engine.keep_steps = frozenset({self.selection.best_step}) - {None}

    def score_dev(self, model: HubertPretrainModel) -> dict[str, Any]:
        """Greedy dev CER of ``model`` (a snapshot of the weights)."""
        return {
            "dev_cer": score(self.dev_set.texts, greedy(log_probabilities(model, self.dev_set, self.job.device))).cer
        }

    def record_dev(self, step: int, scored: Mapping[str, Any] | None) -> dict[str, Any]:
        """Step ``step``'s dev CER into the selection (the training thread's)."""
        engine, selection, cer = self.engine, self.selection, (scored or {})["dev_cer"]
        stop = selection.update(step, cer)
        engine.keep_steps = frozenset({selection.best_step})
        engine.extra["selection"] = selection.to_dict()
        if self.job.is_main:
            stopping = f"; no better for {selection.stale} evaluations: stopping" if stop else ""
            log.info(
                f"step {step}: dev CER {cer:.4f} (best {selection.best_cer:.4f} at step {selection.best_step})"
                f"{stopping}"
            )
        return {"dev_cer": cer, "stop": stop}

    def announce(self) -> None:
        config, speakers = self.config, self.speakers
        frontend = ", front end frozen" if self.freeze_frontend else ""
        log.info(
            f"fine-tuning ({config.init}) with CTC on {len(self.dataset)} labelled utterances "
            f"({sum(self.dataset.seconds) / 60:.1f} min) of {len(speakers['train'])} training speakers; "
            f"{len(self.dev_set)} dev utterances of {len(speakers['dev'])} speakers select the step; "
            f"{len(self.heldout_refs)} held-out utterances of {len(speakers['heldout'])} speakers to score; "
            f"encoder frozen for {self.freeze_steps} steps{frontend}, lr {config.lr:g}, {self.engine.precision}"
        )

    def final(self) -> dict[str, Any]:
        """The dev set's step (kept from pruning) decoded and scored."""
        config, texts, model, selection = self.config, self.texts, self.model, self.selection
        selected = self.step
        if selection.best_step is not None and selection.best_step != self.step:
            selected = selection.best_step
            model.load_state_dict(load_checkpoint(RunFiles(config.run_dir).checkpoint(selected))["model"])
        model.eval()
        sets = {
            "train": self.dataset,
            "dev": self.dev_set,
            "heldout": TranscribedDataset(self.index, self.heldout_refs, self.cmvn, texts["heldout"]),
        }
        log_probs = {
            split: log_probabilities(model, data, self.job.device) for split, data in sets.items() if len(data)
        }
        beam, beam_name, self.beam_choice = None, "", None
        if any(d != "greedy" for d in config.decoders):
            from speech_assets.evaluation.decoding import tuned_beam_decoder

            beam, beam_name, self.beam_choice = tuned_beam_decoder(
                list(texts["train"].values()),
                config.lm_order,
                config.lm_weights,
                config.word_scores,
                log_probs.get("dev", []),
                self.dev_set.texts,
            )
        self.scores = score_rows(sets, log_probs, beam, beam_name)
        return {
            "step": selected,
            "preset": model.preset.to_dict(),
            "clients": {HEAD: VOCAB_SIZE},
            "init": config.init,
            "encoder_checkpoint": config.encoder,
            "encoder_sha256": self.encoder["sha256"],
        }

    def result(self) -> dict[str, Any]:
        config, scores = self.config, self.scores
        held = {r["decoder"]: r for r in scores if r["split"] == "heldout"}
        dev = {r["decoder"]: r for r in scores if r["split"] == "dev"}
        return {
            "steps_trained": self.step,
            "stopped_early": self.engine.stopped,
            "dev_cer": dev.get("greedy", {}).get("cer"),
            "dev_history": self.selection.history,
            "dev_utterances": len(self.dev_set),
            "lr": config.lr,
            "frozen": {"freeze_steps": self.freeze_steps, "freeze_frontend": self.freeze_frontend},
            "text_overlap": self.overlap,
            "oov_rate": oov_rate(self.texts["heldout"], list(self.texts["train"].values())),
            "beam": self.beam_choice,
            "init": config.init,
            "labelled_minutes": config.budget_minutes,
            "seed": config.seed,
            "encoder": config.encoder,
            "encoder_sha256": self.encoder["sha256"],
            "scores": scores,
            "labelled_utterances": len(self.dataset),
            "labelled_seconds": sum(self.dataset.seconds),
            "heldout_utterances": len(self.heldout_refs),
            "speakers": self.speakers,
            "heldout_cer": held.get("greedy", {}).get("cer"),
            "heldout_wer": held.get("greedy", {}).get("wer"),
        }

    def done(self, result: Mapping[str, Any]) -> None:
        log.info(
            "done: %d steps (step %d selected, dev CER %s), loss %s, held-out greedy CER %s WER %s",
            *(result[k] for k in ("steps_trained", "step", "dev_cer", "final_loss", "heldout_cer", "heldout_wer")),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="FinetuneConfig JSON file, or a FinetuneBatch (its runs)")
    path = Path(parser.parse_args(argv).config)
    if "runs" in json.loads(path.read_text(encoding="utf-8")):
        finetune_batch(FinetuneBatch.from_json(path))
    else:
        finetune(FinetuneConfig.from_json(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
