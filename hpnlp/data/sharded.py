"""LM tasks that stream a prepared corpus from disk through grain: `data.prepared = DIR`.

`python -m hpnlp.data.prepare` (data/prepare.py) writes DIR: ArrayRecord shards of
tokenized documents (one record per document, little-endian uint8/uint16/int32 ids),
`meta.json`, the train token counts and the tokenizer. Nothing here holds the corpus in
memory: the training split is read as a grain pipeline

    MapDataset.source(ArrayRecordDataSource(shards)).map(decode)
        .shuffle(seed).repeat()            # train: document order reshuffled every epoch
        .to_iter_dataset(ReadOptions)      # background reader threads, prefetched

and cut into *windows* of documents (about `WINDOW_BATCHES` batches of tokens each). A
window becomes a small in-memory split that the in-memory path's own `BatchIterator`
batches (pad, bucket or pack, chunks shuffled within the window; the same row assembly and
the same per-process slicing), so both paths share the batching logic and process p of n
keeps rows [p*B/n, (p+1)*B/n) of every global batch: the processes' rows are disjoint and
together are the single-process stream, at any process count. (Every process reads the
window's documents, already tokenized, and assembles only its own rows.) Train keeps whole
batches only: under pad and pack a window's last < B rows are dropped (under 1% of a window);
under bucket none are, and its last batch is completed with repeats of up to B - 1 of the
window's chunks (the first in its shuffled order, trained twice), as in memory. Eval is one
pass over the documents in a fixed shuffled order (the same for every seed, so that a prefix,
`train.eval_batches`, is a fair sample of a corpus stored file by file), every chunk scored
once.

The iterator state is (window, batch within it, grain's reader state at the window's
start): small JSON that goes into the Orbax checkpoint with the rest of the run, and a
resumed run rereads that window and continues at the exact next batch. The state also holds
a digest of the split's shards (the sha256 that prepare recorded for each, their sizes and
first and last 64 KiB): a folder prepared again since is refused, and so is a shard replaced
by one of another size or other ends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import numpy as np

from hpnlp.data import task as task_lib
from hpnlp.data.batching import (BatchIterator, bucket_boundaries, check_fingerprint,
                                  check_position)

FORMAT = "hpnlp-prepared/1"
META_FILE = "meta.json"
COUNTS_FILE = "counts-train.npy"  # [V] int64 train token counts
EVAL_TARGET_COUNTS_FILE = "counts-eval-targets.npy"  # [V]: eval tokens after each doc's first
WINDOW_BATCHES = 128
EVAL_READ_MB = 64  # an eval split up to this size is read whole when a run starts
READ_THREADS = 2
EVAL_ORDER_SEED = 20260101  # the eval pass's document shuffle, the same for every data.seed
# The document order a state was saved under (`get_state`'s "order"): "mixed" draws grain's
# shuffle seed from data.seed (a bug hunt, session 100: grain shuffles epoch e by seed + e, so
# seed s + 1's epoch e was seed s's epoch e + 1); a state without it resumes in the order it
# was saved under, grain's seed data.seed (train) and the stored order (eval).
ORDER = "mixed"
DIGEST_SAMPLE = 64 << 10  # bytes read from each end of a shard for the state's digest


def ids_dtype(vocab_size: int) -> str:
    """The dtype of a prepared folder's shard records (little-endian)."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "int32"


def _error(field: str, value, why: str):
    from hpnlp.config import ConfigError
    return ConfigError(f"config field `{field}` = {value!r} is not allowed: {why}")


def read_meta(directory: str) -> dict:
    """meta.json of a complete prepared folder, or a ConfigError naming data.prepared."""
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path) and os.path.isfile(os.path.join(directory, "progress.json")):
        raise _error("data.prepared", directory, "the folder is still being prepared (or its "
                     "preparation was interrupted); rerun the same `python -m hpnlp.data.prepare` "
                     "command, which resumes it")
    if not os.path.isfile(path):
        raise _error("data.prepared", directory, f"{path} does not exist; write the folder with "
                     "`python -m hpnlp.data.prepare --input FILE --out DIR` first")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _error("data.prepared", directory, f"{path} is unreadable ({e}); prepare it again")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _error("data.prepared", directory, f"{path} has format {got!r}, "
                     f"this hpnlp reads {FORMAT!r}; prepare it again")
    if (problem := _meta_problem(meta)) is not None:
        raise _error("data.prepared", directory, f"{path}: {problem} (edited by hand?); "
                     "prepare the folder again")
    return meta


