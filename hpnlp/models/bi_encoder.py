"""The bi-encoder: texts embedded to unit vectors for search, trained on matching pairs.

One shared encoder embeds both sides of a pair (`verse_pairs`: a verse and the next one;
any `match` task, whose label-0 rows then serve only as negatives), all sides in one call
(so with one draw of any random features, `heads.encode_sides`). The encoder is the
model's trunk (`model.arch` "transformer", "lstm" or "gru") pooled by `model.pool` (mean
over real tokens, or the first token), or, for `model.arch = "bag"`, a bag of embeddings
(StarSpace, Wu et al. 2018: the sum or mean of the token embeddings over real tokens only,
`model.encoder.bag`), the cheap baseline. Vectors are L2-normalized, so the inner product a
search index ranks by is the cosine.

Losses (`model.encoder.loss`; q = a pair's first side, d its second, s(a, b) = a . b):

- "in_batch": softmax cross-entropy of each q against every d of the batch at temperature T
  (its own d the target; the batch's other d, and the mined negatives when there are any,
  the negatives), averaged with the same over each d against every q when `symmetric`
  (CLIP / DPR style);
- "triplet": max(0, margin + s(q, neg) - s(q, d)), neg = the pair's mined negative, or the
  batch's hardest other d while none is mined (VSE++).

A batch's other pair that matches a row under another number is a negative of neither
(`batch_matches`, as mining's positives): a d of the same text as the row's d, or the d of
a positive pair whose q has the same text as the row's q ("And the LORD spake unto Moses,
saying," opens 45 pairs). Nor does the in-batch accuracy count the row wrong for ranking it
first.

Hard negatives are mined from the whole train pool with hpnlp.retrieval's exact search
(`hpnlp.retrieval.mining`, a train-state carry); they reach the model as the batch's third
side (`inputs3`, `segment_ids3`, `neg_weight`).

Evaluation over a whole pool (`pool_metrics`, `evaluate_pool`): each held-out q is searched
against every held-out d; recall@1, recall@10 and the mean reciprocal rank of its own d. An
encoder whose attention reads the run's random features (Performer, LSH) embeds with the draw
it trained with (`features_key`, as evaluation and decoding do).

Shape letters: B batch, N mined negatives (= B), L length, E width, V vocabulary, Q queries,
P pool.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import Config
from hpnlp.models.transformer import make_embed, positions_of
from hpnlp.parallel.pipeline import whole_microbatches


def normalize(x_BE, eps: float = 1e-6):
    """x / max(|x|, eps), with a finite gradient at x = 0 (an empty text's vector)."""
    x_BE = x_BE.astype(jnp.float32)
    sq = jnp.sum(x_BE * x_BE, axis=-1, keepdims=True)
    return x_BE * jax.lax.rsqrt(jnp.maximum(sq, eps * eps))


NEG = -1e9  # a masked score: finite, so no row's softmax or max turns its gradient to NaN


def same_text(tokens_BL, seg_BL):
    """[B, B] bool: rows holding the same text as the model reads it (real where seg > 0)."""
    t_BL = jnp.where(seg_BL > 0, tokens_BL, -1)
    return jnp.all(t_BL[:, None, :] == t_BL[None, :, :], axis=-1)


def batch_matches(batch, positive_B):
    """[B, B] bool: q_a and d_b match though a != b (module doc): d_b reads as d_a and pair a
    is positive, or q_b reads as q_a and pair b is positive. A bug hunt (session 102): they
    were each other's negatives (two rows of one d: neither's loss below log 2)."""
    same_d = same_text(batch["inputs2"], batch["segment_ids2"])
    same_q = same_text(batch["inputs1"], batch["segment_ids1"])
    match_BB = (same_d & positive_B[:, None]) | (same_q & positive_B[None, :])
    return match_BB & ~jnp.eye(len(positive_B), dtype=bool)


def in_batch_loss(q_BE, d_BE, valid_B, positive_B, temperature: float, *, symmetric: bool = True,
                  n_NE=None, n_valid_N=None, n_clash_BN=None, match_BB=None):
    """Per-row in-batch softmax loss [B] (0 where not `positive_B`; module doc).

    `valid_B`: real rows (their sides are candidates); `positive_B`: rows whose two sides
    match (their loss counts). `match_BB` [a, b]: q_a and d_b match (`batch_matches`), so d_b
    is no negative of q_a, nor q_a of d_b. `n_NE` / `n_valid_N`: extra negatives every q is
    scored against, except where `n_clash_BN` (row i's positive under another number: a
    negative mined for another row can be this row's match).
    """
    s_BB = (q_BE @ d_BE.T) / temperature
    diag_B = jnp.diagonal(s_BB)
    if match_BB is not None:
        s_BB = jnp.where(match_BB, NEG, s_BB)
    s_q = jnp.where(valid_B[None, :], s_BB, NEG)
    if n_NE is not None:
        keep_BN = n_valid_N[None, :] if n_clash_BN is None else n_valid_N[None, :] & ~n_clash_BN
        s_BN = jnp.where(keep_BN, (q_BE @ n_NE.T) / temperature, NEG)
        s_q = jnp.concatenate([s_q, s_BN], axis=1)
    loss_B = jax.nn.logsumexp(s_q, axis=1) - diag_B
    if symmetric:  # each d against every q
        s_d = jnp.where(valid_B[:, None], s_BB, NEG)
        loss_B = 0.5 * (loss_B + jax.nn.logsumexp(s_d, axis=0) - diag_B)
    return jnp.where(positive_B, loss_B, 0.0)


def triplet_loss(q_BE, d_BE, valid_B, positive_B, margin: float, *, n_NE=None, n_valid_N=None,
                 match_BB=None):
    """Per-row triplet margin loss [B]: max(0, margin + s(q, neg) - s(q, d)) with neg the
    row's own mined negative where `n_valid_N`, else the batch's hardest other valid d that
    is not its match (`match_BB`, as `in_batch_loss`; no loss for a row that has neither)."""
    s_BB = q_BE @ d_BE.T
    pos_B = jnp.diagonal(s_BB)
    others = valid_B[None, :] & ~jnp.eye(len(valid_B), dtype=bool)
    if match_BB is not None:
        others = others & ~match_BB
    neg_B = jnp.max(jnp.where(others, s_BB, NEG), axis=1)
    has_B = jnp.any(others, axis=1)
    if n_NE is not None:
        neg_B = jnp.where(n_valid_N, jnp.sum(q_BE * n_NE, axis=1), neg_B)
        has_B = has_B | n_valid_N
    loss_B = jnp.maximum(0.0, margin + neg_B - pos_B)
    return jnp.where(positive_B & has_B, loss_B, 0.0)


class BiEncoder(nn.Module):
    """Shared-weights encoder of both sides of a pair (module doc). Batches: inputs1/2,
    segment_ids1/2 [B, L]; label, weight [B]; optionally inputs3, segment_ids3 [B, L],
    neg_weight [B] and neg_clash [B, B] (mined negatives, hpnlp.retrieval.mining)."""

    cfg: Config
    deterministic: bool = True
    embed_weights: Any = None  # RowWeights of model.embed_grad_scale="corpus" (models.build)

    def setup(self):
        m = self.cfg.model
        self.embed = make_embed(m, grad_weights=self.embed_weights)
        if m.arch != "bag":
            from hpnlp.models.heads import make_trunk
            self.trunk = make_trunk(self.cfg, causal=False, deterministic=self.deterministic)

    def encode(self, tokens_BL, seg_BL):
        """Unit vectors [B, E] (float32) of the texts in `tokens_BL` (real where seg > 0)."""
        m = self.cfg.model
        if m.arch == "bag":
            mask_BL1 = (seg_BL > 0)[..., None].astype(jnp.float32)
            sum_BE = jnp.sum(self.embed(tokens_BL, seg_BL > 0).astype(jnp.float32) * mask_BL1,
                             axis=1)
            if m.encoder.bag == "mean":
                sum_BE = sum_BE / jnp.maximum(mask_BL1.sum(1), 1.0)
            return normalize(sum_BE)
        from hpnlp.models.heads import _pool
        h_BLE = self.trunk(self.embed, tokens_BL, seg_BL, positions_of(seg_BL))
        return normalize(_pool(h_BLE, seg_BL, m.pool))

    def _sides(self, batch):
        from hpnlp.models.heads import encode_sides
        # every side in one call of the encoder: one random-feature draw for all of them, the
        # one `encode` alone applies in the pool's evaluation, search and mining (review r1)
        sides = [(batch["inputs1"], batch["segment_ids1"]),
                 (batch["inputs2"], batch["segment_ids2"])]
        if "inputs3" in batch:
            sides.append((batch["inputs3"], batch["segment_ids3"]))
        q_BE, d_BE, *n_NE = encode_sides(self.encode, *sides)
        valid_B = batch["weight"] > 0
        positive_B = valid_B & (batch["label"] == 1)
        neg = {"match_BB": batch_matches(batch, positive_B)}
        if n_NE:
            neg.update(n_NE=n_NE[0], n_valid_N=batch["neg_weight"] > 0)
        return q_BE, d_BE, valid_B, positive_B, neg

    def __call__(self, batch):
        e = self.cfg.model.encoder
        q_BE, d_BE, valid_B, positive_B, neg = self._sides(batch)
        if e.loss == "in_batch":
            loss_B = in_batch_loss(q_BE, d_BE, valid_B, positive_B, e.temperature,
                                   symmetric=e.symmetric, n_clash_BN=batch.get("neg_clash"), **neg)
        else:
            loss_B = triplet_loss(q_BE, d_BE, valid_B, positive_B, e.margin, **neg)
        # `correct`: the row's own d is the nearest of the batch's d (recall@1 in the batch),
        # its matches under other numbers left out (a copy of its d ranked first is no miss)
        s_BB = jnp.where(valid_B[None, :] & ~neg["match_BB"], q_BE @ d_BE.T, NEG)
        hit_B = jnp.argmax(s_BB, axis=1) == jnp.arange(s_BB.shape[0])
        w_B = positive_B.astype(jnp.float32)
        return {"loss": jnp.sum(loss_B), "correct": jnp.sum(hit_B * w_B), "weight": jnp.sum(w_B)}

    evaluate = __call__

    @staticmethod
    def split_metrics(cfg: Config, model, params, task, *, features_key=None) -> dict:
        """What the Trainer adds to each evaluation: the whole held-out pool's recall@1/10 and
        MRR (`evaluate_pool`), beside the in-batch loss and accuracy; in a run of several
        processes each measures the whole pool, from the parameters gathered to it.
        `features_key`: `state.features_key(cfg.train.feature_redraw_every)`, the draw the
        parameters trained with (`embed_texts`)."""
        metrics = evaluate_pool(cfg, model, params, task, features_key=features_key)
        return {k: v for k, v in metrics.items() if k in ("recall@1", "recall@10", "mrr")}


# -- evaluation over a whole pool ------------------------------------------------------------


def side_arrays(ex, side: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Side `side` (0 or 1) of every pair of a match split as padded [P, L] tokens and
    segment ids (texts truncated to `seq_len`, as the batches truncate them)."""
    from hpnlp.data.task import ranges
    n = np.minimum(ex.lengths[:, side], seq_len).astype(np.int64)
    tokens = np.zeros((len(n), seq_len), np.int32)
    seg = np.zeros((len(n), seq_len), np.int32)
    row = np.repeat(np.arange(len(n)), n)
    col = ranges(np.zeros_like(n), n)
    tokens[row, col] = ex.tokens[ranges(ex.starts[:, side], n)]
    seg[row, col] = 1
    return tokens, seg


def embed_texts(model, params, tokens_PL, seg_PL, *, batch_size: int = 256,
                features_key=None) -> np.ndarray:
    """Unit vectors [P, E] of padded texts, `batch_size` at a time (one compile).

    `features_key`: the random-feature draw the encoder trained with, where its attention
    reads the run's `features` stream (Performer, LSH): `state.features_key(
    cfg.train.feature_redraw_every)`; refused without it there, before any compile (a review,
    session 106: the pool's evaluation and TextSearch embedded with the seed's draw,
    silently; `hpnlp.retrieval.knnlm.features_rngs`)."""
    from hpnlp.retrieval.knnlm import features_rngs
    rngs = features_rngs(model.cfg, features_key, "embedding texts")
    encode = _encoder(model)
    batch_size = whole_microbatches(batch_size)
    out, P = [], len(tokens_PL)
    for i in range(0, P, batch_size):
        t, s = tokens_PL[i:i + batch_size], seg_PL[i:i + batch_size]
        pad = batch_size - len(t)
        if pad:
            t, s = np.pad(t, ((0, pad), (0, 0))), np.pad(s, ((0, pad), (0, 0)))
        out.append(np.asarray(encode(params, t, s, rngs))[:batch_size - pad])
    return np.concatenate(out) if out else np.zeros((0, embedding_dim(model, params)),
                                                    np.float32)


def embedding_dim(model, params) -> int:
    """E, the width of the model's unit vectors: model.width, or twice it for a
    bidirectional RNN trunk (a bug hunt, session 96: taken as model.width, a text index of
    such an encoder refused its first vectors), read from the traced encoder (no compile)."""
    L = model.cfg.data.seq_len
    t = jax.ShapeDtypeStruct((whole_microbatches(1), L), np.int32)  # a pipeline splits the rows
    return int(jax.eval_shape(_encoder(model), params, t, t, {}).shape[-1])  # any draw's


@functools.lru_cache(maxsize=4)
def _encoder(model):
    """Jitted (params, tokens, seg, rngs) -> unit vectors; one per model (as knnlm._forward)."""
    return jax.jit(lambda p, t, s, rngs: model.apply({"params": p}, t, s, method="encode",
                                                     rngs=rngs))


def pool_metrics(q_QE, d_PE, *, ks=(1, 10), block: int = 4096) -> dict:
    """Query i's own item is d_PE[i]: recall@k (its rank <= k) and the mean reciprocal rank.

    The rank is where exact search puts the item: 1 + the number of items scoring higher,
    plus those scoring exactly the same with a lower id. Every score, the own item's
    included, comes from the same blocked product, so two equal vectors score exactly alike
    and no tolerance is needed (a tolerance would let a collapsed encoder, whose scores all
    lie within it, tie its way to the top). Counted exactly over blocks of the pool. A query
    whose own score is not finite ranks last, and an item scoring NaN ranks ahead of every
    other's own (a review, session 114: a NaN compares false with everything, so a query
    or item gone NaN (a float16 overflow, a quantized encoder) ranked first, a perfect hit)."""
    q = jnp.asarray(q_QE, jnp.float32)
    d = jnp.asarray(d_PE, jnp.float32)
    nq = q.shape[0]
    rows = jnp.arange(nq)[:, None]
    blocks = [(i, jnp.dot(q, d[i:i + block].T, precision=jax.lax.Precision.HIGHEST))
              for i in range(0, d.shape[0], block)]
    own_Q = sum(jnp.sum(jnp.where(rows == i + jnp.arange(s.shape[1])[None, :], s, 0.0), axis=1)
                for i, s in blocks)
    above = jnp.zeros(nq, jnp.int32)
    for i, s in blocks:
        j = i + jnp.arange(s.shape[1])[None, :]
        ahead = ((s > own_Q[:, None]) | ((s == own_Q[:, None]) & (j < rows))
                 | (jnp.isnan(s) & (j != rows)))
        above = above + jnp.sum(ahead, axis=1, dtype=jnp.int32)
    rank = np.where(np.isfinite(np.asarray(own_Q)), np.asarray(above) + 1, d.shape[0])
    out = {f"recall@{k}": float(np.mean(rank <= k)) for k in ks}
    out["mrr"] = float(np.mean(1.0 / rank))
    out["pool"] = int(d.shape[0])
    return out


def evaluate_pool(cfg: Config, model, params, task, *, split: str = "eval",
                  features_key=None) -> dict:
    """recall@1, recall@10 and MRR of `split`'s first sides searched against all its second
    sides (the positive pairs of a match task); `features_key` as `embed_texts`."""
    ex = task.eval if split == "eval" else task.train
    keep = np.flatnonzero(ex.labels == 1)
    q_tok, q_seg = side_arrays(ex, 0, cfg.data.seq_len)
    d_tok, d_seg = side_arrays(ex, 1, cfg.data.seq_len)
    q = embed_texts(model, params, q_tok[keep], q_seg[keep], features_key=features_key)
    d = embed_texts(model, params, d_tok, d_seg, features_key=features_key)
    # queries ordered as `keep`: put each one's own item first in the pool's order
    order = np.concatenate([keep, np.setdiff1d(np.arange(len(ex)), keep)])
    # mean cosine between two different pool items: near 1, the encoder has collapsed and
    # its ranks are decided by rounding, whatever recall they show
    P, total = len(d), np.sum(d, axis=0, dtype=np.float64)
    cosine = float((total @ total - np.sum(d.astype(np.float64) ** 2)) / max(P * (P - 1), 1))
    return {**pool_metrics(q, d[order]), "pool_cosine": cosine}
