"""The `Task` every data source produces, and the helpers all of them share.

A split is stored as one flat int32 token array plus per-example (start, length) offsets,
not as a list of small arrays: the batcher then gathers a whole batch with one fancy
index, and a 100K-example split costs three arrays instead of 100K Python objects.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

KINDS = ("lm", "classify", "match")


@dataclasses.dataclass(frozen=True, eq=False)
class Examples:
    """One split. Example i is `tokens[starts[i] : starts[i] + lengths[i]]`.

    classify: starts/lengths [N]; match: [N, 2] (the two sides of a pair);
    lm: [N], each a chunk of at most seq_len + 1 tokens of one document, so that
    inputs = chunk[:-1] and targets = chunk[1:]. `labels` is [N] int32, None for lm.
    """

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @functools.cached_property
    def digest(self) -> str:
        """A hash of the split's contents (tokens, offsets, labels; ~30 ms for the shipped
        corpus): a resume refuses a stream whose text changed though its count did not."""
        h = hashlib.blake2b(digest_size=8)
        for a in (self.tokens, self.starts, self.lengths, self.labels):
            if a is not None:
                h.update(np.ascontiguousarray(a).data)
        return h.hexdigest()

    def example(self, i: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Token ids of example i (a pair for match); for inspection and tests."""
        if self.starts.ndim == 2:
            return tuple(self.tokens[s:s + n] for s, n in zip(self.starts[i], self.lengths[i]))
        s, n = int(self.starts[i]), int(self.lengths[i])
        return self.tokens[s:s + n]


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A built data set: both splits, what a model needs to size itself, and baselines.

    `baseline` is what a model must beat to have learned anything: classify/match
    `{"majority_accuracy"}` (majority class of train, scored on eval); lm
    `{"unigram_loss", "unigram_ppl"}` (add-one-smoothed train unigram, nats per eval
    target token). `token_counts` [vocab_size] are train counts per id, for frequency-aware
    samplers and `model.embed_grad_scale = "corpus"`. `meta` holds task-specific facts (class names, source).
    """

    name: str
    kind: str
    vocab_size: int
    num_classes: int
    seq_len: int
    train: Examples
    eval: Examples
    baseline: Mapping[str, float]
    token_counts: np.ndarray | None = None
    encode: Callable[[str], np.ndarray] | None = dataclasses.field(default=None, repr=False)
    decode: Callable[[Sequence[int]], str] | None = dataclasses.field(default=None, repr=False)
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Task.kind={self.kind!r}; choose one of {KINDS}")


def checked_ids(ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """`ids` as one row of int64, each in [0, vocab_size), else one ValueError naming them and
    the range: what every `Task.decode` reads (numpy or a tuple would read -1 as the last
    entry and 1.7 as 1, silently; found by the crash hunt, and in review r2 for words,
    ListOps and bytes)."""
    a = np.asarray(ids if hasattr(ids, "__array__") else list(ids))
    if a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.min() < 0
                                   or a.max() >= vocab_size)):
        bad = a if a.ndim != 1 or a.dtype.kind not in "iu" else a[(a < 0) | (a >= vocab_size)]
        raise ValueError(f"token ids {np.ravel(bad)[:4].tolist()} (shape {a.shape}, "
                         f"{a.dtype}): give one row of integer ids in [0, {vocab_size})")
    return a.astype(np.int64)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    starts = np.asarray(starts, np.int64).ravel()
    lengths = np.asarray(lengths, np.int64).ravel()
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def concat(docs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents -> (flat int32 tokens, doc starts, doc lengths)."""
    lengths = np.array([len(d) for d in docs], np.int64)
    tokens = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
    return tokens, np.cumsum(lengths) - lengths, lengths


def lm_chunks(docs: Sequence[np.ndarray], seq_len: int) -> Examples:
    """Cut documents into chunks of at most seq_len + 1 tokens that overlap by one token.

    The overlap makes every token after a document's first the target of exactly one
    chunk, so no transition is lost at a chunk edge and none is counted twice.
    """
    tokens, doc_starts, doc_lens = concat(docs)
    per_doc = np.maximum(doc_lens - 1 + seq_len - 1, 0) // seq_len  # ceil((n - 1) / L)
    doc_of = np.repeat(np.arange(len(doc_lens)), per_doc)
    first = np.cumsum(per_doc) - per_doc
    j = np.arange(len(doc_of)) - np.repeat(first, per_doc)
    starts = doc_starts[doc_of] + j * seq_len
    lengths = np.minimum(seq_len + 1, doc_starts[doc_of] + doc_lens[doc_of] - starts)
    return Examples(tokens, starts.astype(np.int64), lengths.astype(np.int64))


def lm_targets(ex: Examples) -> np.ndarray:
    """Every target token of an lm split (each chunk's tokens after its first)."""
    return ex.tokens[ranges(ex.starts + 1, ex.lengths - 1)]


def unigram_baseline(train_counts: np.ndarray, eval_ex: Examples) -> dict[str, float]:
    """Cross-entropy of an add-one-smoothed unigram model fit on train, on eval targets."""
    counts = np.asarray(train_counts, np.float64)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + len(counts))
    targets = lm_targets(eval_ex)
    loss = float(-logp[targets].mean()) if len(targets) else float("nan")
    return {"unigram_loss": loss, "unigram_ppl": float(math.exp(loss))}


def majority_baseline(train_labels: np.ndarray, eval_labels: np.ndarray,
                      num_classes: int) -> dict[str, float]:
    """Accuracy on eval of always answering train's most frequent class."""
    top = int(np.argmax(np.bincount(train_labels, minlength=num_classes)))
    acc = float(np.mean(eval_labels == top)) if len(eval_labels) else float("nan")
    return {"majority_accuracy": acc, "majority_class": top}