def _meta_problem(meta: dict) -> str | None:
    """What in a meta.json the readers would trip over (a bare KeyError, or numpy's and
    grain's errors), or None."""
    tok = meta.get("tokenizer")
    if not (isinstance(tok, dict) and isinstance(tok.get("kind"), str)
            and isinstance(tok.get("vocab_size"), int) and tok["vocab_size"] > 0):
        return "`tokenizer` must give a `kind` and a positive `vocab_size`"
    if meta.get("dtype") not in ("uint8", "uint16", "int32"):
        return f"`dtype` = {meta.get('dtype')!r} is not uint8, uint16 or int32"
    if meta["dtype"] != (want := ids_dtype(tok["vocab_size"])):  # a bug hunt (session 96):
        # numpy's "buffer size must be a multiple of element size" at the first batch
        return (f"`dtype` = {meta['dtype']!r}, but the shards of a vocabulary of "
                f"{tok['vocab_size']} hold {want} ids")
    splits = meta.get("splits")
    for split in ("train", "eval"):
        sp = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(sp, dict):
            return f"`splits` has no `{split}` split"
        shards = sp.get("shards")
        if not (isinstance(shards, list) and shards and all(isinstance(x, str) for x in shards)):
            return f"`splits.{split}.shards` must list its shard files"
        for field in ("documents", "tokens"):
            if not (isinstance(sp.get(field), int) and sp[field] >= 0):
                return f"`splits.{split}.{field}` must be a count"
        sha = sp.get("sha256", shards)  # absent in a folder prepared before it was recorded
        if not (isinstance(sha, list) and len(sha) == len(shards)
                and all(isinstance(x, str) for x in sha)):
            return f"`splits.{split}.sha256` must list one digest per shard"
    return None


def _check_tokenizer(cfg, name: str, meta: dict) -> None:
    from hpnlp.data.text_tasks import lm_tokenizer
    kind, tok = lm_tokenizer(cfg, name), meta["tokenizer"]
    want_size = cfg.vocab_size if kind in ("bpe", "unigram") else tok["vocab_size"]
    if kind != tok["kind"] or want_size != tok["vocab_size"]:
        made = f"a {tok['kind']} tokenizer" + (f" of {tok['vocab_size']} pieces" if tok["kind"] != "bytes" else "")
        asked = kind + (f" of {cfg.vocab_size} pieces (data.vocab_size)" if kind in ("bpe", "unigram") else "")
        raise _error("data.tokenizer", cfg.tokenizer or kind,
                     f"{cfg.prepared} was prepared with {made} and this config asks "
                     f"for {asked}; set data.tokenizer={tok['kind']!r}"
                     + (f" data.vocab_size={tok['vocab_size']}" if tok["kind"] != "bytes" else "")
                     + ", or prepare the corpus again with the tokenizer you want")


def info(cfg, name: str) -> dict:
    meta = read_meta(cfg.prepared)
    _check_tokenizer(cfg, name, meta)
    return {"kind": "lm", "vocab_size": int(meta["tokenizer"]["vocab_size"]), "num_classes": 0,
            "frequency_sorted": meta["tokenizer"]["kind"] != "bytes"}


def load_tokenizer(directory: str, meta: dict):
    """(encode, decode, tokenizer or None) of a prepared folder."""
    from hpnlp.data import text_tasks, tokenizers
    if meta["tokenizer"]["kind"] == "bytes":
        return text_tasks.byte_encode, text_tasks.byte_decode, None
    tok = tokenizers.Subword.load(os.path.join(directory, tokenizers.DIRNAME),
                                  fix=f"the shards were encoded with it: {AGAIN}")
    return tok.encode, tok.decode, tok


