"""Sampled objectives: `sampled`, `nce`, `negative_sampling`, and `hard_negative`.

Each one trains the output vectors of `VocabLayer` without scoring the whole vocabulary,
then evaluates (`log_prob`, `top_k`) with the exact softmax of those same weights, so tying
and evaluation work as they do for `full`.

- `sampled`: importance-sampled softmax (Bengio & Senecal 2008; Jean et al. 2015). The
  normalizer is estimated from S negatives drawn from a proposal q, each weighted by
  1 / (expected count): Z ~ exp(s_t) + sum_j exp(s_j - log c_j).
- `nce`: noise-contrastive estimation (Gutmann & Hyvarinen 2010; Mnih & Teh 2012). A logistic
  classifier tells the data from k noise samples using s - log(k q).
- `negative_sampling`: word2vec's objective (Mikolov et al. 2013), i.e. NCE without the
  log(k q) term.
- `hard_negative`: a margin loss against the K highest-scoring wrong ids. This one is
  O(N x V) in the forward by nature, because finding the top K needs every score.

Why the first three are fast: one draw of S negatives is shared by the whole batch (Zoph
et al. 2016). A step costs one [T + S, E] gather and one [T, E] x [E, S] matmul instead
of [T, E] x [E, V]. With `shared=False` each token draws its own S ids ([T, S] ids and a
[T, S, E] gather), as in word2vec; the gather walks token chunks whose [C, S, E] float32 stays
under `full.CHUNK_LOGITS_BYTES` per device, recomputed in the backward, as `full`'s logits.

One `Sampler` serves all three. With replacement it uses Walker's alias method: O(1) per
draw and exact per id. An inverse CDF in float32 cannot reach ids rarer than 2^-24. The
expected count of id i is S q_i. Without replacement (`unique=True`) it takes the top S
of log q + Gumbel noise (Gumbel-top-k, which is the same as drawing one at a time without
replacement). The marginal inclusion probability of this scheme has no closed form. So the
"expected count" is the inclusion probability given the other ids' noise:
pi_i = 1 - exp(-exp(log q_i - kappa_i)), where kappa_i is the S-th largest perturbed value
among the other ids. That is the (S+1)-th largest overall for an id in the sample and the
S-th for one outside it. E[1{i in sample} / pi_i] = 1 exactly (priority sampling: Duffield
et al. 2007; Kool et al. 2019), so the importance weights stay unbiased. The uniform
proposal uses its exact inclusion probability, S / V. Gumbel-top-k needs V noise values per
draw. That is cheap once per batch (shared) but O(T x V) per token with `shared=False`.

Accidental hits are negatives equal to the token's own target. `sampled` and
`negative_sampling` drop them (word2vec skips them too). `nce` keeps them, because its
noise must be independent of the data for the estimator to be consistent.

Sampled negatives are a Monte-Carlo draw: `self.make_rng("dropout")` when
`deterministic=False`, and the fixed key `jax.random.key(0)` when `deterministic=True`,
so an eval loss is defined and repeatable.

Shape letters: N any leading dims, T flattened tokens, E hidden width, V vocabulary,
S sampled negatives, K hard negatives, P a draw's prefix ((): shared, (T,): per token),
R gathered rows (targets and negatives together).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import config_error
from hpnlp.softmax.base import (Frequencies, VocabLayer, check_targets, computed_vector,
                                factored_logits, frequencies, map_token_chunks, masked,
                                refuse_unread, register, scores)
from hpnlp.softmax.full import auto_chunk_tokens

SAMPLERS = ("uniform", "log_uniform", "unigram")
_DROPPED = -1e30  # logit of a removed accidental hit: exp() is exactly 0, no inf arithmetic


# ----------------------------------------------------------------------------- sampler


class Draw(NamedTuple):
    """One draw of negatives, shared ([S]) or per token ([T, S])."""

    ids: jax.Array  # [*P, S] int32
    log_count: jax.Array  # [*P, S] float32: log expected count (log S q) or log inclusion prob
    kappa_in: jax.Array | None  # [*P] Gumbel threshold for ids in the sample (unique only)
    kappa_out: jax.Array | None  # [*P] Gumbel threshold for ids outside it (unique only)


@dataclasses.dataclass(frozen=True, eq=False)
class Sampler:
    """A proposal distribution q over ids, with draws and expected counts.

    It is built once in numpy (`make_sampler`). The tables become jit constants, three
    [V] arrays, and the uniform sampler needs none.
    """

    kind: str
    vocab_size: int
    log_q: np.ndarray | None  # [V] float32 log q; None for uniform
    accept: np.ndarray | None  # [V] float32 alias-method acceptance
    alias: np.ndarray | None  # [V] int32 alias-method fallback id

    def probs(self) -> np.ndarray:
        """q [V] as float64 (for tests and inspection)."""
        if self.log_q is None:
            return np.full(self.vocab_size, 1.0 / self.vocab_size)
        return np.exp(self.log_q.astype(np.float64))

    def log_prob(self, ids):
        """log q(ids), float32, shaped like ids."""
        if self.log_q is None:
            return jnp.full(ids.shape, -np.log(self.vocab_size), jnp.float32)
        return jnp.take(jnp.asarray(self.log_q), ids, axis=0)

    def draw(self, key, prefix: tuple[int, ...], num: int, unique: bool) -> Draw:
        """`num` ids per prefix entry, with replacement or (unique) without."""
        if not unique:
            shape = (*prefix, num)
            if self.log_q is None:
                ids = jax.random.randint(key, shape, 0, self.vocab_size, jnp.int32)
            else:  # Walker's alias method: pick a bucket, keep it or take its alias
                k_bucket, k_coin = jax.random.split(key)
                bucket = jax.random.randint(k_bucket, shape, 0, self.vocab_size, jnp.int32)
                coin = jax.random.uniform(k_coin, shape)
                keep = coin < jnp.take(jnp.asarray(self.accept), bucket, axis=0)
                ids = jnp.where(keep, bucket, jnp.take(jnp.asarray(self.alias), bucket, axis=0))
            return Draw(ids, np.log(num) + self.log_prob(ids), None, None)
        gumbel = jax.random.gumbel(key, (*prefix, self.vocab_size), jnp.float32)
        if self.log_q is not None:
            gumbel = gumbel + jnp.asarray(self.log_q).reshape((1,) * len(prefix) + (-1,))
        top, ids = jax.lax.top_k(gumbel, num + 1)
        ids = ids[..., :num].astype(jnp.int32)
        draw = Draw(ids, None, top[..., num], top[..., num - 1])
        return draw._replace(log_count=self.log_count(ids, draw, num, in_sample=True))

    def log_count(self, ids, draw: Draw, num: int, *, in_sample):
        """log expected count of arbitrary `ids` (e.g. targets) under `draw`.

        `ids` has the shape of draw.ids' prefix plus any trailing axes. `in_sample`
        (bool, broadcastable to ids) says whether each id is in the draw, which picks the
        threshold for a unique draw.
        """
        if draw.kappa_in is None:
            return np.log(num) + self.log_prob(ids)
        if self.log_q is None:
            return jnp.full(ids.shape, np.log(num / self.vocab_size), jnp.float32)
        trailing = (1,) * (ids.ndim - draw.kappa_in.ndim)
        kappa = jnp.where(in_sample, draw.kappa_in.reshape(draw.kappa_in.shape + trailing),
                          draw.kappa_out.reshape(draw.kappa_out.shape + trailing))
        return _log_inclusion(self.log_prob(ids) - kappa)


def _log_inclusion(a):
    """log(1 - exp(-exp(a))), i.e. log P(Gumbel > -a). It tends to a for a << 0."""
    return jnp.where(a < -20.0, a, jnp.log(-jnp.expm1(-jnp.exp(jnp.minimum(a, 30.0)))))


def inclusion_log_probs(log_q: np.ndarray, num: int) -> np.ndarray:
    """log pi [V] float64: each id's probability of being among `num` distinct draws
    (Gumbel-top-k of log q [V], finite), approximately: pi_i = 1 - exp(-q_i t) with the one
    t that makes sum(pi) = num. It is `Sampler.log_count`'s pi_i(kappa) at a fixed threshold
    t = exp(-kappa) in place of the random one (Rosén 1997's approximation of successive
    sampling). Measured against the Monte-Carlo mean of pi_i(kappa): within 0.004 nats at
    V = 256, num = 64, and 0.014 at V = 50, num = 8 (2.1 and 0.55 for k q). t by bisection
    in log space: sum(pi) grows with t, from <= num at t = num (pi_i <= q_i t) to >= num
    where the rarest id's pi alone reaches num / V (needs num < V); about 35 passes over V,
    0.3 s at V = 2^20."""
    lo = math.log(num)
    hi = max(lo, math.log(-math.log1p(-num / log_q.shape[0])) - float(log_q.min()))
    log_pi = lambda log_t: _np_log_inclusion(log_q + log_t)  # noqa: E731
    while hi - lo > 1e-10 * max(1.0, abs(lo)):
        mid = 0.5 * (lo + hi)
        if np.exp(log_pi(mid)).sum() < num:
            lo = mid
        else:
            hi = mid
    return log_pi(0.5 * (lo + hi))


def _np_log_inclusion(a):
    """`_log_inclusion` in float64 numpy."""
    with np.errstate(divide="ignore"):  # exp(a) underflows where a << 0: that side is a
        return np.where(a < -30.0, a, np.log(-np.expm1(-np.exp(np.minimum(a, 30.0)))))


def alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias tables (accept [V], alias [V]) for the distribution p.

    Vose's pairing, vectorized: in each round every bucket below its share (q < 1) is
    topped up by one bucket above it. The donors are picked along the cumulative excess.
    A donor can overshoot by less than one bucket, so it stays positive and goes back
    into play. Rounds are few: 579 at V = 1M under Zipf^0.75, and setup takes 0.2 s.
    """
    v = p.shape[0]
    q = p * v
    accept, alias = np.ones(v), np.arange(v)
    small, large = np.flatnonzero(q < 1.0), np.flatnonzero(q >= 1.0)
    while small.size and large.size:
        deficit = 1.0 - q[small]
        donor = np.searchsorted(np.cumsum(q[large] - 1.0), np.cumsum(deficit), side="left")
        donor = np.minimum(donor, large.size - 1)  # rounding at the very end
        accept[small], alias[small] = q[small], large[donor]
        q[large] -= np.bincount(donor, weights=deficit, minlength=large.size)
        left = q[large]
        small, large = large[left < 1.0], large[left >= 1.0]
    # Whatever is left is within rounding of one full bucket: it keeps accept = 1.
    return accept.astype(np.float32), alias.astype(np.int32)


