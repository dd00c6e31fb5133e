"""Stream batches for segment recurrence (Transformer-XL): `data.batching = "stream"`.

The split becomes one stream of (input, target) pairs: every LM chunk's pairs, in storage
order, so consecutive chunks of a document join up and each target of the split appears
exactly once (the same targets the other batchings score; a document's last token is
followed by the next document's first *input*, never predicted across). The stream is cut
into B contiguous rows ("batchify" in the authors' code) and batch t is columns
[t*W, (t+1)*W) of every row: row b of batch t continues row b of batch t-1, so a model can
carry per-row memory from one batch to the next.

Shape letters: B rows of this process's batch, W width (data.seq_len).

Train is infinite: epoch e starts the stream at a random offset in [0, W) (from the seed
and e), so segment edges move between epochs, and drops the < B leftover pairs. Eval is
one pass over every pair: rows are ceil(N / B) long and the last rows' tails are padding
(segment id 0). A train epoch's rows are S = (N - offset) // B pairs long, and its last
batch's columns past S are padding too when W does not divide S. The iterator state is
(epoch, batch).
"""

from __future__ import annotations

import math

import numpy as np

from hpnlp.data.batching import check_fingerprint, check_position
from hpnlp.data.task import Task, ranges


class StreamIterator:
    """Same interface as batching.BatchIterator (next, get_state/set_state, stats,
    num_batches); batch keys: inputs, targets, segment_ids (1, or 0 for padding),
    positions (the column in the row's stream) [B, W]."""

    def __init__(self, task: Task, cfg, *, split: str, batch_size: int,
                 process_index: int = 0, process_count: int = 1):
        from hpnlp.config import ConfigError
        if task.kind != "lm":
            raise ConfigError(f"config field `data.batching` = 'stream' is not allowed for the "
                              f"{task.kind} task {task.name!r}: use 'pad' or 'bucket'")
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}; choose 'train' or 'eval'")
        if cfg.seq_len != task.seq_len:
            raise ValueError(f"task {task.name!r} was built with seq_len={task.seq_len} but "
                             f"data.seq_len={cfg.seq_len}; rebuild it with make_task(cfg)")
        if not (isinstance(batch_size, (int, np.integer)) and batch_size > 0):
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if not 0 <= process_index < process_count or batch_size % process_count:
            raise ValueError(f"process {process_index} of {process_count} cannot take an equal "
                             f"slice of batch_size={batch_size}")
        ex = task.train if split == "train" else task.eval
        pairs = ranges(ex.starts, np.maximum(ex.lengths - 1, 0))
        self._inputs, self._targets = ex.tokens[pairs], ex.tokens[pairs + 1]
        n = len(self._inputs)
        if n < batch_size:  # a bug hunt: the error named no config field
            field = ("data.eval_batch_size" if split == "eval"
                     and getattr(cfg, "eval_batch_size", 0) else "train.batch_size")
            raise ConfigError(f"config field `{field}` = {batch_size} is not allowed: the {split} "
                              f"stream of task {task.name!r} has {n} tokens, fewer than its "
                              f"{batch_size} rows; lower it")
        self.task, self.split, self.seed, self._ex = task, split, cfg.seed, ex
        self.batch_size, self.seq_len = int(batch_size), cfg.seq_len
        per = batch_size // process_count
        self._lo, self._hi = process_index * per, (process_index + 1) * per
        self._epoch, self._batch = 0, 0
        self._counts = dict(batches=0, tokens=0, slots=0)

    def _layout(self, epoch: int) -> tuple[int, int, np.ndarray]:
        """(offset, row length S, real pairs per row [B]) of an epoch."""
        n, B = len(self._inputs), self.batch_size
        if self.split == "eval":
            S = -(-n // B)
            return 0, S, np.clip(n - S * np.arange(B), 0, S)
        offset = int(np.random.default_rng([self.seed % 2**32, epoch, 2]).integers(
            min(self.seq_len, n - B + 1)))
        S = (n - offset) // B
        return offset, S, np.full(B, S)

    @property
    def num_batches(self) -> int:
        """Batches per epoch (train: of epoch 0) or in the eval pass."""
        return math.ceil(self._layout(0)[1] / self.seq_len)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        offset, S, real_B = self._layout(self._epoch)
        per_epoch = math.ceil(S / self.seq_len)
        if self._batch >= per_epoch:
            if self.split == "eval":
                raise StopIteration
            self._epoch, self._batch = self._epoch + 1, 0
            offset, S, real_B = self._layout(self._epoch)
        W = self.seq_len
        col_W = self._batch * W + np.arange(W)
        real_BW = col_W[None, :] < real_B[:, None]
        self._batch += 1
        c = self._counts
        c["batches"] += 1
        c["tokens"] += int(real_BW.sum())
        c["slots"] += real_BW.size
        rows = slice(self._lo, self._hi)
        real_BW = real_BW[rows]
        idx_BW = offset + S * np.arange(self.batch_size)[rows, None] + col_W[None, :]
        idx_BW = np.where(real_BW, idx_BW, 0)
        zero = np.zeros(real_BW.shape, np.int32)
        return {"inputs": np.where(real_BW, self._inputs[idx_BW], zero).astype(np.int32),
                "targets": np.where(real_BW, self._targets[idx_BW], zero).astype(np.int32),
                "segment_ids": real_BW.astype(np.int32),
                "positions": np.where(real_BW, np.broadcast_to(col_W, real_BW.shape), zero).astype(np.int32)}

    def _fingerprint(self) -> dict:
        return {"task": self.task.name, "split": self.split, "batching": "stream",
                "batch_size": self.batch_size, "seq_len": self.seq_len, "seed": self.seed,
                "num_tokens": len(self._inputs),
                # a review (session 103): as BatchIterator's, so a train_path edited after a
                # stop, its count unchanged, is refused rather than resumed in other text
                "digest": self._ex.digest}

    def get_state(self) -> dict:
        """Small and JSON-serializable; positions are in global rows, so it resumes under
        any process count. A model's memory is not here: it belongs to the train state."""
        return {"epoch": self._epoch, "batch": self._batch, **self._fingerprint()}

    def set_state(self, state: dict) -> None:
        check_fingerprint(state, self._fingerprint(), self.task)
        epoch = check_position(state, "epoch", 0, None if self.split == "train" else 0)
        S = self._layout(epoch)[1]
        self._batch = check_position(state, "batch", 0, math.ceil(S / self.seq_len))
        self._epoch = epoch

    def stats(self) -> dict:
        c = self._counts
        return {"batching": "stream", "batches": c["batches"], "tokens": c["tokens"],
                "padding_fraction": 1.0 - c["tokens"] / c["slots"] if c["slots"] else 0.0,
                "widths": [self.seq_len], "epoch": self._epoch}
