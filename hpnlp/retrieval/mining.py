"""Hard negatives for the bi-encoder, mined from the whole train pool with exact search.

Every `model.encoder.mine_every` steps (not after the last) the current encoder embeds every
train pair's two sides; each first side q_i is searched (hpnlp.retrieval's `blocked_top_k`, exact) against
all second sides, and its negative is drawn uniformly from its `mine_depth` nearest second
sides that are not its positive: never d_i itself, nor any d_j whose text (as the model
reads it, truncated to data.seq_len) equals d_i's, nor any d_j of a positive pair (label 1)
whose first side equals q_i's (trained as q_i's match under another number: "And the LORD
spake unto Moses, saying," opens 45 pairs). A label-0 pair's d is a negative like any
other, as `bi_encoder.batch_matches` keeps it in a batch (`query_groups`). Until the first
mining no pair has a negative (-1).

This is a train-state carry (hpnlp.train.carry) named `negatives`: [pairs] int32, saved
with every checkpoint. Its `loss` adds each batch row's negative as the batch's third side
(`inputs3`, `segment_ids3`, `neg_weight`) for the model's loss (hpnlp.models.bi_encoder);
its `after_update` re-mines, inside the jitted step, under a `lax.cond`, so the steps
between minings pay nothing. (The pool's token arrays, a few MB, are constants of the
compiled step.) It mines after pruning's `after_update` (hpnlp.train.carry.for_config), so
with the masked (or rewound) encoder that trains next.

Under model.dtype='float16', a step that loss scaling skips (an overflow: its gradients are
not finite, and its update is undone) mines nothing, as its updated weights are not finite:
a mining due then is owed, not lost, and happens at the next step that updates (as pruning
delays its updates, `prune.updates_due`); the ones after it keep the schedule. (Review r7:
it was lost, and the next came `mine_every` steps later; where step `mine_every - 1` was
skipped, as the first steps of a float16 run often are while the scale comes down, the run
trained without hard negatives, all -1, for `2 * mine_every` steps.) The owed mining is
marked in the carry itself, which so keeps its layout, and checkpoints saved before the
mark resume: every entry moves down by P + 1, below -1 (`owe`, `owed`, `negatives_of`).
`after_update` tells a skip by the step's own test (`all_finite` of the gradients), and the
carry's `skipped` keeps what it decided.

Shape letters: P train pairs, L length, E width, K candidates searched per query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import Config
from hpnlp.train.carry import Carry

QUERY_BLOCK = 512  # queries embedded / searched per pass
DB_BLOCK = 2048  # pool rows per search block


def duplicate_groups(tokens_PL, seg_PL) -> np.ndarray:
    """[P] int32: the same number for rows holding the same text (first row's index)."""
    keys = [t[s > 0].tobytes() for t, s in zip(tokens_PL, seg_PL)]
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(k, i) for i, k in enumerate(keys)], np.int32)


def query_groups(tokens_PL, seg_PL, labels_P) -> np.ndarray:
    """[P] int32: `duplicate_groups` of the pairs' first sides, each label-0 pair in a group of
    its own (P + its index): its d is no match of its q's text, so `positives` never takes it
    for one (review r13: it was never mined for a q of the same text, and masked as a
    negative mined for another row, while the same d in a batch stayed a negative). Its own
    group also lets a positive pair's d of its q text be mined for a label-0 row: that row
    counts no loss, so the negative serves only the other rows, whose `neg_clash` masks it
    where it is their match."""
    group_P = duplicate_groups(tokens_PL, seg_PL)
    P = len(group_P)
    return np.where(np.asarray(labels_P) == 1, group_P, P + np.arange(P)).astype(np.int32)


def positives(ids, group_P, qgroup_P, rows):
    """Whether pair ids[...] is a match for the query of pair rows[...] (broadcast): its
    second side has the same text as that pair's, or its first side the same query text
    (`qgroup_P`: `query_groups`, where a label-0 pair matches no other)."""
    return (group_P[ids] == group_P[rows]) | (qgroup_P[ids] == qgroup_P[rows])