def proposal_probs(kind: str, vocab_size: int, counts, power: float) -> np.ndarray | None:
    """q [V] float64 of a sampler (None: uniform): counts**power / sum directly wherever that
    is finite (`Frequencies.probs`: the tables of runs saved before review r2, bit for bit)."""
    if kind == "uniform":
        return None
    if kind == "log_uniform":
        if counts is not None:
            frequencies(counts, vocab_size).require_sorted("sampler='log_uniform'")
        i = np.arange(vocab_size, dtype=np.float64)
        return np.log1p(1.0 / (i + 1.0)) / np.log(vocab_size + 1.0)
    if kind == "unigram":
        freq, floor = _unigram(counts, vocab_size)
        return freq.probs(power, floor=floor)
    raise ValueError(f"sampler={kind!r} is not one of {SAMPLERS}")


def proposal_log_probs(kind: str, vocab_size: int, counts, power: float) -> np.ndarray | None:
    """log q [V] float64 of a sampler (None: uniform), finite for every id: log of
    `proposal_probs`, or computed in log space where q underflows or its powers overflow
    (review r2: counts**power overflowed float64 from power ~70, and q was NaN)."""
    if kind == "unigram":
        freq, floor = _unigram(counts, vocab_size)
        return freq.log_probs(power, floor=floor)
    q = proposal_probs(kind, vocab_size, counts, power)
    return None if q is None else np.log(q)


