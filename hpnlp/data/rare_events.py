"""`verse_book`: the book (of 66) a verse comes from, where most books are rare in training.

A rare-event task for the key-value memory (Kaiser et al. 2017, hpnlp.retrieval.memory),
cut from the shipped corpus. Train verses come from the train chapters (corpus.kjv_splits):
the FREQUENT_BOOKS books with the most train verses keep FREQUENT_CAP verses each; every
other book is *rare* and keeps RARE_MIN..RARE_MAX verses (the count and the verses drawn
with data.seed). Eval verses come from the held-out chapters (every 10th chapter), at most
EVAL_PER_BOOK per book (drawn with the seed), so a rare book weighs as much as a frequent one
in `accuracy`; the 19 books with no held-out chapter (Ruth, Obadiah, the short epistles, ...)
have no eval verses. `meta` names the rare and frequent classes and counts each class's
train and eval verses, for reports that split accuracy by them (hpnlp.bench.kv_memory).

Tokens are words with the word_lm vocabulary (data.word_vocab_size most frequent words of
all train chapters): the text is plentiful, only the labels are rare. Batches are the
classify kind (inputs, segment_ids [B, L]; label, weight [B]); verses longer than
data.seq_len words are cut.
"""

from __future__ import annotations

import numpy as np

from hpnlp.data import corpus
from hpnlp.data import task as task_lib
from hpnlp.data import text_tasks

BOOKS = tuple(book for _, books in corpus.SECTIONS for book in books)  # class i = BOOKS[i]
FREQUENT_BOOKS = 10  # books kept frequent: those with the most train verses
FREQUENT_CAP = 300  # train verses each frequent book keeps
RARE_MIN, RARE_MAX = 2, 5  # train verses each rare book keeps (inclusive range)
EVAL_PER_BOOK = 20  # eval verses per book, at most


def _verses(chapters):
    """(verse texts, book index of each) of `chapters`, in canonical order."""
    book_of = {b: i for i, b in enumerate(BOOKS)}
    texts, books = [], []
    for c in chapters:
        lines = c.text.splitlines()
        texts += lines
        books += [book_of[c.book]] * len(lines)
    return texts, np.asarray(books, np.int32)


def split_counts(train_books: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(frequent classes, train verses kept per class [66]) for the available train verses
    per book; deterministic in `seed`."""
    have = np.bincount(train_books, minlength=len(BOOKS))
    frequent = np.sort(np.argsort(-have, kind="stable")[:FREQUENT_BOOKS])
    rng = np.random.default_rng([seed % 2**32, 23])
    keep = rng.integers(RARE_MIN, RARE_MAX + 1, len(BOOKS))
    keep[frequent] = FREQUENT_CAP
    return frequent, np.minimum(keep, have)


def _sample(books: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of `keep[b]` verses of each book b (drawn without replacement), in
    canonical order."""
    picked = [rng.choice(np.flatnonzero(books == b), int(n), replace=False)
              for b, n in enumerate(keep) if n]
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, np.int64)


def make_task(cfg, name: str) -> task_lib.Task:
    text_tasks.refuse_user_files(cfg, name)
    text_tasks._check_word_vocab(cfg)
    train_ch, eval_ch = corpus.kjv_splits(cfg.eval_split)
    vocab = text_tasks.WordVocab.build([text_tasks.word_tokens(c.text) for c in train_ch],
                                       cfg.word_vocab_size)  # word_lm's vocabulary
    rng = np.random.default_rng([cfg.seed % 2**32, 24])
    train_text, train_books = _verses(train_ch)
    eval_text, eval_books = _verses(eval_ch)
    frequent, keep = split_counts(train_books, cfg.seed)
    tr = _sample(train_books, keep, rng)
    ev_keep = np.minimum(np.bincount(eval_books, minlength=len(BOOKS)), EVAL_PER_BOOK)
    # only books it trains on (a review, session 115: under eval_split='validation' 2 John's
    # one chapter is held out, and its 13 verses were eval examples no model could get right)
    ev_keep[keep == 0] = 0
    ev = _sample(eval_books, ev_keep, rng)

    def examples(texts, books, idx):
        docs = [vocab.encode(texts[i]) for i in idx]
        tokens, starts, lengths = task_lib.concat(docs)
        return task_lib.Examples(tokens, starts, lengths, books[idx].astype(np.int32))

    train, eval_ = examples(train_text, train_books, tr), examples(eval_text, eval_books, ev)
    rare = np.setdiff1d(np.arange(len(BOOKS)), frequent)
    return task_lib.Task(
        name=name, kind="classify", vocab_size=len(vocab.words), num_classes=len(BOOKS),
        seq_len=cfg.seq_len, train=train, eval=eval_,
        baseline=task_lib.majority_baseline(train.labels, eval_.labels, len(BOOKS)),
        token_counts=np.bincount(train.tokens, minlength=len(vocab.words)).astype(np.int64),
        encode=vocab.encode, decode=vocab.decode,
        meta={"source": "King James Bible (shipped)", "class_names": BOOKS,
              "train_counts": np.bincount(train.labels, minlength=len(BOOKS)),
              "eval_counts": np.bincount(eval_.labels, minlength=len(BOOKS)),
              "frequent_classes": tuple(int(c) for c in frequent),
              "rare_classes": tuple(int(c) for c in rare), "words": vocab.words})


def info(cfg, name: str) -> dict:
    text_tasks._check_word_vocab(cfg)
    return {"kind": "classify", "num_classes": len(BOOKS),
            "vocab_size": min(cfg.word_vocab_size, text_tasks.kjv_train_words(cfg) + 2)}