def make_task(cfg, name: str, *, workdir: str | None = None) -> task_lib.Task:
    """The task of a prepared folder: sizes, counts and baselines from its files; both
    splits stay on disk (`train`/`eval` are empty; ShardedIterator reads them)."""
    meta = read_meta(cfg.prepared)
    _check_tokenizer(cfg, name, meta)
    counts, eval_counts, (encode, decode, tok) = check_prepared(cfg.prepared, meta)
    V = int(meta["tokenizer"]["vocab_size"])
    logp = np.log(counts + 1.0) - np.log(counts.sum() + V)
    n_eval = eval_counts.sum()
    loss = float(-(eval_counts * logp).sum() / n_eval) if n_eval else float("nan")
    if tok is not None and workdir:  # the run keeps its tokenizer beside its checkpoints
        from hpnlp.data import tokenizers
        kept = os.path.join(workdir, tokenizers.DIRNAME)
        if not os.path.isdir(kept):
            import jax
            if jax.process_index() == 0:
                tok.save(kept)
        else:
            _check_kept_tokenizer(cfg, kept, tok)
    empty = task_lib.Examples(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
    return task_lib.Task(
        name=name, kind="lm", vocab_size=V, num_classes=0, seq_len=cfg.seq_len, train=empty,
        eval=empty, baseline={"unigram_loss": loss, "unigram_ppl": float(math.exp(loss))},
        token_counts=counts.astype(np.int64), encode=encode, decode=decode,
        meta={"source": f"prepared corpus {cfg.prepared}", "prepared": cfg.prepared,
              "prepared_meta": meta, "tokenizer": meta["tokenizer"],
              "train_documents": meta["splits"]["train"]["documents"],
              "eval_documents": meta["splits"]["eval"]["documents"]})


def _check_kept_tokenizer(cfg, kept: str, tok) -> None:
    """A tokenizer folder already in the workdir must be `tok`, the prepared folder's (a
    resume's own). A bug hunt (session 98): one left by another run was kept, the run trained
    with the prepared folder's, and its resume was refused with advice to prepare the corpus
    again with the other one. (A resume whose folder holds another one now is refused before
    this, by `data.check_prepared_of_run`.)"""
    from hpnlp.data import tokenizers
    fix = f"move {kept} aside, or use a new workdir"
    theirs = tokenizers.Subword.load(kept, fix=fix)
    if theirs.model_proto != tok.model_proto or not np.array_equal(theirs.order, tok.order):
        sha = (theirs.describe()["model_sha256"], tok.describe()["model_sha256"])
        raise _error("data.prepared", cfg.prepared,
                     f"{kept} holds a {theirs.kind} tokenizer of {theirs.vocab_size} pieces "
                     f"(sha256 {sha[0][:12]}...), not the one this folder's shards were encoded "
                     f"with (sha256 {sha[1][:12]}...), which the run would train with (a folder "
                     f"left by another run?); {fix}")


# What each message about a damaged folder advises: rerunning the prepare command alone
# answers that the folder is damaged (a bug hunt, session 96: "already prepared")
AGAIN = "delete the folder and prepare the corpus again"


def check_prepared(directory: str, meta: dict):
    """(train counts, eval target counts, `load_tokenizer`'s) of a prepared folder whose
    shards `check_shards` found sound; ValueErrors name the damaged file."""
    check_shards(directory, meta)
    counts = tuple(_load_counts(directory, f, meta["tokenizer"]["vocab_size"])
                   for f in (COUNTS_FILE, EVAL_TARGET_COUNTS_FILE))
    return (*counts, load_tokenizer(directory, meta))


def _load_counts(directory: str, name: str, V: int) -> np.ndarray:
    path = os.path.join(directory, name)
    try:
        counts = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({e}); the prepared folder is incomplete: "
                         f"{AGAIN}") from None
    if counts.shape != (V,) or counts.dtype.kind not in "iu":  # a bug hunt (session 96):
        # numpy's "operands could not be broadcast together" in the unigram baseline
        raise ValueError(f"{path}: holds {counts.dtype} counts of shape {list(counts.shape)}, "
                         f"not one count per id of the vocabulary ([{V}]): {AGAIN}")
    return counts


def _shard_error(path: str, e: RuntimeError) -> ValueError:
    detail = str(e).strip().split("\n")[0][:160] or "RuntimeError"
    return ValueError(f"{path}: cannot be read ({detail}); the shard is damaged or truncated: "
                      f"{AGAIN}")


def check_shards(directory: str, meta: dict) -> None:
    """ValueError naming the first shard of either split that is missing or cannot be opened
    (a truncated file), or an eval shard with a damaged record where the eval split is at
    most EVAL_READ_MB: found before any step trains, not at the first eval after them."""
    for split in ("train", "eval"):
        paths = [os.path.join(directory, name) for name in meta["splits"][split]["shards"]]
        # a bug hunt (session 96): a damaged record, met at the final eval
        _check_paths(paths, read_all_mb=EVAL_READ_MB if split == "eval" else 0)


