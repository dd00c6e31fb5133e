"""Static-shape batches, resumable and sharded across processes, in pure numpy.

Shape letters: B rows of this process's batch, W width (seq_len, or the bucket boundary
of this batch). Padding lives only in masks: padded slots hold id 0 and have segment id 0
(weight 0 for a filler row), so no token id is reserved for padding.

Every epoch is a plan of *rows*, each row a list of examples (CSR: row_ptr, items):
`pad` puts one example in a row, `pack` several (first-fit), `bucket` one, with each
batch's B rows sharing the smallest boundary that fits them. A batch is the next B rows of
the stream of epochs, so the whole iterator state is (epoch, row): plans are rebuilt from
(seed, epoch) on resume instead of being saved. Every process computes the same global
plan and keeps its slice of rows, so n processes together see what one process sees.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hpnlp.data.task import Task, ranges

MODES = ("pad", "bucket", "pack")


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    row_ptr: np.ndarray  # [R + 1] int64; row r holds items[row_ptr[r]:row_ptr[r + 1]]
    items: np.ndarray  # [M] example ids
    row_width: np.ndarray | None = None  # [R] bucket boundary of each row (bucket mode)

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1


def default_boundaries(seq_len: int) -> list[int]:
    """seq_len/4, /2, 3/4 and seq_len, rounded up to multiples of 8 (friendlier shapes)."""
    return sorted({min(seq_len, -(-seq_len * i // 32) * 8) for i in (1, 2, 3)} | {seq_len})


def bucket_boundaries(cfg) -> list[int]:
    b = sorted(set(int(x) for x in cfg.bucket_boundaries)) or default_boundaries(cfg.seq_len)
    if b[0] < 1 or b[-1] > cfg.seq_len:
        from hpnlp.config import ConfigError
        raise ConfigError(f"config field `data.bucket_boundaries` = {tuple(cfg.bucket_boundaries)} "
                          f"is not allowed: every boundary must be in [1, data.seq_len={cfg.seq_len}]")
    return b if b[-1] == cfg.seq_len else b + [cfg.seq_len]


def first_fit(sizes: list[int], capacity: int) -> np.ndarray:
    """Bin of each item under first-fit, bins numbered in the order they open.

    A max-tree over bins' free space finds the first bin that fits in O(log n), so
    packing is O(n log n) instead of first-fit's naive O(n * bins).
    """
    n = len(sizes)
    size = 1 << max(1, (n - 1).bit_length())
    tree = [capacity] * (2 * size)
    out = np.empty(n, np.int64)
    for j, x in enumerate(sizes):
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= x else 2 * i + 1
        out[j] = i - size
        tree[i] -= x
        i >>= 1
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a > b else b
            i >>= 1
    return out


# what each entry of an iterator state's fingerprint comes from, for its error
_STATE_FIELDS = {"task": "data.task", "batching": "data.batching", "batch_size": "train.batch_size",
                 "seq_len": "data.seq_len", "seed": "data.seed",
                 "bucket_boundaries": "data.bucket_boundaries",
                 "num_examples": "examples (data.train_path, data.eval_split, ...)",
                 "digest": "the examples' contents (data.train_path or data.eval_path edited "
                           "since?)",
                 "num_tokens": "tokens (data.prepared, data.train_path, ...)",
                 "prepared": "data.prepared's shards"}


def check_fingerprint(saved: dict, want: dict, task=None) -> None:
    """Refuse an iterator state saved under different data settings (it would resume at
    the wrong place in a different stream), naming the settings (and, for `task` built from
    a user's files, data.eval_path as a cause of other examples)."""
    if not isinstance(saved, dict):
        raise ValueError(f"iterator state {saved!r:.80} is not a dict; pass a dict that "
                         "get_state() returned")
    # "digest": of the examples' contents (a bug hunt: a train_path edited after a stop, its
    # paragraph count kept, resumed at the old position in a different stream);
    # "bucket_boundaries" (a review, r3/r6: other boundaries, another bucket plan). A state
    # saved before either was recorded is checked without it.
    diff = {k: (saved.get(k), v) for k, v in want.items()
            if saved.get(k) != v and (k in saved or k not in ("digest", "bucket_boundaries"))}
    if not diff:
        return
    if not set(saved) & set(want):  # a bug hunt (session 96): an emptied item was named as
        # a stream saved under other settings ("data.task: saved None")
        raise ValueError(f"the checkpoint's data stream state holds none of its settings "
                         f"({saved!r:.80}): that step's data item is damaged; move the step "
                         "aside to resume from the one before")
    fix = ("resume with the run's own data settings and batch size (its config.json), or use "
           "a new --workdir")
    if ("prepared" in saved) != ("prepared" in want):
        was = "a prepared corpus (data.prepared)" if "prepared" in saved else "in-memory data"
        raise ValueError(f"the checkpoint's data stream read {was}, and this config's does not; "
                         + fix)
    lines = "; ".join(f"{_STATE_FIELDS.get(k, k)}: saved {a!r}, now {b!r}"
                      for k, (a, b) in diff.items())
    if {"num_examples", "digest"} & set(diff) and task is not None and isinstance(
            task.meta.get("source"), dict):  # a review (session 115): data.eval_path, which
        # a resume may change, given to a data.train_path run saved without one (or dropped)
        lines += ("; a data.eval_path given or dropped since changes them too: without one, "
                  "the last 10% of data.train_path's lines are held out of training")
    raise ValueError(f"the checkpoint's data stream was saved under other settings ({lines}); "
                     + fix)


def check_position(state: dict, name: str, lo: int, hi: int | None = None) -> int:
    """Field `name` of an iterator state as an int in [lo, hi], or one ValueError naming it
    (a hand-edited or foreign state would otherwise fail deep in numpy at the next batch,
    or resume at a wrong place)."""
    v = state.get(name) if isinstance(state, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (
            hi is not None and v > hi):
        where = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"iterator state field {name!r} = {v!r} is not allowed: it must be an "
                         f"integer {where}; pass a dict that get_state() returned, unedited")
    return int(v)


class BatchIterator:
    """Batches of a Task split: dicts of numpy arrays, same keys and B every step.

    Train is infinite (reshuffled each epoch from the seed and epoch number); eval is one
    pass in a fixed shuffled order, its last batch completed with filler rows. `get_state()`/`set_state()`
    resume exactly; `stats()` reports padding against plain padding of the same examples.
    """

    def __init__(self, task: Task, cfg, *, split: str, batch_size: int,
                 process_index: int = 0, process_count: int = 1):
        from hpnlp.config import ConfigError
        self.check_args(split, cfg.batching, batch_size, process_index, process_count)
        if cfg.batching == "pack" and task.kind != "lm":
            raise ConfigError(f"config field `data.batching` = 'pack' is not allowed for the "
                              f"{task.kind} task {task.name!r}: use 'pad' or 'bucket'")
        if cfg.seq_len != task.seq_len:
            raise ValueError(f"task {task.name!r} was built with seq_len={task.seq_len} but "
                             f"data.seq_len={cfg.seq_len}; rebuild it with make_task(cfg)")
        self._ex = task.train if split == "train" else task.eval
        if len(self._ex) == 0:
            raise ValueError(f"task {task.name!r} has no {split} examples at seq_len={cfg.seq_len}; "
                             "add data (or a longer eval file) or lower data.seq_len")
        self.task, self.split, self.mode = task, split, cfg.batching
        self.batch_size, self.seq_len, self.seed = int(batch_size), cfg.seq_len, cfg.seed
        per = batch_size // process_count
        self._lo, self._hi = process_index * per, (process_index + 1) * per
        lengths = np.minimum(self._ex.lengths, cfg.seq_len + (task.kind == "lm"))
        self._lengths = lengths  # tokens per example (per side for match), truncated
        # Slots an example needs in a row: lm predicts len - 1 targets.
        self._need = lengths - 1 if task.kind == "lm" else (
            lengths.max(1) if lengths.ndim == 2 else lengths)
        self._bounds = np.array(bucket_boundaries(cfg)) if self.mode == "bucket" else None
        self._plans: dict[int, _Plan] = {}
        self._epoch, self._row, self._num_batches = 0, 0, None
        self._counts = dict(batches=0, examples=0, tokens=0, slots=0, pad_slots=0)
        self._widths: set[int] = set()

    @staticmethod
    def check_args(split: str, batching: str, batch_size: int, process_index: int,
                   process_count: int, *, where: str = "") -> None:
        """The checks every iterator over a split makes of its arguments (`where`: what
        the batching mode is refused with, for the message)."""
        from hpnlp.config import ConfigError
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}; choose 'train' or 'eval'")
        if batching not in MODES:
            raise ConfigError(f"config field `data.batching` = {batching!r} is not allowed{where}: "
                              f"choose one of {list(MODES)}")
        if not (isinstance(batch_size, (int, np.integer)) and batch_size > 0):
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        if batch_size % process_count:
            raise ValueError(f"global batch_size={batch_size} must be divisible by "
                             f"process_count={process_count} (each process takes an equal slice)")

    # -- plans --------------------------------------------------------------------------

    def num_rows(self, epoch: int) -> int:
        """Rows in the plan of `epoch` (train) or of the eval pass."""
        return self._plan(epoch).num_rows

    def skip_rows(self, rows: int) -> None:
        """Move `rows` rows ahead in the current epoch without assembling them."""
        if self._row + rows > self._plan(self._epoch).num_rows:
            raise ValueError(f"cannot skip {rows} rows from row {self._row} of a "
                             f"{self._plan(self._epoch).num_rows}-row plan")
        self._row += rows

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self._ex)
        if self.split == "eval":
            # A fixed permutation, the same for every seed: examples are stored grouped by
            # chapter/section, so with `train.eval_batches` an in-order prefix would measure
            # one section only; a shuffled prefix is a fair sample.
            return np.random.default_rng(20260101).permutation(n)
        return np.random.default_rng([self.seed % 2**32, epoch, 0]).permutation(n)

    def _plan(self, epoch: int) -> _Plan:
        if epoch not in self._plans:
            if len(self._plans) > 1:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = getattr(self, f"_plan_{self.mode}")(epoch, self._order(epoch))
        return self._plans[epoch]

    def _plan_pad(self, epoch, order):
        return _Plan(np.arange(len(order) + 1), order)

    def _plan_pack(self, epoch, order):
        """First-fit in shuffled order. A full-length chunk always opens a new bin and
        never shares it, so only partial chunks go through the tree; rows are then ordered
        by their first item, which reproduces first-fit's bin order exactly."""
        need = self._need[order]
        full = need == self.seq_len
        part = np.flatnonzero(~full)
        bins = np.empty(len(order), np.int64)
        bins[full] = np.arange(full.sum())
        bins[part] = full.sum() + first_fit(need[part].tolist(), self.seq_len)
        first_seen = np.full(bins.max() + 1, len(order))
        np.minimum.at(first_seen, bins, np.arange(len(order)))
        rank = np.argsort(np.argsort(first_seen, kind="stable"), kind="stable")
        row = rank[bins]
        by_row = np.lexsort((np.arange(len(order)), row))
        return _Plan(np.concatenate([[0], np.cumsum(np.bincount(row))]), order[by_row])

    def _plan_bucket(self, epoch, order):
        """Group by bucket; a bucket's leftover (< B examples) moves up to the next bucket,
        where it still fits. Train completes the last leftover by repeating examples of the
        epoch and shuffles batch order; eval fills it with empty rows and shuffles batch
        order with a fixed seed."""
        B, bounds = self.batch_size, self._bounds
        bucket = np.searchsorted(bounds, self._need[order], side="left")
        batches, widths, carry = [], [], np.zeros(0, np.int64)
        for b in range(len(bounds)):
            pool = np.concatenate([carry, order[bucket == b]])
            k = len(pool) // B
            batches += list(pool[:k * B].reshape(k, B))
            widths += [bounds[b]] * k
            carry = pool[k * B:]
        if len(carry):
            fill = (np.resize(order, B - len(carry)) if self.split == "train"
                    else np.full(B - len(carry), -1))
            batches.append(np.concatenate([carry, fill]))
            widths.append(bounds[-1])
        # Shuffle batch order; eval with a fixed seed, so an `eval_batches` prefix mixes
        # all bucket widths instead of measuring only the shortest examples.
        key = [self.seed % 2**32, epoch, 1] if self.split == "train" else [20260101, 1]
        idx = np.random.default_rng(key).permutation(len(batches))
        ids = np.stack(batches)[idx].ravel()
        real = ids >= 0
        row_ptr = np.concatenate([[0], np.cumsum(real)])
        return _Plan(row_ptr, ids[real], np.repeat(np.array(widths)[idx], B))

    # -- iteration ----------------------------------------------------------------------

    @property
    def num_batches(self) -> int:
        """Eval: batches in the pass. Train: batches per epoch (pack: of epoch 0)."""
        if self._num_batches is None:
            plan = self._plans.get(0) or getattr(self, f"_plan_{self.mode}")(0, self._order(0))
            self._num_batches = math.ceil(plan.num_rows / self.batch_size)
        return self._num_batches

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        B = self.batch_size
        plan = self._plan(self._epoch)
        if self.split == "eval" and self._row >= plan.num_rows:
            raise StopIteration
        # The global batch: B consecutive rows of the epoch stream; rows missing at the end
        # of the eval pass become filler rows (no items).
        pieces, need, width = [], B, self.seq_len
        if self.mode == "bucket":
            width = int(plan.row_width[self._row])
        while need:
            plan = self._plan(self._epoch)
            take = min(need, plan.num_rows - self._row)
            pieces.append((plan, self._row, self._row + take))
            self._row += take
            need -= take
            if self._row == plan.num_rows:
                if self.split == "eval":
                    break
                self._epoch, self._row = self._epoch + 1, 0
        counts = np.concatenate([np.diff(p.row_ptr[a:b + 1]) for p, a, b in pieces] +
                                [np.zeros(need, np.int64)])
        items = np.concatenate([p.items[p.row_ptr[a]:p.row_ptr[b]] for p, a, b in pieces])
        self._count(items, counts, width)
        first = np.cumsum(counts) - counts
        lo, hi = first[self._lo], first[self._hi - 1] + counts[self._hi - 1]
        return self._assemble(items[lo:hi], counts[self._lo:self._hi], width)

    def _count(self, items, counts, width):
        sides = 2 if self.task.kind == "match" else 1
        c = self._counts
        c["batches"] += 1
        c["examples"] += len(items)
        c["tokens"] += int((self._lengths[items] - (self.task.kind == "lm")).sum())
        c["slots"] += int((counts > 0).sum()) * width * sides
        c["pad_slots"] += len(items) * self.seq_len * sides
        self._widths.add(width)

    def _assemble(self, items, counts, width) -> dict[str, np.ndarray]:
        """Scatter the items of B rows into [B, W] arrays with a few vectorized ops."""
        ex, kind, B = self._ex, self.task.kind, len(counts)
        row = np.repeat(np.arange(B), counts)
        if kind == "lm":
            row_first = np.repeat(np.cumsum(counts) - counts, counts)  # row's first item
            seg = np.arange(len(items)) - row_first  # 0-based document number in its row
            n = self._need[items]
            ends = np.cumsum(n)
            offset = ends - n - np.concatenate([[0], ends])[row_first]
            out = {k: np.zeros((B, width), np.int32)
                   for k in ("inputs", "targets", "segment_ids", "positions")}
            self._scatter(out, "", row, offset, ex.starts[items], n, seg + 1, targets=True)
            return out
        label = np.zeros(B, np.int32)
        weight = np.zeros(B, np.float32)
        label[row] = ex.labels[items]
        weight[row] = 1.0
        out = {"label": label, "weight": weight}
        if kind == "classify":
            out.update({k: np.zeros((B, width), np.int32) for k in ("inputs", "segment_ids")})
            self._scatter(out, "", row, 0, ex.starts[items], self._lengths[items], 1)
        else:
            index = np.full(B, -1, np.int32)  # the pair's example number (mined negatives)
            index[row] = items
            out["index"] = index
            for side in (0, 1):
                sfx = str(side + 1)
                out.update({k + sfx: np.zeros((B, width), np.int32) for k in ("inputs", "segment_ids")})
                self._scatter(out, sfx, row, 0, ex.starts[items, side],
                              self._lengths[items, side], 1)
        return out

    def _scatter(self, out, sfx, row, offset, starts, n, seg, targets=False):
        """Write n[i] tokens from starts[i] into row[i] at column offset[i]."""
        within = ranges(np.zeros_like(n), n)
        r = np.repeat(row, n)
        col = np.repeat(np.broadcast_to(offset, n.shape), n) + within
        src = np.repeat(starts, n) + within
        out["inputs" + sfx][r, col] = self._ex.tokens[src]
        out["segment_ids" + sfx][r, col] = np.repeat(np.broadcast_to(seg, n.shape), n)
        if targets:
            out["targets"][r, col] = self._ex.tokens[src + 1]
            out["positions"][r, col] = within

    # -- state and stats ----------------------------------------------------------------

    def _fingerprint(self) -> dict:
        bounds = {} if self._bounds is None else {
            "bucket_boundaries": [int(b) for b in self._bounds]}  # they shape the bucket plan
        return {"task": self.task.name, "split": self.split, "batching": self.mode,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "seed": self.seed,
                **bounds, "num_examples": len(self._ex), "digest": self._ex.digest}

    def get_state(self) -> dict:
        """Small and JSON-serializable: where the stream is, plus what it must match. The
        position is in rows of the global stream, the same on every process, so it resumes
        under any process count."""
        return {"epoch": self._epoch, "row": self._row, **self._fingerprint()}

    def set_state(self, state: dict) -> None:
        check_fingerprint(state, self._fingerprint(), self.task)
        epoch = check_position(state, "epoch", 0, None if self.split == "train" else 0)
        row = check_position(state, "row", 0, self.num_rows(epoch))
        if self.split == "train" and row == self.num_rows(epoch):
            # the end of a train epoch is the next one's start, as __next__ and pad/pack
            # take it; bucket read the width of row num_rows first and failed in numpy
            # (a review, session 107)
            epoch, row = epoch + 1, 0
        if self.mode == "bucket" and row % self.batch_size:
            # a bucket batch is B rows of one width: from another row it would mix two
            # buckets' rows, and fail in numpy at a wider one (review r2)
            raise ValueError(f"iterator state field 'row' = {row} is not allowed: bucket "
                             f"batches start at multiples of batch_size={self.batch_size}; "
                             "pass a dict that get_state() returned, unedited")
        self._row, self._epoch = row, epoch

    def stats(self) -> dict:
        """Padding so far (all processes' rows): `padding_fraction` of this mode, and
        `pad_mode_padding_fraction` that plain padding to seq_len would have had on the
        same examples. Filler rows of the last eval batch are not counted. Counted since
        this iterator was made: the counts are not part of get_state()."""
        c = self._counts
        frac = (lambda slots: 1.0 - c["tokens"] / slots if slots else 0.0)
        return {"batching": self.mode, "batches": c["batches"], "examples": c["examples"],
                "tokens": c["tokens"], "padding_fraction": frac(c["slots"]),
                "pad_mode_padding_fraction": frac(c["pad_slots"]),
                "widths": sorted(self._widths), "epoch": self._epoch}