def _unigram(counts, vocab_size: int) -> tuple[Frequencies, float]:
    """The counts, and the floor that gives unseen ids the rarest seen id's count (so every
    log q is finite)."""
    freq = frequencies(counts, vocab_size)
    seen = freq.counts[freq.counts > 0]
    return freq, seen.min() if seen.size else 0.0


def make_sampler(kind: str, vocab_size: int, counts: Frequencies | np.ndarray | None = None,
                 power: float = 0.75) -> Sampler:
    """The sampler `kind` over `vocab_size` ids. Cached when `counts` is hashable."""
    if counts is None or isinstance(counts, Frequencies):
        return _cached_sampler(kind, vocab_size, counts, float(power))
    return _build_sampler(kind, vocab_size, counts, float(power))


def _build_sampler(kind, vocab_size, counts, power) -> Sampler:
    q = proposal_probs(kind, vocab_size, counts, power)
    if q is None:
        return Sampler(kind, vocab_size, None, None, None)
    accept, alias = alias_table(q)
    log_q = proposal_log_probs(kind, vocab_size, counts, power)
    return Sampler(kind, vocab_size, log_q.astype(np.float32), accept, alias)


_cached_sampler = functools.lru_cache(maxsize=8)(_build_sampler)


# ----------------------------------------------------------------------------- layers