def _check_paths(paths: list[str], *, read_all_mb: int = 0) -> None:
    """ValueError naming the first of `paths` that is missing, then the first that cannot be
    opened (or, where they hold at most `read_all_mb` MiB, read whole)."""
    from array_record.python import array_record_module as ar
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: shard listed in {os.path.dirname(path)}/{META_FILE} is "
                             f"missing; {AGAIN}") from None
    read_all = read_all_mb > 0 and sum(map(os.path.getsize, paths)) <= read_all_mb << 20
    for path in paths:
        try:
            reader = ar.ArrayRecordReader(path)
            if read_all:
                reader.read_all()
            reader.close()
        except RuntimeError as e:
            raise _shard_error(path, e) from None


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (prepare records one per shard in meta.json)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def split_digest(directory: str, meta: dict, split: str) -> str:
    """A digest of a split's contents for an iterator state: per shard its name, size, the
    sha256 prepare recorded, and its first and last DIGEST_SAMPLE bytes (a bug hunt, session
    100: the state held the first shard's name and the token count, so a resume trained on a
    folder prepared again from an edited text, or with a shard copied over another of its size,
    silently). Contents, not times: a folder copied whole keeps its digest."""
    h = hashlib.sha256()
    sp = meta["splits"][split]
    for name, sha in zip(sp["shards"], sp.get("sha256", [None] * len(sp["shards"]))):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(DIGEST_SAMPLE)
                f.seek(max(size - DIGEST_SAMPLE, len(head)))
                tail = f.read()
        except OSError as e:
            raise ValueError(f"{path}: cannot be read ({e.strerror or e}); {AGAIN}") from None
        h.update(json.dumps([name, size, sha]).encode())
        h.update(hashlib.sha256(head + tail).digest())
    return h.hexdigest()[:16]


