"""Tasks cut from text: byte, word and subword (data.tokenizer) language modelling, and byte-level document
classification and matching over the shipped corpus (sections: corpus.SECTIONS).

Byte ids are byte values (vocab 256) so any UTF-8 text encodes with no vocabulary to
build or ship. Word ids are sorted by descending train frequency (id 0 = most frequent)
so that log-uniform (Zipfian) samplers of sampled-softmax methods can use them as is.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Iterable, Sequence

import numpy as np

from hpnlp.data import corpus
from hpnlp.data import task as task_lib
from hpnlp.data import tokenizers

EOS, UNK = "<eos>", "<unk>"
# Lower-cased words (letters and digits), "'s" split off as in the Penn Treebank, every
# other non-space character its own token, and each line end an <eos> (in the corpus, the
# end of a verse). Lower-casing merges sentence-initial forms, which matters more in a
# 900K-token corpus than the LORD / Lord distinction it loses.
WORD_RE = re.compile(r"\n|'s\b|[^\W_]+|[^\w\s]|_")
# Distinct words in the corpus' train chapters under WORD_RE: lets `info` give word_lm's
# exact vocab size without reading the corpus (tests check it against make_task).
KJV_TRAIN_WORDS = 12_070
KJV_VALIDATION_TRAIN_WORDS = 11_427  # the same, of the training chapters data.eval_split='validation' keeps
DOC_TAIL_FRACTION = 4  # keep a chapter's last partial window if >= seq_len / 4 bytes


def kjv_train_words(cfg) -> int:
    """Distinct words of the training chapters `cfg` (a DataConfig) trains on."""
    return KJV_VALIDATION_TRAIN_WORDS if cfg.eval_split == "validation" else KJV_TRAIN_WORDS


def byte_encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def byte_decode(ids: Iterable[int]) -> str:
    return task_lib.checked_ids(ids, 256).astype(np.uint8).tobytes().decode(
        "utf-8", errors="replace")


def word_tokens(text: str) -> list[str]:
    return [EOS if t == "\n" else t for t in WORD_RE.findall(text.lower())]


@dataclasses.dataclass(frozen=True, eq=False)
class WordVocab:
    words: tuple[str, ...]  # id -> word, by descending train count (ties: alphabetical)
    counts: np.ndarray  # [V] int64 train count per id; <unk> counts the words cut off

    @classmethod
    def build(cls, docs: Sequence[list[str]], size: int) -> "WordVocab":
        counter = collections.Counter(t for doc in docs for t in doc)
        eos = counter.pop(EOS, 0)
        by_freq = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
        kept = by_freq[:size - 2]
        unk = sum(c for _, c in by_freq[size - 2:])
        entries = sorted(kept + [(EOS, eos), (UNK, unk)], key=lambda kv: (-kv[1], kv[0]))
        return cls(tuple(w for w, _ in entries), np.array([c for _, c in entries], np.int64))

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.words)}

    def ids(self, tokens: list[str]) -> np.ndarray:
        index, unk = self.index, self.index[UNK]
        return np.array([index.get(t, unk) for t in tokens], np.int32)

    def encode(self, text: str) -> np.ndarray:
        """Text -> ids; each "\\n" becomes <eos>, unknown words <unk>."""
        return self.ids(word_tokens(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> words joined by spaces, each <eos> a line end, the last one too (lossy:
        case and spacing)."""
        lines, cur = [], []
        for i in task_lib.checked_ids(ids, len(self.words)).tolist():
            w = self.words[i]
            if w == EOS:
                lines.append(" ".join(cur))
                cur = []
            else:
                cur.append(w)
        # a review (session 114): a last <eos> was dropped ("a\n" decoded as "a")
        return "".join(line + "\n" for line in lines) + " ".join(cur)


def _lm_documents(cfg) -> tuple[list[str], list[str], object]:
    if cfg.train_path or cfg.eval_path:
        return corpus.user_lm_documents(cfg)
    train, eval_ = corpus.kjv_splits(cfg.eval_split)
    return [c.text for c in train], [c.text for c in eval_], "King James Bible (shipped)"


def _check_word_vocab(cfg) -> None:
    if cfg.word_vocab_size < 3:
        from hpnlp.config import ConfigError
        raise ConfigError(f"config field `data.word_vocab_size` = {cfg.word_vocab_size} is not "
                          "allowed: need >= 3 (<unk>, <eos> and at least one word)")


def lm_tokenizer(cfg, name: str) -> str:
    """The tokenizer an LM task runs with: data.tokenizer, or the task's own."""
    return cfg.tokenizer or {"byte_lm": "bytes", "word_lm": "words"}[name]


