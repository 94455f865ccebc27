"""Answer scoring as in SQuAD and Search-R1: normalise, then exact match or token F1.

Normalisation (the SQuAD v1.1 evaluation script's, which Search-R1's `qa_em.py` reuses):
lowercase, drop ASCII punctuation, drop the articles "a", "an", "the", collapse whitespace.
Both scores take the best match over the gold answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation, articles and extra whitespace: " The  Quellor!" -> "quellor"."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(g) for g in golds) else 0.0


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:  # SQuAD: an empty side scores 1 only if both are empty
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: Iterable[str]) -> float:
    """Best token-level F1 (bag of normalised words) over the gold answers; 0.0 if there are none."""
    return max((_f1(prediction, g) for g in golds), default=0.0)