def decode_record(record: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(record, np.dtype(dtype).newbyteorder("<")).astype(np.int32)


def split_dataset(directory: str, meta: dict, split: str):
    """The documents of a split as a grain MapDataset of int32 id arrays (its shards checked
    by `check_shards` when the task was made)."""
    import grain
    shards = [os.path.join(directory, s) for s in meta["splits"][split]["shards"]]
    dtype = meta["dtype"]
    return grain.MapDataset.source(_named_source(grain)(shards)).map(
        lambda r: decode_record(r, dtype))


def _named_source(grain):
    """grain's ArrayRecordDataSource whose damaged record is a ValueError naming its shard
    (a bug hunt, session 96: "Corrupted Riegeli/records file" under a 47-line traceback
    that named no file)."""

    class NamedSource(grain.sources.ArrayRecordDataSource):
        def __init__(self, paths: list[str], *args, **kwargs):
            # a bug hunt (session 98): a shard moved or deleted after the run started failed at
            # the next eval as array_record's "open() failed" under a 50-line traceback
            try:
                super().__init__(paths, *args, **kwargs)
            except RuntimeError as e:
                _check_paths(paths)  # the shard that fails (array_record's error names none)
                raise _shard_error(f"a shard in {os.path.dirname(paths[0])}", e) from None

        def _shard(self, key) -> str:
            try:  # array_record's own lookup of the record's shard
                return str(self.paths[self._reader_idx_and_position(key)[0]])
            except Exception:  # noqa: BLE001 (a later array_record: name them all)
                return f"a shard in {os.path.dirname(str(self.paths[0]))}"

        def _checked(self, key, record: bytes) -> bytes:
            # prepare writes no empty record: one is a shard truncated after the run opened
            # it, which array_record reads as b"" past the cut (a bug hunt, session 101: a
            # run trained on to its end on empty documents, exit 0)
            if not len(record):
                raise _shard_error(self._shard(key), RuntimeError(
                    f"record {int(key)} is empty; the file changed after the run opened it"))
            return record

        def __getitem__(self, key):
            try:
                return self._checked(key, super().__getitem__(key))
            except RuntimeError as e:
                raise _shard_error(self._shard(key), e) from None

        def __getitems__(self, keys):
            try:
                records = super().__getitems__(keys)
            except RuntimeError:  # the failing record's own shard named (review: the first
                return [self[k] for k in keys]  # key's, which may lie in another)
            return [self._checked(k, r) for k, r in zip(keys, records)]
    return NamedSource


class ShardedIterator:
    """Same interface as batching.BatchIterator (next, get_state/set_state, stats,
    num_batches) over a prepared folder's split; batch keys of an lm task."""

    def __init__(self, task: task_lib.Task, cfg, *, split: str, batch_size: int,
                 process_index: int = 0, process_count: int = 1):
        BatchIterator.check_args(split, cfg.batching, batch_size, process_index, process_count,
                                 where=" with data.prepared")
        meta = task.meta["prepared_meta"]
        self.directory, self.meta = task.meta["prepared"], meta
        self.task, self.cfg, self.split = task, cfg, split
        self.batch_size, self.seq_len, self.seed = int(batch_size), cfg.seq_len, cfg.seed
        self.iter_args = dict(process_index=process_index, process_count=process_count)
        if meta["splits"][split]["documents"] == 0:
            raise ValueError(f"{self.directory} has no {split} documents; prepare it with some "
                             f"{split} text (--eval_input or --eval_every)")
        if meta["splits"][split]["tokens"] <= meta["splits"][split]["documents"]:
            # found by a bug hunt: a bare StopIteration (train) or a crash after training (eval)
            raise ValueError(f"{self.directory}: every {split} document is one token, so the "
                             f"{split} split has no token to predict; prepare it with longer "
                             "documents")
        self._order, self._digest = ORDER, None
        self._reader = self._make_reader(ORDER)
        # A window holds about WINDOW_BATCHES global batches of tokens.
        self._window_tokens = WINDOW_BATCHES * self.batch_size * self.seq_len
        self._window, self._inner, self._inner_batches, self._batch = -1, None, 0, 0
        self._window_state = None
        self._counts = dict(batches=0, examples=0, tokens=0, slots=0, pad_slots=0)
        self._widths: set[int] = set()
        self._done = False

    def _make_reader(self, order: str | None):
        """grain's reader over the split's documents in `order` (ORDER, or None: that of a
        state saved before ORDER)."""
        import grain
        ds = split_dataset(self.directory, self.meta, self.split)
        if self.split == "train":
            seed = self.seed % 2**32 if order is None else int(
                np.random.default_rng([self.seed % 2**32, 5]).integers(2**31))
            ds = ds.shuffle(seed=seed).repeat()
        elif order is not None:
            # a bug hunt (session 100): in stored order, train.eval_batches scored the first
            # input file's documents only (the in-memory eval shuffles so too, batching.py)
            ds = ds.shuffle(seed=EVAL_ORDER_SEED)
        return iter(ds.to_iter_dataset(grain.ReadOptions(
            num_threads=READ_THREADS, prefetch_buffer_size=64)))

    def _read_window(self) -> list[np.ndarray]:
        docs, n = [], 0
        while n < self._window_tokens:
            try:
                d = next(self._reader)
            except StopIteration:
                break
            docs.append(d)
            n += len(d)
        return docs

    def _open_window(self, window: int) -> bool:
        """Read window `window` from the reader's current position; False at the end of
        the eval pass."""
        while True:
            self._window_state = self._reader.get_state()
            docs = self._read_window()
            chunks = task_lib.lm_chunks(docs, self.seq_len)
            self._window, self._batch = window, 0
            if not docs:
                self._inner = None
                return False
            if len(chunks):
                break
            # a window of one-token documents only (no chunk): the next one (found by a bug
            # hunt: it ended the stream, so an eval pass scored none of the targets after it)
            window += 1
        for _ in range(64):
            self._inner, self._inner_batches = self._batches_of(chunks, window)
            if self._inner_batches or self.split == "eval":
                return True
            # train: fewer rows than one batch (a window of mostly one-token documents):
            # the window reads on until it has a batch (found in review: it had stopped training
            # with "lower the batch size"); a resume replays the same reads from its start
            docs += self._read_window()
            chunks = task_lib.lm_chunks(docs, self.seq_len)
        raise ValueError(f"{self.directory}: {64 * self._window_tokens} tokens of the train split "
                         f"hold fewer than batch_size={self.batch_size} rows; lower the batch "
                         "size, or prepare longer documents")

    def _batches_of(self, chunks, window: int):
        """(BatchIterator over a window's chunks, its batches: eval's all, train's whole)."""
        sub = task_lib.Task(name=f"{self.task.name}[window {window}]", kind="lm",
                            vocab_size=self.task.vocab_size, num_classes=0, seq_len=self.seq_len,
                            train=chunks, eval=chunks, baseline={})
        # Each window its own chunk shuffle; a fixed function of the seed and window number.
        wcfg = dataclasses.replace(self.cfg, seed=int(np.random.default_rng(
            [self.seed % 2**32, window, 3]).integers(2**31)))
        inner = BatchIterator(sub, wcfg, split=self.split, batch_size=self.batch_size,
                              **self.iter_args)
        return inner, (inner.num_batches if self.split == "eval"
                       else inner.num_rows(0) // self.batch_size)

    @property
    def num_batches(self) -> int:
        """Eval: batches in the pass (estimated from the token count before a pass is read
        whole). Train: global batches per epoch, estimated the same way."""
        tokens = self.meta["splits"][self.split]["tokens"]
        return max(1, math.ceil(tokens / (self.seq_len * self.batch_size)))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._done:
            raise StopIteration
        if self._inner is None or self._batch >= self._inner_batches:
            if not self._open_window(self._window + 1):
                self._done = True
                raise StopIteration
        before = dict(self._inner._counts)
        batch = next(self._inner)
        self._batch += 1
        for k, v in self._inner._counts.items():
            self._counts[k] += v - before[k]
        self._widths |= self._inner._widths
        return batch

    def _fingerprint(self) -> dict:
        if self._digest is None:  # read once, when a state is first taken or checked
            self._digest = split_digest(self.directory, self.meta, self.split)
        bounds = {"bucket_boundaries": bucket_boundaries(self.cfg)} if (
            self.cfg.batching == "bucket") else {}  # they shape each window's bucket plan
        return {"task": self.task.name, "split": self.split, "batching": self.cfg.batching,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "seed": self.seed,
                **bounds, "prepared": self.meta["splits"][self.split]["shards"][:1],
                "num_tokens": self.meta["splits"][self.split]["tokens"],
                "digest": self._digest}

    def get_state(self) -> dict:
        """The window, the batches taken from it and grain's reader state at its start
        (JSON; the same on every process, so it resumes under any process count)."""
        order = {} if self._order is None else {"order": self._order}
        return {"window": self._window, "batch": self._batch, "reader": self._window_state,
                **order, **self._fingerprint()}

    def set_state(self, state: dict) -> None:
        want = self._fingerprint()
        # the other settings first (named as ever); a state saved before the digest has none
        check_fingerprint({k: v for k, v in state.items() if k != "digest"}
                          if isinstance(state, dict) else state, want)
        if "digest" in state and state["digest"] != want["digest"]:
            raise ValueError(f"the checkpoint's data stream was saved under other settings "
                             f"({self.directory}'s {self.split} shards: saved "
                             f"{state['digest']!r}, now {want['digest']!r}: the folder was "
                             "prepared again, or a shard replaced, since); resume with the "
                             "folder the run trained from, or use a new --workdir")
        window = check_position(state, "window", -1)
        if window < 0:  # saved before the first batch
            return
        if state.get("order") not in (None, ORDER):
            raise ValueError(f"iterator state field 'order' = {state['order']!r:.80} is not "
                             f"allowed: it must be {ORDER!r} or absent; pass a dict that "
                             "get_state() returned, unedited")
        if state.get("order") is None:  # saved before ORDER: resumed in its own order
            self._order = None
            self._reader = self._make_reader(None)
        reader = state.get("reader")
        at = reader.get("next_index") if isinstance(reader, dict) else None
        # checked here as check_position does: grain took True as 1 (a silent resume at
        # another document), 2.5 until a prefetch thread failed on it, and -1 (or one past an
        # eval split's end) with a bare IndexError (a review, session 107)
        ok = isinstance(at, (int, np.integer)) and not isinstance(at, bool) and at >= 0
        try:
            if ok:
                self._reader.set_state(reader)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            ok = False
        if not ok:
            raise ValueError(f"iterator state field 'reader' = {reader!r:.80} is not grain's "
                             "reader state (a dict whose 'next_index' is an integer >= 0, a "
                             "position in the split); pass a dict that get_state() returned, "
                             "unedited")
        if not self._open_window(window):  # saved at the end of the eval pass
            check_position(state, "batch", 0, 0)
            self._done = True
            return
        self._batch = check_position(state, "batch", 0, self._inner_batches)
        # an eval window's last batch may be partial (found in review: its state failed)
        self._inner.skip_rows(min(self._batch * self.batch_size, self._inner.num_rows(0)))

    def stats(self) -> dict:
        c = self._counts
        frac = (lambda slots: 1.0 - c["tokens"] / slots if slots else 0.0)
        return {"batching": self.cfg.batching, "batches": c["batches"], "examples": c["examples"],
                "tokens": c["tokens"], "padding_fraction": frac(c["slots"]),
                "pad_mode_padding_fraction": frac(c["pad_slots"]),
                "widths": sorted(self._widths), "window": self._window, "prepared": self.directory}
