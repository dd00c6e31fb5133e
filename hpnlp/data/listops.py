"""ListOps (Nangia & Bowman 2018) as in Long Range Arena (Tay et al. 2021, `listops.py`).

An example is a prefix expression such as `[MAX 2 9 [MIN 4 7 ] 0 ]`; the label is its
value (10 classes). Operators MAX, MIN, MED (median, truncated to an integer as LRA's
`int(np.median(...))` does) and SM (sum mod 10), values 0-9, nesting up to
`listops_max_depth`, 2 to `listops_max_args` arguments per operator.

Why not LRA's generator verbatim: it draws trees from a branching process and rejects
those outside [min_length, max_length]; three in four trees are a single digit and long
ranges are rare, so most draws are wasted. Here the length T is drawn first (uniform
over the achievable lengths in range) and the tree is grown top-down with an exact token
budget. Tables of which sizes a subtree at each depth can have (computed once by
convolution) make every choice feasible, so nothing is rejected. Within a budget, each
argument is a leaf with LRA's probability 0.75 where the budget allows it, operators and
values are uniform, and the arity is uniform over the feasible ones.

Token ids: 0 pad, 1-10 digits 0-9, then `[MIN [MAX [MED [SM ]`. LRA's TSV files also
wrap every argument in `( ... )`; those parentheses are redundant in prefix notation with
an explicit `]`, would roughly double the length, and LRA's own pipeline drops them (its
tokenizer keeps alphanumerics only), so the loader drops them too.
"""

from __future__ import annotations

import bisect
import itertools
import math
import pathlib
import random
import warnings

import numpy as np

from hpnlp.data import task as task_lib
from hpnlp.data.corpus import read_bytes_of_text

OPS = ("[MIN", "[MAX", "[MED", "[SM")
VOCAB = ("<pad>",) + tuple("0123456789") + OPS + ("]",)
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
END = TOKEN_ID["]"]
OP0 = TOKEN_ID["[MIN"]  # ids OP0..OP0+3 are MIN, MAX, MED, SM
LEAF_P = 0.75  # LRA's VALUE_P = 0.25 chance that an argument is itself an operator
NUM_CLASSES = 10


def encode(text: str) -> np.ndarray:
    """Whitespace-separated ListOps tokens -> ids (parentheses dropped, see module doc)."""
    ids = []
    for tok in text.split():
        if tok in ("(", ")"):
            continue
        if tok not in TOKEN_ID or tok == "<pad>":
            raise ValueError(f"unknown ListOps token {tok!r}; tokens are {VOCAB[1:] + ('(', ')')}")
        ids.append(TOKEN_ID[tok])
    return np.array(ids, np.int32)


def decode(ids) -> str:
    """Ids -> whitespace-separated tokens, padding (id 0) left out."""
    return " ".join(VOCAB[i] for i in task_lib.checked_ids(ids, len(VOCAB)).tolist() if i != 0)


def _median(vals: list[int]) -> int:
    s, n = sorted(vals), len(vals)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


def _sum_mod(vals: list[int]) -> int:
    return sum(vals) % 10


_APPLY = (min, max, _median, _sum_mod)


def apply_op(op: int, vals: list[int]) -> int:
    """op is 0..3 for MIN, MAX, MED, SM; MED truncates like LRA's int(np.median(x))."""
    return _APPLY[op](vals)


# ---------------------------------------------------------------------------------------
# Generator


