"""Tree-factored output layers: `class_based` (two levels) and `hierarchical` (a Huffman tree).

Both write p(w|h) as a product of small normalized choices along the path from a root to w,
so the training loss touches one path instead of all V ids, while `log_prob` multiplies out
every path and is exactly normalized.

- `class_based` (Goodman 2001, "Classes for fast maximum entropy training"; frequency
  binning of Mikolov et al. 2011, "Extensions of recurrent neural network language
  model"): ids are binned into C classes of equal unigram mass and
  p(w|h) = p(c(w)|h) p(w|c(w), h). The loss scores the C classes and the members of the
  target's class only: O(N (C + M) E) instead of O(N V E).
- `hierarchical` (Morin & Bengio 2005; Huffman tree of Mikolov et al. 2013, word2vec):
  V - 1 internal nodes, each a binary logistic choice;
  p(w|h) = prod_d sigma(+-(h . n_d + b_d)) over the path to w. Huffman puts frequent ids
  near the root, so the loss costs O(N D E) with D ~ log2 V.

The trees are numpy tables built once per (counts, options) and cached, since flax re-runs
`setup` on every `apply`; they enter the jitted computation as constants.

Shape letters: N any leading dims (tokens), T flattened tokens, E hidden width,
V vocabulary, C classes, M members of the largest class, I = V - 1 internal nodes,
D deepest Huffman path, P = 2V - 1 tree nodes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.softmax.base import (Frequencies, VocabLayer, check_targets, fan_in_init, frequencies,
                                log_prob_nll_and_argmax, map_token_chunks, masked, register, scores)
from hpnlp.softmax.full import auto_chunk_tokens

_TABLES: dict = {}
_MAX_CACHED = 8


def cached_tables(build, counts, vocab_size: int, *options):
    """`build(Frequencies, *options)`, memoized on the counts' content and the options.

    Keyed by content, not identity: equal counts held by different `Frequencies` objects
    (two models, a rebuilt trainer) share one Huffman tree, which over 1M ids is worth
    building once.
    """
    freqs = frequencies(counts, vocab_size)
    digest = None if counts is None else freqs.digest
    key = (build.__module__, build.__qualname__, vocab_size, digest, options)
    if key not in _TABLES:
        if len(_TABLES) >= _MAX_CACHED:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = build(freqs, *options)
    return _TABLES[key]


def frequency_rank(freqs: Frequencies) -> np.ndarray:
    """Id at each rank, most frequent first (ties keep id order)."""
    return np.argsort(-freqs.counts, kind="stable").astype(np.int32)


class Vectors(nn.Module):
    """A table of score vectors [R, E] and biases [R], created on first use once E is known."""

    rows: int
    axis: str | None  # logical name of the R axis ("vocab" when it grows with V)
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, width: int):
        kernel_RE = self.param("kernel", nn.with_logical_partitioning(fan_in_init(), (self.axis, "embed")),
                               (self.rows, width), self.param_dtype)
        bias_R = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axis,)),
                            (self.rows,), self.param_dtype)
        return kernel_RE, bias_R


def _tokens_per_chunk(chunk_tokens: int, num_tokens: int, floats_per_token: int) -> int:
    return auto_chunk_tokens(num_tokens, floats_per_token) if chunk_tokens < 0 else chunk_tokens


# ----------------------------------------------------------------------------- class-based


@dataclasses.dataclass(frozen=True)
class ClassBins:
    """Frequency classes. Class c holds the ids of ranks [start_C[c], start_C[c] + size_C[c])."""

    class_V: np.ndarray  # [V] int32 class of each id
    rank_V: np.ndarray  # [V] int32 frequency rank of each id
    order_V: np.ndarray  # [V] int32 id at each rank
    start_C: np.ndarray  # [C] int32 first rank of each class
    size_C: np.ndarray  # [C] int32 members of each class

    @property
    def num_classes(self) -> int:
        return int(self.size_C.shape[0])

    @property
    def max_size(self) -> int:
        return int(self.size_C.max())


def class_bins(freqs: Frequencies, num_classes: int, power: float = 1.0) -> ClassBins:
    """Frequency binning as in Mikolov's rnnlm (Mikolov et al. 2011), vectorized.

    Walk the ids from most to least frequent; the current class a closes (a += 1) after
    the id whose cumulative unigram mass (of counts**power) passes (a + 1) / C. An id
    heavier than 1/C thus fills a class alone and the next ids catch up one class per id,
    so no class is empty; if the ids run out first, fewer than C classes exist.
    Closed form of the walk: a_i = min(a_{i-1} + 1, q_i) with q_i the number of cut points
    below the mass through id i, i.e. a_i = i + min(1, min_{j<=i} (q_j - j)).

    Ids never seen in training (count 0) carry no mass, so the walk would pile them all
    into its last class (18,923 of a 32,000-piece BPE vocabulary on the shipped corpus made
    that class 60% of V and every member softmax as wide). They come last in frequency
    order and fill classes of their own instead, ceil(V / C) ids each, after the walk's:
    up to ceil(zeros / ceil(V / C)) classes beyond C.
    """
    order_V = frequency_rank(freqs)
    vocab_size = len(order_V)
    seen = int(np.count_nonzero(freqs.counts[order_V] > 0))
    mass_V = np.minimum(np.cumsum(freqs.probs(power)[order_V][:seen]), 1.0)
    cuts_below_V = np.clip(np.ceil(mass_V * num_classes) - 1, 0, num_classes - 1).astype(np.int64)
    after_V = np.arange(seen) + np.minimum(1, np.minimum.accumulate(cuts_below_V - np.arange(seen)))
    unseen_size = -(-vocab_size // num_classes)
    first_unseen = int(after_V[-2]) + 1 if seen > 1 else seen  # classes the walk made
    class_of_rank = np.concatenate([[0], after_V[:-1], first_unseen + np.arange(vocab_size - seen)
                                    // unseen_size]).astype(np.int32)
    start_C = np.flatnonzero(np.diff(class_of_rank, prepend=-1)).astype(np.int32)
    size_C = np.diff(np.append(start_C, vocab_size)).astype(np.int32)
    rank_V = np.empty_like(order_V)
    rank_V[order_V] = np.arange(vocab_size, dtype=np.int32)
    return ClassBins(class_of_rank[rank_V], rank_V, order_V, start_C, size_C)


def _member_nll(hidden_TE, targets_T, member_scores, bias_V, bins: ClassBins):
    """-log p(w | c(w), h): softmax over the members of the target's class only.

    Members of a class are consecutive ranks, so the [T, M] member ids come from the [V]
    rank order (a padded [C, M] table without storing it); slots past the class's size are
    masked with -inf. `member_scores(hidden_TE, member_TM)`: h . w of those members, float32
    [T, M], without the bias (`_member_scores`).
    """
    vocab_size = bins.order_V.shape[0]
    class_T = jnp.take(bins.class_V, targets_T)
    start_T = jnp.take(bins.start_C, class_T)
    slot_M = jnp.arange(bins.max_size, dtype=jnp.int32)
    rank_TM = start_T[:, None] + slot_M[None, :]
    member_TM = jnp.take(bins.order_V, jnp.minimum(rank_TM, vocab_size - 1))
    real_TM = slot_M[None, :] < jnp.take(bins.size_C, class_T)[:, None]
    scores_TM = member_scores(hidden_TE, member_TM)
    scores_TM = jnp.where(real_TM, scores_TM + jnp.take(bias_V, member_TM).astype(jnp.float32), -jnp.inf)
    slot_T = jnp.take(bins.rank_V, targets_T) - start_T
    target_T = jnp.take_along_axis(scores_TM, slot_T[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(scores_TM, axis=-1) - target_T


@register("class_based")
class ClassBasedSoftmax(VocabLayer):
    """Two-level softmax: p(w|h) = p(c(w)|h) p(w|c(w), h) (Goodman 2001).

    The fast idea: the word-level softmax runs over the target's class only, so a token
    costs C + M scores instead of V (C ~ M ~ sqrt(V) for flat distributions; with Zipf the
    rare-word classes are the largest, M ~ V ln(V) / C at power 1, less at power 0.5).
    Params: `table/kernel` [V, E] word vectors (absent when tied to `embed`), `table/bias`
    [V], `classes/kernel` [C, E], `classes/bias` [C]. The training loss is exactly
    -log_prob[target].
    """

    trains_nll: ClassVar[bool] = True
    layout_options: ClassVar[frozenset] = frozenset({"chunk_tokens"})  # (`base.layout_options`)

    counts: Frequencies | None = None  # train counts per id; None = Zipf over frequency-sorted ids
    num_classes: int = 0  # C; 0 = round(sqrt(V)). Fewer when ids run out (see `class_bins`)
    bin_power: float = 1.0  # bin counts**power: 1 = equal unigram mass (Mikolov 2011), 0.5 = smaller M
    chunk_tokens: int = -1  # tokens per loss chunk; -1 = auto (gathers under 256 MiB), 0 = never

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        """num_classes and bin_power were checked only in `setup`, without their config field."""
        del frequency_sorted
        from hpnlp.config import config_error
        c = options.get("num_classes", cls.num_classes)
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= vocab_size:
            raise config_error(f"{field}.num_classes", c, f"must be an integer in [1, "
                               f"model.vocab_size={vocab_size}], or 0 for round(sqrt(V))")
        p = options.get("bin_power", cls.bin_power)  # review r2: inf binned by NaN masses
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < math.inf:
            raise config_error(f"{field}.bin_power", p, "must be a number > 0 and finite (1.0: "
                               "classes of equal unigram mass, 0.5: smaller classes)")

    def setup(self):
        super().setup()
        num_classes = self.num_classes or max(1, round(math.sqrt(self.vocab_size)))
        if not 1 <= num_classes <= self.vocab_size:
            raise ValueError(f"class_based num_classes={self.num_classes} must be in [1, vocab_size="
                             f"{self.vocab_size}]; use 0 for round(sqrt(vocab_size))")
        if not 0 < self.bin_power < math.inf:
            raise ValueError(f"class_based bin_power={self.bin_power} must be > 0 and finite "
                             "(1.0 = unigram mass)")
        self.bins = cached_tables(class_bins, self.counts, self.vocab_size, num_classes, float(self.bin_power))
        self.classes = Vectors(self.bins.num_classes, None, self.param_dtype)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        del deterministic  # exact: no randomness
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        lead, width = targets_N.shape, hidden_NE.shape[-1]
        class_lp_NC = self._class_log_probs(hidden_NE)
        class_N = jnp.take(self.bins.class_V, targets_N)
        class_nll_N = -jnp.take_along_axis(class_lp_NC, class_N[..., None], axis=-1)[..., 0]
        member_scores, bias_V = self._member_table(width, targets_N.size)
        chunk = _tokens_per_chunk(self.chunk_tokens, targets_N.size, self.bins.max_size * width)
        member_nll_N = map_token_chunks(  # the member product reads what `logits` reads
            lambda h, t: _member_nll(h, t, member_scores, bias_V, self.bins), lead, chunk,
            self.quant_hidden(hidden_NE), targets_N)  # (found in review: unquantized in QAT)
        return masked(class_nll_N + member_nll_N, mask_N)

    def _member_table(self, width: int, num_tokens: int):
        """(`_member_nll`'s member_scores, b [V]) for `num_tokens` tokens. A Factored table
        (model.lowrank: U [V, r] V [r, E]) scores through the rank where that costs fewer
        flops, T r (E + M) against V r E + T M E for multiplying it out to [V, E] and
        gathering rows of E (review r8: always multiplied out, a [V, E] buffer and its
        gradient every step); at a small V and many tokens (a byte LM's) multiplying the
        table out costs less, and its [V, E] is then small."""
        from hpnlp.compress.qlinear import Factored
        stored, bias_V = self._stored(width)
        if isinstance(stored, Factored):
            T, M, r, V = num_tokens, self.bins.max_size, stored.rank, self.vocab_size
            if T * r * (width + M) <= V * r * width + T * M * width:
                return _member_scores(stored, self.dtype), bias_V
        kernel_VE, bias_V = self._decoded(stored, bias_V, width)
        return _member_scores(kernel_VE, self.dtype), bias_V

    def _class_log_probs(self, hidden_NE):
        kernel_CE, bias_C = self.classes(hidden_NE.shape[-1])
        return jax.nn.log_softmax(scores(hidden_NE, kernel_CE, bias_C, self.dtype), axis=-1)

    def log_prob(self, hidden_NE):
        """Exact: class log-prob plus the word's log-softmax within its class, for all V ids."""
        lead = hidden_NE.shape[:-1]
        class_lp_TC = self._class_log_probs(hidden_NE).reshape(-1, self.bins.num_classes)
        logp_TV = _class_factored(class_lp_TC, self.logits(hidden_NE).reshape(-1, self.vocab_size),
                                  self.bins)
        return logp_TV.reshape(*lead, self.vocab_size)

    def eval_chunk_tokens(self, num_tokens: int) -> int:
        """Always automatic: `chunk_tokens` sizes the loss's [C, M, E] member gather, not the
        [C, V] logits evaluation holds (found in review: chunk_tokens=8192 at V = 1M made
        each eval chunk 32 GiB)."""
        return auto_chunk_tokens(num_tokens, self.vocab_size)

    def chunk_eval(self, hidden_NE):
        """`log_prob` a chunk of tokens at a time (`nll_and_argmax`): the word logits by the
        product `logits` takes (`_logits_fn`)."""
        width = hidden_NE.shape[-1]
        kernel_CE, bias_C = self.classes(width)
        logits_fn = self._logits_fn(width)

        def one_chunk(h_TE, t_T):
            class_lp_TC = jax.nn.log_softmax(scores(h_TE, kernel_CE, bias_C, self.dtype), axis=-1)
            return log_prob_nll_and_argmax(_class_factored(class_lp_TC, logits_fn(h_TE), self.bins),
                                           t_T)
        return one_chunk, (hidden_NE,)


def _member_scores(table, dtype):
    """`_member_nll`'s member_scores of a [V, E] table: each member's row gathered, [T, M,
    E]; of a Factored one (model.lowrank, U [V, r] V [r, E]) through the rank: h V^T once,
    [T, r], against U's member rows [T, M, r], never the [V, E] table."""
    from hpnlp.compress.qlinear import Factored, float_product
    if isinstance(table, Factored):
        def factored(h_TE, member_TM):
            t_Tr = float_product(h_TE.astype(dtype), table.v.T.astype(dtype), None, 1)
            u_TMr = jnp.take(table.u, member_TM, axis=0).astype(dtype)
            return jnp.einsum("tr,tmr->tm", t_Tr, u_TMr, preferred_element_type=jnp.float32)
        return factored

    def dense(h_TE, member_TM):
        vectors_TME = jnp.take(table, member_TM, axis=0).astype(dtype)
        return jnp.einsum("te,tme->tm", h_TE.astype(dtype), vectors_TME,
                          preferred_element_type=jnp.float32)
    return dense


def _class_factored(class_lp_TC, logits_TV, bins: ClassBins):
    """log p(c(w)) + log softmax over w's class of the word logits: [T, V] log-probabilities."""
    logits_VT = logits_TV.T
    class_V, num_classes = jnp.asarray(bins.class_V), bins.num_classes
    max_CT = jax.ops.segment_max(logits_VT, class_V, num_segments=num_classes)
    shifted_VT = logits_VT - jax.lax.stop_gradient(jnp.take(max_CT, class_V, axis=0))
    sum_CT = jax.ops.segment_sum(jnp.exp(shifted_VT), class_V, num_segments=num_classes)
    member_lp_VT = shifted_VT - jnp.take(jnp.log(sum_CT), class_V, axis=0)
    logp_VT = member_lp_VT + jnp.take(class_lp_TC.T, class_V, axis=0)
    return logp_VT.T


# ----------------------------------------------------------------------------- hierarchical


@dataclasses.dataclass(frozen=True)
class HuffmanTree:
    """Every id's path, leaf first: internal node ids [D, V] and the branch taken, sign
    [D, V] in {+1, -1} (code bit 1 / 0), 0 past the path's end (padding)."""

    node_DV: np.ndarray  # [D, V] int32, 0 on padding
    sign_DV: np.ndarray  # [D, V] int8
    depth_V: np.ndarray  # [V] int32 path length

    @property
    def max_depth(self) -> int:
        return int(self.node_DV.shape[0])

    def codes(self) -> list[str]:
        """Each id's code as a '0'/'1' string, read from the root."""
        return ["".join("1" if s > 0 else "0" for s in col[:d][::-1])
                for col, d in zip(self.sign_DV.T, self.depth_V)]


def huffman_tree(freqs: Frequencies) -> HuffmanTree:
    """Huffman tree over the counts in O(V log V) numpy, then the paths of all leaves at once.

    The merge is word2vec's two-queue Huffman (leaves sorted ascending; merged nodes are
    created in ascending weight, so they form a second sorted queue) done in rounds: with x
    the smallest weight left, every node lighter than 2x is consumed before any node merged
    in this round (those weigh >= 2x), so a round pairs them all at once in sorted order.
    Rounds roughly double the smallest weight: tens of rounds for real counts.

    Node numbering: leaves 0..V-1 are the ids, internal node k (k-th merge) is V + k, the
    root is the last. Bit 0 goes to the lighter child; on equal weights a leaf is taken
    before a merged node, which keeps the tree shallow.
    """
    vocab_size = freqs.vocab_size
    if vocab_size < 2:
        raise ValueError(f"hierarchical needs vocab_size >= 2 (a tree with no internal node); got "
                         f"{vocab_size}")
    leaf_id = np.argsort(freqs.counts, kind="stable")
    leaf_w = freqs.counts[leaf_id]
    num_nodes = 2 * vocab_size - 1
    parent_P = np.zeros(num_nodes, np.int64)
    bit_P = np.zeros(num_nodes, np.int8)
    merged_w = np.zeros(vocab_size - 1)
    i = j = k = 0  # leaves consumed, merged nodes consumed, merged nodes created
    while k < vocab_size - 1:
        x = min(leaf_w[i] if i < vocab_size else np.inf, merged_w[j] if j < k else np.inf)
        side = "left" if x > 0 else "right"  # lighter than 2x; zero weights: all zeros
        n_leaf = int(np.searchsorted(leaf_w[i:], 2 * x, side))
        n_merged = int(np.searchsorted(merged_w[j:k], 2 * x, side))
        if (n_leaf + n_merged) % 2:  # the odd one out pairs with a node of the next round
            drop_merged = n_merged and (not n_leaf or merged_w[j + n_merged - 1] >= leaf_w[i + n_leaf - 1])
            n_merged, n_leaf = (n_merged - 1, n_leaf) if drop_merged else (n_merged, n_leaf - 1)
        if n_leaf + n_merged < 2:  # a lone light node: merge the two lightest
            first_two = np.concatenate([leaf_w[i:i + 2], merged_w[j:min(j + 2, k)]])
            is_leaf = np.arange(len(first_two)) < min(2, vocab_size - i)
            take = np.lexsort((~is_leaf, first_two))[:2]
            n_leaf = int(is_leaf[take].sum())
            n_merged = 2 - n_leaf
        weight = np.concatenate([leaf_w[i:i + n_leaf], merged_w[j:j + n_merged]])
        node = np.concatenate([leaf_id[i:i + n_leaf], vocab_size + np.arange(j, j + n_merged)])
        order = np.lexsort((np.arange(len(weight)) >= n_leaf, weight))  # by weight, leaves first
        pairs = len(order) // 2
        parent_P[node[order]] = vocab_size + k + np.repeat(np.arange(pairs), 2)
        bit_P[node[order]] = np.tile(np.array([0, 1], np.int8), pairs)
        merged_w[k:k + pairs] = weight[order[0::2]] + weight[order[1::2]]
        i, j, k = i + n_leaf, j + n_merged, k + pairs
    root = num_nodes - 1
    parent_P[root] = root

    # Walk every leaf up at once, one level per step. Paths are stored leaf first: the loss
    # and log_prob only sum over them, and [D, V] rows are written contiguously.
    parent_P = parent_P.astype(np.int32)
    child_V = np.arange(vocab_size, dtype=np.int32)
    node_rows, sign_rows = [], []
    while True:
        below_root_V = child_V != root
        if not below_root_V.any():
            break
        parent_V = parent_P[child_V]
        node_rows.append(np.where(below_root_V, parent_V - vocab_size, 0))
        sign_rows.append(np.where(below_root_V, 2 * bit_P[child_V] - 1, 0).astype(np.int8))
        child_V = parent_V
    sign_DV = np.stack(sign_rows)
    return HuffmanTree(np.stack(node_rows), sign_DV, (sign_DV != 0).sum(0, dtype=np.int32))


@register("hierarchical")
class HierarchicalSoftmax(nn.Module):
    """Hierarchical softmax over a Huffman tree (Morin & Bengio 2005; Mikolov et al. 2013).

    The fast idea: each internal node is one logistic choice, so p(w|h) is a product of D
    sigmoids along w's path and is normalized by construction; the loss gathers the D node
    vectors of the target's path, O(D E) per token with D ~ log2 V (shorter for frequent
    ids). Params: `nodes/kernel` [V - 1, E], `nodes/bias` [V - 1]. Loss == -log_prob[target].
    """

    trains_nll: ClassVar[bool] = True
    layout_options: ClassVar[frozenset] = frozenset({"chunk_tokens"})  # (`base.layout_options`)

    vocab_size: int = 0
    counts: Frequencies | None = None  # train counts per id; None = Zipf over frequency-sorted ids
    chunk_tokens: int = -1  # tokens per loss chunk; -1 = auto (gathers under 256 MiB), 0 = never
    dtype: jnp.dtype = jnp.float32  # matmul input dtype; scores and losses are float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        if self.vocab_size < 2:
            raise ValueError(f"hierarchical needs vocab_size >= 2 (a tree with no internal node); "
                             f"got vocab_size={self.vocab_size}")
        self.tree = cached_tables(huffman_tree, self.counts, self.vocab_size)
        self.nodes = Vectors(self.vocab_size - 1, "vocab", self.param_dtype)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        del deterministic  # exact: no randomness
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        lead, width = targets_N.shape, hidden_NE.shape[-1]
        kernel_IE, bias_I = self.nodes(width)
        node_DV, sign_DV, dtype = self.tree.node_DV, self.tree.sign_DV, self.dtype

        def path_nll(hidden_TE, targets_T):
            node_TD = jnp.take(node_DV, targets_T, axis=1).T
            sign_TD = jnp.take(sign_DV, targets_T, axis=1).T.astype(jnp.float32)
            vectors_TDE = jnp.take(kernel_IE, node_TD, axis=0).astype(dtype)
            score_TD = jnp.einsum("te,tde->td", hidden_TE.astype(dtype), vectors_TDE,
                                  preferred_element_type=jnp.float32)
            score_TD = score_TD + jnp.take(bias_I, node_TD).astype(jnp.float32)
            return -jnp.sum(jnp.where(sign_TD != 0, jax.nn.log_sigmoid(sign_TD * score_TD), 0.0), -1)

        chunk = _tokens_per_chunk(self.chunk_tokens, targets_N.size, self.tree.max_depth * width)
        nll_N = map_token_chunks(path_nll, lead, chunk, hidden_NE, targets_N)
        return masked(nll_N, mask_N)

    def log_prob(self, hidden_NE):
        """Exact: one [T, V-1] node-score matmul, then every id's path summed one depth at a
        time (a scan over D keeps memory at [T, V] rather than [T, V, D])."""
        lead, width = hidden_NE.shape[:-1], hidden_NE.shape[-1]
        kernel_IE, bias_I = self.nodes(width)
        score_TI = scores(hidden_NE.reshape(-1, width), kernel_IE, bias_I, self.dtype)

        def one_depth(logp_TV, step):
            node_V, sign_V = step
            sign_1V = sign_V.astype(jnp.float32)[None, :]
            term_TV = jax.nn.log_sigmoid(sign_1V * jnp.take(score_TI, node_V, axis=1))
            return logp_TV + jnp.where(sign_1V != 0, term_TV, 0.0), None

        logp_TV = jnp.zeros((score_TI.shape[0], self.vocab_size), jnp.float32)
        logp_TV, _ = jax.lax.scan(one_depth, logp_TV, (self.tree.node_DV, self.tree.sign_DV))
        return logp_TV.reshape(*lead, self.vocab_size)

    def top_k(self, hidden_NE, k: int):
        return jax.lax.top_k(self.log_prob(hidden_NE), k)

    def __call__(self, hidden_NE):
        return self.log_prob(hidden_NE)