class SampledObjective(VocabLayer):
    """Base of the objectives trained on sampled negatives: the sampler fields and the draw."""

    counts: Frequencies | None = None  # train counts per id (unigram; log_uniform checks sorting)
    sampler: str = "unigram"  # proposal: uniform | log_uniform (Zipf over sorted ids) | unigram
    power: float = 0.75  # unigram exponent: q ~ counts**power (word2vec's 3/4 flattens the head)
    num_samples: int = 1024  # S negatives per draw
    unique: bool = False  # draw S distinct ids (Gumbel-top-k) instead of S with replacement
    shared: bool = True  # one draw for the whole batch (Zoph et al. 2016) or one per token

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        get = lambda k: options.get(k, getattr(cls, k))  # noqa: E731
        sampler, num, unique = get("sampler"), get("num_samples"), get("unique")
        if sampler not in SAMPLERS:
            raise config_error(f"{field}.sampler", sampler, f"choose one of {list(SAMPLERS)}")
        if not isinstance(num, int) or num < 1:
            raise config_error(f"{field}.num_samples", num, "must be an integer >= 1")
        if unique and num >= vocab_size:
            raise config_error(f"{field}.num_samples", num, f"unique=True draws distinct ids, so it "
                               f"must be below model.vocab_size={vocab_size}; lower it or set "
                               f"{field}.unique=False")
        if sampler != "unigram":
            refuse_unread(options, "power", "sampler='unigram'", f"sampler={sampler!r}", field)
        power = get("power")  # review r2: inf made q = inf / inf, every loss NaN
        if (isinstance(power, bool) or not isinstance(power, (int, float)) or not power >= 0
                or not math.isfinite(power)):
            raise config_error(f"{field}.power", power, "must be a number >= 0 and finite")
        if sampler == "log_uniform" and frequency_sorted is False:
            raise config_error(f"{field}.sampler", sampler, "the log-uniform (Zipf) proposal assumes "
                               "ids ranked by frequency, and this task's ids are not (bytes); use "
                               "sampler='unigram', which reads the counts")

    def setup(self):
        super().setup()
        name = getattr(type(self), "registry_name", type(self).__name__)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"{name}: sampler={self.sampler!r}; choose one of {SAMPLERS}")
        if self.num_samples < 1:
            raise ValueError(f"{name}: num_samples={self.num_samples}; it must be >= 1")
        if self.unique and self.num_samples >= self.vocab_size:
            raise ValueError(f"{name}: unique=True draws num_samples={self.num_samples} distinct "
                             f"ids out of vocab_size={self.vocab_size}; lower num_samples below "
                             "the vocabulary size or set unique=False")
        if not 0 <= self.power < math.inf:
            raise ValueError(f"{name}: power={self.power}; it must be >= 0 and finite")
        self.proposal = make_sampler(self.sampler, self.vocab_size, self.counts, self.power)

    def negatives(self, num_tokens: int, *, deterministic: bool = True) -> Draw:
        """This step's negatives: [S] (shared) or [num_tokens, S]."""
        key = jax.random.key(0) if deterministic else self.make_rng("dropout")
        prefix = () if self.shared else (num_tokens,)
        return self.proposal.draw(key, prefix, self.num_samples, self.unique)

    def _scores(self, hidden_NE, targets_N, deterministic: bool):
        """Target scores s_T, negative scores s_TS, the draw, and hits_TS (negative == target)."""
        check_targets(targets_N, self.vocab_size, hidden_NE)
        hidden_NE = self.quant_hidden(hidden_NE)  # as `logits` reads them (found in review:
        width = hidden_NE.shape[-1]               # QAT's activations were left float here)
        hidden_TE, targets_T = hidden_NE.reshape(-1, width), targets_N.reshape(-1)
        num_tokens = targets_T.shape[0]
        draw = self.negatives(num_tokens, deterministic=deterministic)
        if not self.shared:
            s_TJ = self._per_token_scores(hidden_NE, targets_N, draw.ids)
            return s_TJ[:, 0], s_TJ[:, 1:], draw, draw.ids == targets_T[:, None]
        # One gather for targets and negatives together: its backward is one scatter-add
        # into a [V, E] gradient, not two.
        w_RE, b_R = self.rows(jnp.concatenate([targets_T, draw.ids.reshape(-1)]), width)
        s_T = _dot(hidden_TE, w_RE[:num_tokens], self.dtype) + b_R[:num_tokens].astype(jnp.float32)
        s_TS = scores(hidden_TE, w_RE[num_tokens:], b_R[num_tokens:], self.dtype)
        return s_T, s_TS, draw, draw.ids[None, :] == targets_T[:, None]

    def _per_token_scores(self, hidden_NE, targets_N, ids_TS):
        """Scores [T, 1 + S] of each token's target and its own S negatives (`shared=False`):
        each token's rows gathered, [T, 1 + S, E], over token chunks whose [C, S, E] stays
        under the automatic budget (`auto_chunk_tokens`), recomputed in the backward (review
        r8: at T = 8192 the default S = 1024 and E = 512 gathered 16 GiB at once)."""
        width, S = hidden_NE.shape[-1], self.num_samples
        rows_fn = self._rows_fn(width, targets_N.size * (1 + S))
        dtype = self.dtype

        def one_chunk(h_CE, t_C, ids_CS):
            w_CJE, b_CJ = rows_fn(jnp.concatenate([t_C[:, None], ids_CS], axis=1))  # J = 1 + S
            s_CJ = jnp.einsum("ce,cje->cj", h_CE.astype(dtype), w_CJE.astype(dtype),
                              preferred_element_type=jnp.float32)
            return s_CJ + b_CJ.astype(jnp.float32)
        chunk = auto_chunk_tokens(targets_N.size, S * width)
        s_NJ = map_token_chunks(one_chunk, targets_N.shape, chunk, hidden_NE, targets_N,
                                ids_TS.reshape(targets_N.shape + (S,)))
        return s_NJ.reshape(-1, 1 + S)

    def _per_token(self, loss_T, targets_N, mask_N):
        check_targets(targets_N, mask=mask_N)
        return masked(loss_T.reshape(targets_N.shape), mask_N)