def make_lm_task(cfg, name: str, *, tokenizer_dir: str | None = None,
                 save_tokenizer: bool = True) -> task_lib.Task:
    """`tokenizer_dir`: where a subword tokenizer is kept (WORKDIR/tokenizer): loaded from
    there if present, else trained on the training split and saved there (`save_tokenizer`)."""
    train_docs, eval_docs, source = _lm_documents(cfg)
    kind = lm_tokenizer(cfg, name)
    if kind == "bytes":
        train_ids = [byte_encode(d) for d in train_docs]
        eval_ids = [byte_encode(d) for d in eval_docs]
        vocab_size, encode, decode, extra = 256, byte_encode, byte_decode, {}
    elif kind in tokenizers.SUBWORD:
        tok, how = tokenizers.for_run(cfg, train_docs, tokenizer_dir, save=save_tokenizer)
        train_ids, eval_ids = tok.encode_many(train_docs), tok.encode_many(eval_docs)
        vocab_size, encode, decode = tok.vocab_size, tok.encode, tok.decode
        extra = {"tokenizer": {**tok.describe(), "source": how}, "eos_id": tok.newline_id}
    else:
        _check_word_vocab(cfg)
        train_tok = [word_tokens(d) for d in train_docs]
        vocab = WordVocab.build(train_tok, cfg.word_vocab_size)
        train_ids = [vocab.ids(t) for t in train_tok]
        eval_ids = [vocab.encode(d) for d in eval_docs]
        # the model's size (`info`): a user file with fewer distinct words than
        # data.word_vocab_size leaves the last output rows unused (their counts zero)
        vocab_size = max(len(vocab.words), info(cfg, name)["vocab_size"])
        encode, decode = vocab.encode, vocab.decode
        extra = {"words": vocab.words, "eos_id": vocab.index[EOS], "unk_id": vocab.index[UNK]}
    train = task_lib.lm_chunks(train_ids, cfg.seq_len)
    eval_ = task_lib.lm_chunks(eval_ids, cfg.seq_len)
    counts = np.bincount(train.tokens, minlength=vocab_size).astype(np.int64)
    return task_lib.Task(
        name=name, kind="lm", vocab_size=vocab_size, num_classes=0, seq_len=cfg.seq_len,
        train=train, eval=eval_, baseline=task_lib.unigram_baseline(counts, eval_),
        token_counts=counts, encode=encode, decode=decode,
        meta={"source": source, "train_documents": len(train_docs),
              "eval_documents": len(eval_docs), **extra})