def pick_negatives(ids_PK, group_P, qgroup_P, depth: int, key):
    """Per query i, a uniform draw among the first `depth` candidates of row i (ranked
    nearest first) that are not its positives (`positives`); -1 where there is none."""
    rows = jnp.arange(ids_PK.shape[0])[:, None]
    ok_PK = ~positives(ids_PK, group_P, qgroup_P, rows)
    rank_PK = jnp.cumsum(ok_PK, axis=1) - 1
    avail_P = jnp.minimum(jnp.sum(ok_PK, axis=1), depth)
    r_P = jax.random.randint(key, avail_P.shape, 0, jnp.maximum(avail_P, 1))
    hit_PK = ok_PK & (rank_PK == r_P[:, None])
    chosen = jnp.take_along_axis(ids_PK, jnp.argmax(hit_PK, axis=1)[:, None], axis=1)[:, 0]
    return jnp.where(avail_P > 0, chosen, -1).astype(jnp.int32)


def all_finite(tree):
    """Whether every value of `tree` is finite: the train step's test for a float16 step that
    loss scaling skips, read of its gradients (hpnlp.train.step)."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def owe(neg_P):
    """The carry of negatives `neg_P` (each in [-1, P)) with a mining owed (module doc): all
    moved down by P + 1, to [-P - 2, -2]."""
    return neg_P - (neg_P.shape[0] + 1)


def owed(value_P):
    """Whether the carry `value_P` owes a mining (traced bool)."""
    return jnp.min(value_P) < -1


def negatives_of(value_P):
    """The negatives [P] the carry `value_P` holds, owed or not: each pair's, or -1."""
    return jnp.where(owed(value_P), value_P + value_P.shape[0] + 1, value_P)