def _bool_conv(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """{i + j : a[i] and b[j]} truncated to [0, n): a subset-sum step, by FFT."""
    size = 1 << (2 * n).bit_length()
    out = np.fft.irfft(np.fft.rfft(a, size) * np.fft.rfft(b, size), size)[:n]
    return out > 0.5


class _SizeTables:
    """Which token counts a subtree rooted at depth d can have, up to max_length.

    ach[d][s]: a subtree at depth d can have s tokens (a leaf is 1, an operator is
    2 + its arguments). big[d] = ach[d] without the leaf. sums[d][c][s] / bigsums[d][c][s]:
    c subtrees (c operator subtrees) at depth d can total s tokens.
    """

    def __init__(self, max_length: int, max_depth: int, max_args: int):
        n = max_length + 1
        self.ach, self.big, self.sums, self.bigsums = {}, {}, {}, {}
        leaf = np.zeros(n, bool)
        leaf[1] = True
        self.ach[max_depth] = leaf
        for d in range(max_depth, 0, -1):
            big = self.ach[d].copy()
            big[1] = False
            self.big[d] = big
            sums, bigsums = [np.eye(1, n, 0, dtype=bool)[0]], [np.eye(1, n, 0, dtype=bool)[0]]
            for _ in range(max_args):
                sums.append(_bool_conv(sums[-1], self.ach[d], n))
                bigsums.append(_bool_conv(bigsums[-1], big, n))
            self.sums[d], self.bigsums[d] = sums, bigsums
            if d > 1:
                parent = leaf.copy()
                inner = np.any(sums[2:], axis=0)
                parent[2:] |= inner[:-2]
                self.ach[d - 1] = parent


class _Generator:
    def __init__(self, cfg):
        self.depth, self.args = cfg.listops_max_depth, cfg.listops_max_args
        t = _SizeTables(cfg.listops_max_length, self.depth, self.args)
        ok = t.ach[1][cfg.listops_min_length:cfg.listops_max_length + 1]
        self.lengths = (cfg.listops_min_length + np.flatnonzero(ok)).tolist()
        # Python lists: indexing one is ~5x faster than a numpy scalar lookup.
        self.big = {d: a.tolist() for d, a in t.big.items()}
        self.sums = {d: [a.tolist() for a in v] for d, v in t.sums.items()}
        self.bigsums = {d: [a.tolist() for a in v] for d, v in t.bigsums.items()}
        self._arity = {}

    def tree(self, rng: random.Random, size: int, out: list[int]) -> int:
        """Append a random expression of exactly `size` tokens to `out`; return its value."""
        if size == 1:
            v = int(rng.random() * 10)
            out.append(v + 1)
            return v
        return self._node(rng, size, 1, out)

    def _arity_table(self, d: int, size: int):
        """Joint law of (k arguments, m of them operators) for an operator of `size` tokens
        at depth d: k uniform over the feasible arities, m ~ Binomial(k, 0.25) given k,
        both conditioned on the budget. Cached: the same (d, size) recurs constantly."""
        key = (d, size)
        if key not in self._arity:
            inner, sums, bigsums = size - 2, self.sums[d + 1], self.bigsums[d + 1]
            ks = [k for k in range(2, self.args + 1) if sums[k][inner]]
            pairs, weights = [], []
            for k in ks:
                ms = [m for m in range(k + 1) if inner >= k - m and bigsums[m][inner - (k - m)]]
                w = [math.comb(k, m) * (1 - LEAF_P) ** m * LEAF_P ** (k - m) for m in ms]
                pairs += [(k, m) for m in ms]
                weights += [x / sum(w) / len(ks) for x in w]
            self._arity[key] = (pairs, list(itertools.accumulate(weights)))
        return self._arity[key]

    def _split(self, rng, rest: int, m: int, d: int) -> list[int]:
        """Split `rest` tokens over m operator subtrees at depth d (each a feasible size)."""
        big, bigsums, sizes = self.big[d], self.bigsums[d], []
        for j in range(m - 1, 0, -1):  # j operator arguments still to place after this one
            hi = rest - 4 * j
            for _ in range(8):  # uniform proposals; exhaustive search only if all miss
                s = 4 + int(rng.random() * (hi - 3))
                if big[s] and bigsums[j][rest - s]:
                    break
            else:
                good = [s for s in range(4, hi + 1) if big[s] and bigsums[j][rest - s]]
                s = good[int(rng.random() * len(good))]
            sizes.append(s)
            rest -= s
        sizes.append(rest)
        rng.shuffle(sizes)
        return sizes

    def _node(self, rng, size, d, out):
        entry = self._arity.get((d, size)) or self._arity_table(d, size)
        pairs, cum = entry
        k, m = pairs[min(bisect.bisect(cum, rng.random() * cum[-1]), len(pairs) - 1)]
        rnd = rng.random
        op = int(rnd() * 4)
        out.append(OP0 + op)
        vals = [int(rnd() * 10) for _ in range(k)]  # leaf values; operator slots overwritten
        if m == 0:
            out.extend([v + 1 for v in vals])
        else:
            rest = size - 2 - (k - m)
            if m == 1:
                sizes, slots = [rest], [int(rnd() * k)]
            else:
                sizes, slots = self._split(rng, rest, m, d + 1), sorted(rng.sample(range(k), m))
            prev = 0
            for i, sub in zip(slots, sizes):
                out.extend([v + 1 for v in vals[prev:i]])
                vals[i] = self._node(rng, sub, d + 1, out)
                prev = i + 1
            out.extend([v + 1 for v in vals[prev:]])
        out.append(END)
        return _APPLY[op](vals)


def _check_cfg(cfg) -> None:
    from hpnlp.config import ConfigError
    lo, hi = cfg.listops_min_length, cfg.listops_max_length
    if not 1 <= lo <= hi:
        raise ConfigError(f"data.listops_min_length={lo}, data.listops_max_length={hi}: "
                          "need 1 <= listops_min_length <= listops_max_length")
    if cfg.listops_max_depth < 1 or cfg.listops_max_args < 2:
        raise ConfigError(f"data.listops_max_depth={cfg.listops_max_depth}, data.listops_max_args="
                          f"{cfg.listops_max_args}: need max_depth >= 1 and max_args >= 2")
    if cfg.listops_num_train < 1 or cfg.listops_num_eval < 1:
        raise ConfigError(f"data.listops_num_train={cfg.listops_num_train}, data.listops_num_eval="
                          f"{cfg.listops_num_eval}: both must be >= 1")
    if cfg.eval_split == "validation" and cfg.listops_num_train <= cfg.listops_num_eval:
        # (validate refuses it too; this is the library path, make_task(DataConfig(...)),
        # where make_task's cut went negative: review r2, train and eval sliced wrongly)
        raise ConfigError(f"data.listops_num_train={cfg.listops_num_train}, data.listops_num_eval="
                          f"{cfg.listops_num_eval}: data.eval_split='validation' holds out the "
                          "last listops_num_eval generated training examples; raise "
                          "data.listops_num_train above listops_num_eval")


def generate(cfg, num: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """`num` distinct expressions (token id arrays) and their values, deterministic in seed.

    Distinct like LRA (it kept a set), so no eval expression also appears in train.
    """
    _check_cfg(cfg)
    from hpnlp.config import ConfigError
    gen = _Generator(cfg)
    if len(gen.lengths) == 0:
        raise ConfigError(
            f"no ListOps expression has a length in [data.listops_min_length={cfg.listops_min_length}, "
            f"data.listops_max_length={cfg.listops_max_length}] with data.listops_max_depth="
            f"{cfg.listops_max_depth} and data.listops_max_args={cfg.listops_max_args}; "
            "widen the length range or allow deeper / wider trees")
    # Random(int) seeds with abs(seed), so seed -1 draws seed 1's expressions; kept, as saved
    # runs drew them (a review, d1: seed % 2**32 gave them other examples), and a new run of
    # a negative data.seed is refused (`config.checks.check_new_run`)
    rng = random.Random(seed)
    seen, seqs, labels = set(), [], []
    for _ in range(20 * num + 1000):
        out: list[int] = []
        value = gen.tree(rng, gen.lengths[int(rng.random() * len(gen.lengths))], out)
        key = bytes(out)
        if key not in seen:
            seen.add(key)
            seqs.append(np.array(out, np.int32))
            labels.append(value)
            if len(seqs) == num:
                return seqs, np.array(labels, np.int32)
    raise ConfigError(
        f"only {len(seqs)} distinct ListOps expressions found for {num} wanted; raise "
        "data.listops_max_length / listops_max_args or lower listops_num_train / listops_num_eval")


# ---------------------------------------------------------------------------------------
# Loader for users' LRA-format TSV files

_KEYS = {b"[MIN": OP0, b"[MAX": OP0 + 1, b"[MED": OP0 + 2, b"[SM": OP0 + 3}
_SINGLE = np.full(256, -2, np.int64)  # -2 unknown, -1 dropped parenthesis
for _c in range(10):
    _SINGLE[ord("0") + _c] = _c + 1
_SINGLE[ord("]")] = END
_SINGLE[ord("(")] = _SINGLE[ord(")")] = -1
_HEADER = "Source\tTarget"
_WHAT = ("an LRA ListOps TSV: a header line 'Source<TAB>Target', then one row per example, "
         "'<expression><TAB><label 0-9>', tokens [MIN [MAX [MED [SM ] 0-9 ( ) separated by spaces")


def _key(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Bytes starts..starts+width-1 packed into one integer, to compare tokens at once."""
    idx = np.minimum(starts[:, None] + np.arange(width), len(buf) - 1)
    return (buf[idx].astype(np.int64) << (8 * np.arange(width))).sum(1)


def load_tsv(path: str, field: str | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Read an LRA ListOps TSV -> (token id arrays, labels). Vectorized: LRA's files are
    ~100K rows of thousands of tokens, too many for a per-token Python loop. `field`: the
    config field that names it (data.train_path / data.eval_path), for the errors that say
    what to give it instead."""
    p = pathlib.Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else "no such file"
        raise ValueError(f"{path}: {what}; expected {_WHAT}")
    give = f"{field or 'the path'} must name an LRA ListOps TSV (UTF-8 text)"
    raw = read_bytes_of_text(path, give)  # (a compressed or UTF-16 file named as such: r3)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text; expected {_WHAT}") from None
    lines = text.split("\n")
    if not text.strip():
        raise ValueError(f"{path}: file is empty; expected {_WHAT}")
    if lines[0].strip("\r\ufeff ") != _HEADER:
        raise ValueError(f"{path}:1: expected the header 'Source<TAB>Target', got "
                         f"{lines[0][:60]!r}; the file must be {_WHAT}")
    linenos, sources, labels = [], [], []
    for lineno, line in enumerate(lines[1:], 2):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 2:
            raise ValueError(f"{path}:{lineno}: expected 2 tab-separated columns "
                             f"(expression, label), got {len(cols)}")
        try:
            label = int(cols[1].strip())
        except ValueError:
            label = None
        if label is None or not 0 <= label < NUM_CLASSES:
            raise ValueError(f"{path}:{lineno}: label {cols[1]!r} is not an integer in 0..9")
        linenos.append(lineno)
        sources.append(cols[0])
        labels.append(label)
    if not sources:
        raise ValueError(f"{path}: no examples after the header; expected {_WHAT}")
    buf = np.frombuffer("\n".join(sources).encode("utf-8"), np.uint8)
    solid = ~np.isin(buf, np.frombuffer(b" \t\n\r\x0b\x0c", np.uint8))
    edge = np.diff(np.concatenate([[False], solid, [False]]).astype(np.int8))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    width = ends - starts
    ids = np.where(width == 1, _SINGLE[buf[starts]], -2)
    for key, tok in _KEYS.items():  # each key of the tokens of its width alone (a review,
        # session 116: [N, 4] int64 copies of every token, ~100 bytes a token, ran LRA's own
        # training file, ~1e8 tokens, out of memory)
        cand = np.flatnonzero(width == len(key))
        hit = _key(buf, starts[cand], len(key)) == _key(
            np.frombuffer(key, np.uint8), np.zeros(1, np.int64), len(key))[0]
        ids[cand[hit]] = tok
    row = np.searchsorted(np.flatnonzero(buf == ord("\n")), starts)
    if (bad := np.flatnonzero(ids == -2)).size:
        i = bad[0]
        tok = bytes(buf[starts[i]:ends[i]]).decode("utf-8", "replace")
        raise ValueError(f"{path}:{linenos[row[i]]}: unknown token {tok!r}; expected {_WHAT}")
    keep = ids >= 0
    counts = np.bincount(row[keep], minlength=len(sources))
    if (empty := np.flatnonzero(counts == 0)).size:
        raise ValueError(f"{path}:{linenos[empty[0]]}: the expression has no tokens; expected {_WHAT}")
    kept = ids[keep]
    # brackets: each operator opens one, each ']' closes one; a row's depth never drops
    # below 0 and ends at 0
    depth = np.cumsum(np.where(kept >= OP0, np.where(kept == END, -1, 1), 0))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    before = np.concatenate([[0], depth])[first]  # the running depth before each row
    low = np.minimum.reduceat(depth, first) - before
    end = depth[first + counts - 1] - before
    if (bad := np.flatnonzero((low < 0) | (end != 0))).size:
        r = bad[0]
        why = ("a ']' closes no operator" if low[r] < 0 else
               f"{end[r]} operator(s) never closed by ']'")
        raise ValueError(f"{path}:{linenos[r]}: the brackets do not balance ({why}); "
                         f"expected {_WHAT}")
    # a review (session 114): balanced rows that are no one expression loaded, each trained
    # on a label no expression gives: an operator of no arguments ('[MAX ]'), or a row whose
    # depth is back at 0 before its last token ('1 2', '[MAX 1 ] 5'; one digit is one)
    tok_row = np.repeat(np.arange(len(sources)), counts)
    last = np.zeros(len(kept), bool)
    last[first + counts - 1] = True
    is_op = (kept >= OP0) & (kept != END)
    for bad, why in ((np.flatnonzero(~last & (depth - before[tok_row] <= 0)),
                      "more than one expression (a value, or a ']' closing the first "
                      "operator, before the line's end)"),
                     (np.flatnonzero(is_op[:-1] & (kept[1:] == END)),
                      "an operator with no arguments")):
        if bad.size:
            raise ValueError(f"{path}:{linenos[tok_row[bad[0]]]}: {why}; expected {_WHAT}")
    seqs = np.split(kept.astype(np.int32), np.cumsum(counts)[:-1])
    return seqs, np.array(labels, np.int32)


# ---------------------------------------------------------------------------------------
# Task


def make_task(cfg) -> task_lib.Task:
    if cfg.eval_path and not cfg.train_path:
        from hpnlp.config import ConfigError
        raise ConfigError(f"config field `data.eval_path` = {cfg.eval_path!r} needs data.train_path "
                          "too; set both, or neither to generate ListOps")
    if cfg.train_path:
        train_x, train_y = load_tsv(cfg.train_path, "data.train_path")
        if cfg.eval_path:
            eval_x, eval_y = load_tsv(cfg.eval_path, "data.eval_path")
        else:  # hold out the last 10% of rows, as the LM loaders do
            if len(train_x) < 2:
                raise ValueError(f"{cfg.train_path}: one row cannot be split into train and eval; "
                                 "add rows or set data.eval_path")
            cut = len(train_x) - max(1, len(train_x) // 10)
            train_x, eval_x, train_y, eval_y = train_x[:cut], train_x[cut:], train_y[:cut], train_y[cut:]
        source = {"train": cfg.train_path, "eval": cfg.eval_path or f"last 10% of {cfg.train_path}"}
    else:
        n_train, n_eval = cfg.listops_num_train, cfg.listops_num_eval
        seqs, labels = generate(cfg, n_train + n_eval, cfg.seed)
        # 'validation': the last n_eval training examples stand in for the eval set, which
        # is left unread
        cut, end = (n_train - n_eval, n_train) if cfg.eval_split == "validation" else (n_train, None)
        train_x, eval_x = seqs[:cut], seqs[cut:end]
        train_y, eval_y = labels[:cut], labels[cut:end]
        source = "generated (LRA recipe)"
    splits, truncated = [], 0
    for xs, ys in ((train_x, train_y), (eval_x, eval_y)):
        tokens, starts, lengths = task_lib.concat(xs)
        truncated += int((lengths > cfg.seq_len).sum())
        splits.append(task_lib.Examples(tokens, starts, np.minimum(lengths, cfg.seq_len), ys))
    if truncated:  # allowed (LRA truncates too), but a cut expression's value is unknowable
        warnings.warn(f"ListOps: {truncated} expressions are longer than data.seq_len="
                      f"{cfg.seq_len} and were truncated; raise data.seq_len or lower "
                      "data.listops_max_length", stacklevel=2)
    return task_lib.Task(
        name="listops", kind="classify", vocab_size=len(VOCAB), num_classes=NUM_CLASSES,
        seq_len=cfg.seq_len, train=splits[0], eval=splits[1],
        baseline=task_lib.majority_baseline(train_y, eval_y, NUM_CLASSES),
        token_counts=np.bincount(splits[0].tokens, minlength=len(VOCAB)).astype(np.int64),
        encode=encode, decode=decode,
        meta={"source": source, "vocab": VOCAB, "truncated_examples": truncated,
              "class_names": tuple(str(i) for i in range(10))})


def info(cfg) -> dict:
    return {"kind": "classify", "vocab_size": len(VOCAB), "num_classes": NUM_CLASSES}