def _dot(a_TE, b_TE, dtype):
    return jnp.einsum("te,te->t", a_TE.astype(dtype), b_TE.astype(dtype),
                      preferred_element_type=jnp.float32)


@register("sampled")
class SampledSoftmax(SampledObjective):
    """Importance-sampled softmax (Bengio & Senecal 2008; Jean et al. 2015) with log-Q correction.

    loss = log(exp(s_t) + sum_{j != t} exp(s_j - log c_j)) - s_t, where c_j is the
    expected count of negative j (S q_j, or its inclusion probability when unique).
    The target is always in the candidate set, so its count is 1 and its logit is not
    corrected. Accidental hits are dropped. Then the sum is an unbiased estimate of
    Z - exp(s_t), and as S grows the loss tends to the exact -log p(t), gradient
    included. TensorFlow's `sampled_softmax_loss` also subtracts log(S q_t) from the
    target. With the hits removed, that biases the gradient by O(p(t)) and offsets the
    loss by log(S q_t).

    Params: `table/kernel` [V, E] (absent when tied) and `table/bias` [V].
    """

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        s_T, s_TS, draw, hits_TS = self._scores(hidden_NE, targets_N, deterministic)
        corrected_TS = s_TS - (draw.log_count[None, :] if self.shared else draw.log_count)
        corrected_TS = jnp.where(hits_TS, _DROPPED, corrected_TS)
        lse_T = jnp.logaddexp(s_T, jax.nn.logsumexp(corrected_TS, axis=-1))
        return self._per_token(lse_T - s_T, targets_N, mask_N)