def _windows(chapters: list[corpus.Chapter], seq_len: int):
    """Non-overlapping windows of seq_len bytes of each chapter -> Examples, chapter of each.

    A chapter's last partial window is kept when it is at least seq_len / 4 bytes, or when
    it is the chapter's only window, so short chapters (Psalm 117) still take part.
    """
    tokens, doc_starts, n = task_lib.concat([byte_encode(c.text) for c in chapters])
    full, tail = n // seq_len, n % seq_len
    count = full + ((tail >= max(1, seq_len // DOC_TAIL_FRACTION)) | (full == 0))
    doc_of = np.repeat(np.arange(len(n)), count)
    j = np.arange(len(doc_of)) - np.repeat(np.cumsum(count) - count, count)
    starts = doc_starts[doc_of] + j * seq_len
    lengths = np.minimum(seq_len, doc_starts[doc_of] + n[doc_of] - starts)
    section = np.array([c.section for c in chapters], np.int32)[doc_of]
    chapter = np.array([c.index for c in chapters], np.int32)[doc_of]
    return tokens, starts, lengths, section, chapter


def _pairs(section: np.ndarray, chapter: np.ndarray, rng: np.random.Generator):
    """Balanced pairs over windows: each window once as the left side; label 1 (same
    section) for even positions, 0 otherwise. Positives avoid pairing a window with its
    own chapter, which would make matching trivial, whenever the section allows it."""
    n, k = len(section), len(corpus.SECTIONS)
    left = rng.permutation(n)
    label = (np.arange(n) % 2 == 0).astype(np.int32)
    order = np.argsort(section, kind="stable")
    size = np.bincount(section, minlength=k)
    first = np.cumsum(size) - size

    def draw(groups):
        return order[first[groups] + (rng.random(len(groups)) * size[groups]).astype(np.int64)]

    g = section[left]
    right = draw(g)
    for _ in range(10):
        same = (label == 1) & (chapter[right] == chapter[left])
        if not same.any():
            break
        right[same] = draw(g[same])
    present = np.flatnonzero(size)
    neg = np.flatnonzero(label == 0)
    other = present[None, :] != g[neg, None]  # sections a negative may come from
    pick = (rng.random(len(neg)) * other.sum(1)).astype(np.int64)
    g_neg = present[np.argmax(np.cumsum(other, 1) > pick[:, None], axis=1)]
    right[neg] = draw(g_neg)
    return left, right, label


def refuse_user_files(cfg, name: str) -> None:
    """A task built from the shipped corpus refuses `data.train_path` / `data.eval_path`,
    naming the one given (a review, session 118: an eval_path alone was named as
    `data.train_path` = '')."""
    if cfg.train_path or cfg.eval_path:
        from hpnlp.config import ConfigError
        field = "train_path" if cfg.train_path else "eval_path"
        raise ConfigError(f"config field `data.{field}` = {getattr(cfg, field)!r} is not allowed "
                          f"for data.task={name!r}: it is built from the shipped corpus; user "
                          "files work with 'listops', 'byte_lm' and 'word_lm'")


def make_doc_task(cfg, name: str) -> task_lib.Task:
    refuse_user_files(cfg, name)
    splits, chapters = [], {}
    for split, chaps in zip(("train", "eval"), corpus.kjv_splits(cfg.eval_split)):
        tokens, starts, lengths, section, chapter = _windows(chaps, cfg.seq_len)
        if name == "doc_classify":
            splits.append(task_lib.Examples(tokens, starts, lengths, section))
            chapters[f"{split}_chapters"] = chapter
        else:
            rng = np.random.default_rng([cfg.seed % 2**32, 1 if split == "train" else 2])
            left, right, label = _pairs(section, chapter, rng)
            pair = np.stack([left, right], 1)
            splits.append(task_lib.Examples(tokens, starts[pair], lengths[pair], label))
            chapters[f"{split}_chapters"] = chapter[pair]
            chapters[f"{split}_sections"] = section[pair]
    num_classes = len(corpus.SECTIONS) if name == "doc_classify" else 2
    names = corpus.SECTION_NAMES if name == "doc_classify" else ("different", "same")
    return task_lib.Task(
        name=name, kind="classify" if name == "doc_classify" else "match", vocab_size=256,
        num_classes=num_classes, seq_len=cfg.seq_len, train=splits[0], eval=splits[1],
        baseline=task_lib.majority_baseline(splits[0].labels, splits[1].labels, num_classes),
        token_counts=np.bincount(splits[0].tokens, minlength=256).astype(np.int64),
        encode=byte_encode, decode=byte_decode,
        meta={"source": "King James Bible (shipped)", "class_names": names, **chapters})


def make_pairs_task(cfg, name: str) -> task_lib.Task:
    """`verse_pairs`: each chapter's verses taken two by two, (1, 2), (3, 4), ..., as the two
    sides of a matching pair (a verse and the one after it share speaker, topic and names), for
    the bi-encoder (hpnlp.models.bi_encoder). Every pair is a positive (label 1); a chapter's
    odd last verse is left out. Eval pairs come from the held-out chapters, so retrieval is
    measured against a pool of text no model trained on."""
    refuse_user_files(cfg, name)
    splits, meta = [], {}
    for split, chaps in zip(("train", "eval"), corpus.kjv_splits(cfg.eval_split)):
        verses, chapter = [], []
        for c in chaps:
            lines = c.text.split("\n")[:-1]
            even = len(lines) // 2 * 2
            verses += lines[:even]
            chapter += [c.index] * (even // 2)
        tokens, starts, lengths = task_lib.concat([byte_encode(v) for v in verses])
        pairs = len(verses) // 2
        splits.append(task_lib.Examples(tokens, starts.reshape(pairs, 2), lengths.reshape(pairs, 2),
                                        np.ones(pairs, np.int32)))
        meta[f"{split}_chapters"] = np.array(chapter, np.int32)
    counts = np.bincount(splits[0].tokens, minlength=256).astype(np.int64)
    return task_lib.Task(
        name=name, kind="match", vocab_size=256, num_classes=2, seq_len=cfg.seq_len,
        train=splits[0], eval=splits[1], baseline={"random_recall_at_1": 1.0 / len(splits[1])},
        token_counts=counts, encode=byte_encode, decode=byte_decode,
        meta={"source": "King James Bible (shipped)", "class_names": ("different", "same"),
              "positives_only": True, **meta})


def info(cfg, name: str) -> dict:
    if name == "verse_pairs":
        return {"kind": "match", "vocab_size": 256, "num_classes": 2, "positives_only": True}
    if name in ("doc_classify", "doc_match"):
        return {"kind": "classify" if name == "doc_classify" else "match", "vocab_size": 256,
                "num_classes": len(corpus.SECTIONS) if name == "doc_classify" else 2}
    kind = lm_tokenizer(cfg, name)
    if kind == "bytes":  # byte values, not ranked by frequency
        return {"kind": "lm", "vocab_size": 256, "num_classes": 0, "frequency_sorted": False}
    if kind in tokenizers.SUBWORD:
        if cfg.vocab_size < 1:
            from hpnlp.config import ConfigError
            raise ConfigError(f"config field `data.vocab_size` = {cfg.vocab_size} is not allowed: "
                              "a subword tokenizer needs a positive number of pieces (8K-64K is usual)")
        return {"kind": "lm", "vocab_size": int(cfg.vocab_size), "num_classes": 0,
                "frequency_sorted": True}
    _check_word_vocab(cfg)
    # A user file's vocabulary is unknown until read: the configured size is an upper
    # bound (the model may have a few unused output rows), which is all validation needs.
    size = cfg.word_vocab_size if cfg.train_path else min(cfg.word_vocab_size, kjv_train_words(cfg) + 2)
    return {"kind": "lm", "vocab_size": size, "num_classes": 0, "frequency_sorted": True}
