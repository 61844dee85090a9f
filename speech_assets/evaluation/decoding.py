"""Beam search with a word n-gram language model, for CTC log-probabilities over the probe's tokens.

torchaudio's ``ctc_decoder`` (flashlight-text, KenLM inside; pyctcdecode pins numpy < 2), with an ARPA
LM and a lexicon of the labelled training transcripts only: the decoder spells only words seen labelled.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from speech_assets.evaluation.text import ALPHABET
from speech_assets.layout import DecoderFiles

BEAM_DECODER = "beam_{order}gram"  # the decoder column's value, for an LM of this order
BEAM_SIZE = 50
LM_WEIGHT = 1.0
WORD_SCORE = 0.0
DISCOUNT = 0.7  # absolute discounting for every order above the unigrams


def unavailable() -> str | None:
    """Why the beam decoder cannot run here (``None`` when it can)."""
    try:
        import flashlight.lib.text.decoder  # noqa: F401
        from torchaudio.models.decoder import ctc_decoder  # noqa: F401
    except (ImportError, RuntimeError) as error:
        return f"flashlight-text is not installed (pip install flashlight-text): {error}"
    return None


def write_arpa(sentences: Sequence[str], order: int, path: str | os.PathLike[str]) -> None:
    """An ARPA n-gram model of ``sentences``: add-one unigrams, higher orders absolutely discounted
    with back-off weights that make each history's distribution sum to one."""
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    counts = [Counter() for _ in range(order)]  # every n-gram (n = 1..order), with <s> and </s>
    for sentence in sentences:
        words = ["<s>", *sentence.split(), "</s>"]
        for n in range(1, order + 1):
            counts[n - 1].update(zip(*(words[i:] for i in range(n))))
    vocab = sorted({w for (w,) in counts[0]} | {"<unk>"})
    predicted = [w for w in vocab if w != "<s>"]
    total = sum(counts[0][(w,)] for w in predicted) + len(predicted)
    prob: dict[tuple[str, ...], float] = {(w,): (counts[0][(w,)] + 1) / total for w in predicted}
    prob[("<s>",)] = 0.0  # never predicted
    backoff: dict[tuple[str, ...], float] = {}
    for n in range(2, order + 1):
        followers: dict[tuple[str, ...], list[tuple[str, ...]]] = defaultdict(list)
        for gram in counts[n - 1]:
            followers[gram[:-1]].append(gram)
        for history, grams in followers.items():
            seen = sum(counts[n - 1][gram] for gram in grams)
            for gram in grams:
                prob[gram] = (counts[n - 1][gram] - DISCOUNT) / seen
            left = DISCOUNT * len(grams) / seen
            lower = sum(_lower(prob, gram[1:]) for gram in grams)
            backoff[history] = left / max(1e-12, 1.0 - lower)
    lines = ["\\data\\"]
    by_order = [[g for g in prob if len(g) == n] for n in range(1, order + 1)]
    lines += [f"ngram {n}={len(grams)}" for n, grams in enumerate(by_order, start=1)]
    for n, grams in enumerate(by_order, start=1):
        lines += ["", f"\\{n}-grams:"]
        for gram in sorted(grams):
            p = prob[gram]
            entry = f"{math.log10(p) if p > 0 else -99.0:.6f}\t{' '.join(gram)}"
            if n < order:
                entry += f"\t{math.log10(backoff[gram]) if backoff.get(gram, 0) > 0 else 0.0:.6f}"
            lines.append(entry)
    lines += ["", "\\end\\", ""]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


def _lower(prob: dict[tuple[str, ...], float], gram: tuple[str, ...]) -> float:
    """P(gram[-1] | gram[:-1]) of the lower orders as stored (no back-off weight below)."""
    while gram not in prob and len(gram) > 1:
        gram = gram[1:]
    return prob.get(gram, prob.get(("<unk>",), 0.0))


def write_lm_files(train_texts: Sequence[str], order: int, folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ARPA LM and lexicon of ``train_texts`` in ``folder``; returns what rebuilds the decoder."""
    words = sorted({w for text in train_texts for w in text.split()})
    files = DecoderFiles(folder)
    arpa, lexicon = files.lm(order), files.lexicon
    write_arpa(train_texts, order, arpa)
    lexicon.write_text("".join(f"{w} {' '.join(w)} |\n" for w in words), encoding="utf-8")
    return {
        "lm": arpa.name,
        "lexicon": lexicon.name,
        "order": order,
        "words": len(words),
        "beam_size": BEAM_SIZE,
        "lm_weight": LM_WEIGHT,
        "word_score": WORD_SCORE,
        "name": BEAM_DECODER.format(order=order),
    }


def beam_decoder_from_files(
    lm: str | os.PathLike[str],
    lexicon: str | os.PathLike[str],
    beam_size: int = BEAM_SIZE,
    lm_weight: float = LM_WEIGHT,
    word_score: float = WORD_SCORE,
) -> Callable[[Sequence[np.ndarray]], list[str]]:
    """``decode``: ``(L_i, 29)`` log-probabilities to transcripts (both files are read here, not kept open)."""
    import torch
    from torchaudio.models.decoder import ctc_decoder

    # token i of the model: 0 the blank ("-"), then the alphabet with its space as the word boundary ("|")
    tokens = ["-", *("|" if c == " " else c for c in ALPHABET)]
    decoder = ctc_decoder(
        lexicon=str(lexicon),
        tokens=tokens,
        lm=str(lm),
        beam_size=beam_size,
        lm_weight=lm_weight,
        word_score=word_score,
        blank_token="-",
        sil_token="|",
        unk_word="<unk>",
    )

    def decode(log_probs: Sequence[np.ndarray]) -> list[str]:
        found = [decoder(torch.from_numpy(np.ascontiguousarray(lp, dtype=np.float32))[None])[0] for lp in log_probs]
        return [" ".join(hypotheses[0].words) if hypotheses else "" for hypotheses in found]

    return decode


def tuned_beam_decoder(
    train_texts: Sequence[str],
    order: int,
    lm_weights: Sequence[float],
    word_scores: Sequence[float],
    dev_log_probs: Sequence[np.ndarray],
    dev_texts: Sequence[str],
) -> tuple[Callable[[Sequence[np.ndarray]], list[str]], str, dict[str, Any]]:
    """(decode, name, choice): the beam decoder with the ``lm_weights`` x ``word_scores`` pair of the
    lowest dev WER (ties: the first); without dev utterances the defaults, ``dev_wer`` None."""
    import jiwer

    tried: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="ngram-") as folder:
        files = write_lm_files(train_texts, order, folder)
        lm, lexicon = Path(folder) / files["lm"], Path(folder) / files["lexicon"]
        for weight, score in itertools.product(lm_weights, word_scores) if dev_texts else ():
            decode = beam_decoder_from_files(lm, lexicon, lm_weight=weight, word_score=score)
            tried.append([weight, score, float(jiwer.wer(list(dev_texts), decode(dev_log_probs)))])
        weight, score, wer = min(tried, key=lambda row: row[2]) if tried else (LM_WEIGHT, WORD_SCORE, None)
        decode = beam_decoder_from_files(lm, lexicon, lm_weight=weight, word_score=score)
    return decode, files["name"], {"lm_weight": weight, "word_score": score, "dev_wer": wer, "tried": tried}