def _log_unigram(counts, vocab_size: int) -> np.ndarray:
    """log of the train unigram distribution smoothed by adding half the smallest seen count
    to every id's count (so unseen ids start likely, though less than any seen one)."""
    c = frequencies(counts, vocab_size).counts
    positive = c[c > 0]
    c = c + 0.5 * (positive.min() if positive.size else 1.0)
    return np.log(c / c.sum())


@register("nce")
class NCE(SampledObjective):
    """Noise-contrastive estimation (Gutmann & Hyvarinen 2010; Mnih & Teh 2012).

    Logistic loss on d(w) = s(w) - log(k q(w)) with s = h.w + b - log Z, positive for
    the target and negative for each of the k noise samples:
    loss = -log sig(d(t)) - sum_j log sig(-d(j)). At the optimum s(w) = log p(w | h), so
    the score is self-normalized. log Z is fixed (`log_normalizer`, 0 as in Mnih & Teh)
    or learned (`learn_normalizer`, one scalar). With `unique=True`, k q(w) becomes the
    inclusion probability, which is the noise density of distinct draws; the optimum is
    unchanged. Accidental hits are kept, because NCE's noise must not depend on the data.

    Params: `table/kernel` [V, E] (absent when tied), `table/bias` [V], and `log_z` []
    when learned.
    """

    log_normalizer: float = 0.0  # log Z subtracted from every score (the initial value when learned)
    learn_normalizer: bool = False  # learn log Z as a parameter

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        super().check_config(options, vocab_size=vocab_size, frequency_sorted=frequency_sorted,
                             field=field)
        z = options.get("log_normalizer", cls.log_normalizer)
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z):
            raise config_error(f"{field}.log_normalizer", z, "must be a finite number (log Z; "
                               "nan or inf made every loss NaN: a bug hunt, session 98)")

    def setup(self):
        super().setup()
        if self.learn_normalizer:
            self.log_z = self.param(
                "log_z", nn.with_logical_partitioning(nn.initializers.constant(self.log_normalizer), ()),
                (), self.param_dtype)

    def initial_bias(self):
        """Start at the context-free optimum, s(w) = log unigram(w) (+ log Z): NCE is not
        shift-invariant, and from zeros every word starts V times too likely; words that
        are rarely seen or drawn would keep that score for thousands of steps."""
        return computed_vector(lambda: _log_unigram(self.counts, self.vocab_size) + self.log_normalizer)

    def normalizer(self):
        return (self.log_z.astype(jnp.float32) if self.learn_normalizer
                else jnp.float32(self.log_normalizer))

    def self_normalized_log_prob(self, hidden_NE):
        """s = h.w + b - log Z for every id: the log-probabilities NCE trains unnormalized."""
        return self.logits(hidden_NE) - self.normalizer()

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        s_T, s_TS, draw, hits_TS = self._scores(hidden_NE, targets_N, deterministic)
        log_z = self.normalizer()
        log_count_T = self.proposal.log_count(targets_N.reshape(-1), draw, self.num_samples,
                                              in_sample=jnp.any(hits_TS, axis=-1))
        noise_TS = draw.log_count[None, :] if self.shared else draw.log_count
        d_T = s_T - log_z - log_count_T
        d_TS = s_TS - log_z - noise_TS
        loss_T = jax.nn.softplus(-d_T) + jnp.sum(jax.nn.softplus(d_TS), axis=-1)
        return self._per_token(loss_T, targets_N, mask_N)