def mine(encode, params, q_tok, q_seg, d_tok, d_seg, group_P, qgroup_P, depth: int, key):
    """[P] int32 negatives (module doc); `encode(params, tokens, seg) -> [n, E]` unit vectors.

    The texts are embedded and searched QUERY_BLOCK at a time, or the next multiple of a
    pipelined trunk's microbatch count (`pipeline.whole_microbatches`), their rows padded
    here to whole blocks (pad rows never match)."""
    from hpnlp.parallel.pipeline import whole_microbatches
    from hpnlp.retrieval.exact import blocked_top_k
    P = group_P.shape[0]
    rows = q_tok.shape[0]
    per = whole_microbatches(QUERY_BLOCK)
    n = -(-rows // per) * per

    def embed(tok, seg):
        tok_nL, seg_nL = (jnp.pad(a, ((0, n - rows), (0, 0))) for a in (tok, seg))
        blocks = (tok_nL.reshape(-1, per, tok.shape[1]), seg_nL.reshape(-1, per, seg.shape[1]))
        return jax.lax.map(lambda ts: encode(params, *ts), blocks).reshape(n, -1)

    q_PE, d_PE = embed(q_tok, q_seg), embed(d_tok, d_seg)[:rows]
    # the positives can take places ahead of the negatives: search past all of them
    most = lambda g: int(np.max(np.bincount(np.asarray(g))))  # noqa: E731
    k = min(P, depth + most(group_P) + most(qgroup_P))
    block = max(DB_BLOCK, 1 << (k - 1).bit_length())  # a block holds at least k rows
    pad = -(-rows // block) * block - rows
    d_nBE = jnp.pad(d_PE, ((0, pad), (0, 0))).reshape(-1, block, d_PE.shape[1])
    search = lambda q: blocked_top_k(q, d_nBE, P, k)[1]  # noqa: E731
    ids = jax.lax.map(search, q_PE.reshape(-1, per, q_PE.shape[1])).reshape(n, k)[:P]
    return pick_negatives(ids, jnp.asarray(group_P), jnp.asarray(qgroup_P), depth, key)


class NegativesCarry(Carry):
    """The `negatives` entry of the train state (module doc)."""

    name = "negatives"

    def __init__(self, cfg: Config, *, token_counts=None):
        from hpnlp import data, models
        from hpnlp.models.bi_encoder import side_arrays
        self.cfg = cfg
        task = data.make_task(cfg.data)
        self.encoder = models.build(cfg, deterministic=True, token_counts=task.token_counts)
        ex = task.train
        L = cfg.data.seq_len
        sides = [side_arrays(ex, s, L) for s in (0, 1)]
        self.pairs = len(ex)
        self.group = duplicate_groups(*sides[1])  # pairs whose second sides read the same
        # positive pairs whose first sides read the same
        self.qgroup = query_groups(*sides[0], ex.labels)
        rows = -(-self.pairs // QUERY_BLOCK) * QUERY_BLOCK
        pad = lambda a: np.pad(a, ((0, rows - len(a)), (0, 0)))  # noqa: E731
        (self.q_tok, self.q_seg), (self.d_tok, self.d_seg) = [(pad(t), pad(s)) for t, s in sides]

    def init(self, model, params, batch, batch_size: int):
        return jnp.full((self.pairs,), -1, jnp.int32)

    def loss(self, model, inner):
        d_tok, d_seg = jnp.asarray(self.d_tok), jnp.asarray(self.d_seg)
        group, qgroup = jnp.asarray(self.group), jnp.asarray(self.qgroup)

        def with_negatives(params, carry, batch, rngs):
            idx_B = jnp.maximum(batch["index"], 0)
            neg_B = jnp.where(batch["index"] >= 0, negatives_of(carry[self.name])[idx_B], -1)
            ok_B = neg_B >= 0
            row_B = jnp.maximum(neg_B, 0)
            # whole texts (seq_len wide, encoded on their own), whatever a bucket's width
            extra = {"inputs3": d_tok[row_B], "segment_ids3": d_seg[row_B] * ok_B[:, None],
                     "neg_weight": ok_B.astype(jnp.float32),
                     # row i's match among the negatives mined for the other rows
                     "neg_clash": positives(row_B[None, :], group, qgroup, idx_B[:, None])}
            return inner(params, carry, {**batch, **extra}, rngs)
        return with_negatives

    def after_update(self, value, params, grads, step, features=None):
        from hpnlp.retrieval.knnlm import features_rngs
        e = self.cfg.model.encoder
        encoder = self.encoder
        # the draw the step trained with, where the encoder's attention reads one (a review,
        # session 106: mining embedded with a Performer's seed draw, one it never trained with)
        rngs = features_rngs(self.cfg, features, "mining hard negatives")

        def encode(p, tok, seg):
            return encoder.apply({"params": p}, tok, seg, method="encode", rngs=rngs)

        def remine(_):
            key = jax.random.fold_in(jax.random.key(self.cfg.seed + 7919), step)
            return mine(encode, params, jnp.asarray(self.q_tok), jnp.asarray(self.q_seg),
                        jnp.asarray(self.d_tok), jnp.asarray(self.d_seg), self.group,
                        self.qgroup, e.mine_depth, key)
        # every mine_every steps, or the first step that updates after one that float16 loss
        # scaling skipped (module doc), but not after the last (nothing would train on them)
        neg_P, updates = negatives_of(value), all_finite(grads)
        scheduled = ((step + 1) % e.mine_every == 0) | owed(value)
        due = scheduled & (step + 1 < self.cfg.train.steps)
        mined = jax.lax.cond(due & updates, remine, lambda _: neg_P, None)
        return params, jnp.where(due & ~updates, owe(neg_P), mined)

    def skipped(self, new, old, applied):
        """`after_update` already kept the old negatives on a step whose gradients are not
        finite, the step's own test for a skip, and marked a mining due there as owed (module
        doc): its entry stands (the default would undo the mark)."""
        return jnp.where(applied | owed(new), new, old)