@register("negative_sampling")
class NegativeSampling(SampledObjective):
    """word2vec's negative sampling (Mikolov et al. 2013): -log sig(s_t) - sum_j log sig(-s_j).

    This is NCE without the log(k q) correction, with unigram^0.75 noise. Accidental hits
    are skipped, as in word2vec. It is not a consistent estimator of the softmax: at the
    optimum s(w) = log(p(w | h) / (k q(w))), so the full softmax that `log_prob` evaluates
    is proportional to p / q rather than p.

    Params: `table/kernel` [V, E] (absent when tied) and `table/bias` [V].
    """

    num_samples: int = 64  # word2vec uses 5-20 per token; shared across a batch, a few more

    def initial_bias(self):
        """Start at the context-free optimum, s(w) = log(unigram(w) / c(w)) (see NCE), c(w)
        w's expected count among the negatives: k q(w) with replacement; with `unique=True`
        its inclusion probability pi(w) <= 1 (review r8: k q(w) there too, which passes 1 for
        frequent ids and started byte_lm's space 1.2 nats low at k = 64), by
        `inclusion_log_probs`' approximation; the uniform sampler's is exact, k / V = k q."""
        def values():
            s = make_sampler(self.sampler, self.vocab_size, self.counts, self.power)
            if self.unique and s.log_q is not None:
                log_count = inclusion_log_probs(s.log_q.astype(np.float64), self.num_samples)
            else:
                q = s.probs()
                with np.errstate(divide="ignore"):
                    log_count = np.log(self.num_samples * q)
                if s.log_q is not None:  # q = exp(log q) underflows to 0 at a large power
                    log_count = np.where(q > 0, log_count,
                                         np.log(self.num_samples) + s.log_q.astype(np.float64))
            return _log_unigram(self.counts, self.vocab_size) - log_count
        return computed_vector(values)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        s_T, s_TS, _, hits_TS = self._scores(hidden_NE, targets_N, deterministic)
        noise_TS = jnp.where(hits_TS, 0.0, jax.nn.softplus(s_TS))
        loss_T = jax.nn.softplus(-s_T) + jnp.sum(noise_TS, axis=-1)
        return self._per_token(loss_T, targets_N, mask_N)


@register("hard_negative")
class HardNegative(VocabLayer):
    """Margin loss against the K hardest negatives: sum_k max(0, margin - s_t + s_k).

    The negatives are the K highest-scoring non-target ids over the whole vocabulary.
    They come from `jax.lax.top_k`, or from `jax.lax.approx_max_k` (Chern et al. 2022)
    with `approximate=True`; on CPU and GPU that is exact. The search runs under
    stop_gradient, so only the K chosen rows are differentiated. The forward is
    O(N x V) by nature, since finding the top K needs every score. It is chunked over
    tokens like `full`'s loss, so memory stays O(chunk x V).

    Params: `table/kernel` [V, E] (absent when tied) and `table/bias` [V].
    """

    layout_options: ClassVar[frozenset] = frozenset({"chunk_tokens"})  # (`base.layout_options`)

    num_negatives: int = 10  # K
    margin: float = 1.0
    approximate: bool = False  # jax.lax.approx_max_k instead of jax.lax.top_k
    recall_target: float = 0.95  # approx_max_k's recall target
    chunk_tokens: int = -1  # tokens per search chunk; -1 = auto (as `full`), 0 = never

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        k = options.get("num_negatives", cls.num_negatives)
        if not isinstance(k, int) or not 1 <= k < vocab_size:
            raise config_error(f"{field}.num_negatives", k, f"must be an integer in [1, "
                               f"model.vocab_size={vocab_size})")
        # a bug hunt: recall_target 5.0 (or 0) failed in the train step's compile, a 95-line
        # XLA error, after the workdir was written; a negative margin was taken
        if not options.get("approximate", cls.approximate):
            refuse_unread(options, "recall_target", "approximate=True", "approximate=False",
                          field)
        r = options.get("recall_target", cls.recall_target)
        margin = options.get("margin", cls.margin)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise config_error(f"{field}.recall_target", r, "must be a number in (0, 1] "
                               "(approx_max_k's recall target, e.g. 0.95)")
        if (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0
                or not math.isfinite(margin)):  # review r2: inf made every loss inf
            raise config_error(f"{field}.margin", margin, "must be a number >= 0 and finite")

    def setup(self):
        super().setup()
        if not 1 <= self.num_negatives < self.vocab_size:
            raise ValueError(f"hard_negative: num_negatives={self.num_negatives}; it must be in "
                             f"[1, vocab_size={self.vocab_size})")

    def hardest(self, hidden_NE, targets_N):
        """ids [N, K] of the K highest-scoring ids other than the target (no gradient)."""
        from hpnlp.compress.qlinear import Factored
        width = hidden_NE.shape[-1]
        stored, bias_V = self._stored(width)
        if isinstance(stored, Factored):  # model.lowrank: through the rank, as `full`'s chunks
            # (review r8: the search multiplied out the [V, E] table)
            score_fn = factored_logits(*jax.lax.stop_gradient((stored, bias_V)), self.dtype)
        else:
            kernel_VE, bias_V = jax.lax.stop_gradient(self._decoded(stored, bias_V, width))
            score_fn = lambda h_CE: scores(h_CE, kernel_VE, bias_V, self.dtype)  # noqa: E731
        num_tokens = targets_N.size
        chunk = auto_chunk_tokens(num_tokens, self.vocab_size) if self.chunk_tokens < 0 else self.chunk_tokens

        def search(h_CE, t_C):
            s_CV = score_fn(h_CE)
            # int32 (a review, session 118: in the targets' dtype, a uint8 range past 255
            # wrapped, and ids 256.. matched targets 0..)
            ids_V = jnp.arange(self.vocab_size, dtype=jnp.int32)
            s_CV = jnp.where(ids_V[None, :] == t_C[:, None].astype(jnp.int32), -jnp.inf, s_CV)
            if self.approximate:
                return jax.lax.approx_max_k(s_CV, self.num_negatives,
                                            recall_target=self.recall_target)[1]
            return jax.lax.top_k(s_CV, self.num_negatives)[1]

        return map_token_chunks(search, targets_N.shape, chunk, jax.lax.stop_gradient(hidden_NE),
                                targets_N, remat=False)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        del deterministic  # the search is deterministic
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        hidden_NE = self.quant_hidden(hidden_NE)  # as `logits` reads them (found in review)
        width = hidden_NE.shape[-1]
        ids_TK = self.hardest(hidden_NE, targets_N).reshape(-1, self.num_negatives)
        hidden_TE, targets_T = hidden_NE.reshape(-1, width), targets_N.reshape(-1)
        ids_TJ = jnp.concatenate([targets_T[:, None], ids_TK], axis=1)  # J = 1 + K
        w_TJE, b_TJ = self.rows(ids_TJ, width)
        s_TJ = jnp.einsum("te,tje->tj", hidden_TE.astype(self.dtype), w_TJE.astype(self.dtype),
                          preferred_element_type=jnp.float32) + b_TJ.astype(jnp.float32)
        loss_T = jnp.sum(jax.nn.relu(self.margin - s_TJ[:, :1] + s_TJ[:, 1:]), axis=-1)
        return masked(loss_T.reshape(targets_N.shape), mask_N)
