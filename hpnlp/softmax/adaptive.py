"""`adaptive`: adaptive softmax (Grave et al. 2017, "Efficient softmax approximation for GPUs").

Ids sorted by descending frequency are split by `cutoffs` into a head, the shortlist of
frequent ids plus one logit per tail cluster, and tail clusters of rarer ids:

    log p(w) = log softmax(head)[w]                                          w < cutoffs[0]
    log p(w) = log softmax(head)[cutoffs[0] + i] + log softmax(tail_i)[w - lo_i]   w in tail i

Tail cluster i scores through a low-rank map E -> E / div_value^(i+1) -> its size, so rare
ids get few parameters, and a token pays for the head plus its own cluster only. The
semantics (parameter shapes, head layout, projection widths) are PyTorch's
`nn.AdaptiveLogSoftmaxWithLoss`, so weights copy across.

The idea that makes it fast: most tokens are frequent, so they need only the small head,
and the rest need one cluster each. Shapes in JAX are static, so the loss sorts the tokens
by cluster (one argsort of the cluster ids) and, for each tail cluster, walks only its
contiguous run of sorted tokens in fixed-size chunks (`chunk_logits` tail logits each,
sized by backend: `default_chunk_logits`) with a `lax.fori_loop` whose trip
count is the cluster's token count (dynamic): the work is proportional to the tokens in
the cluster, as with PyTorch's gather, not N x cluster size. A dynamic loop has no
automatic reverse mode, so the cluster loss carries its own gradient (`custom_vjp`): the
backward walks the same chunks, recomputes each chunk's logits (saving only the per-token
log-sum-exp) and accumulates the weight gradients in the loop carry. Padded tokens get a
cluster id past the last one, so they do no tail work. `mode="dense"` is the exact twin:
every token through every cluster, masked.

Default cutoffs (`cutoffs=None`) come from the layer's counts (Zipf over frequency-sorted
ids when none): the shortlist is the smallest id set covering 60% of the training tokens,
and the tails split the rest where the mass reaches 80% and 90% (rounded to two
significant digits). Most tokens then pay only for the head, as the paper intends, and
each tail serves a tenth to a fifth of them; under Zipf that is (1400, 19000, 71000) at
V=262K and (3300, 58000, 250000) at V=1M.

Shape letters: N any leading dims, T flattened tokens, P sorted tokens padded by a chunk,
C tokens per chunk, E hidden width, H head size (shortlist + clusters), D a tail
projection width, S a tail cluster's size, V vocabulary.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import config_error
from hpnlp.softmax.base import (Frequencies, check_targets, frequencies, masked, refuse_unread,
                                register)

def _valid_cutoffs(cuts: tuple, vocab_size: int) -> bool:
    """Strictly increasing integers in (0, vocab_size)."""
    # a bug hunt (session 100): "a", None or [1] crashed int() and True passed as 1
    def integral(c):  # (review: np.isfinite of an int past float64's range raised)
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real):
            return False
        return isinstance(c, numbers.Integral) or (math.isfinite(c) and int(c) == c)
    if not all(integral(c) for c in cuts):
        return False
    return not (list(cuts) != sorted(set(cuts))
                or (cuts and (cuts[0] <= 0 or cuts[-1] >= vocab_size)))


DEFAULT_MASS = (0.6, 0.8, 0.9)  # default cutoffs: the head covers 60% of tokens, the tails split the rest


def default_cutoffs(freqs: Frequencies) -> tuple[int, ...]:
    """Ids below which the token mass first reaches each of DEFAULT_MASS, to 2 significant digits."""
    cum = np.cumsum(freqs.probs())
    cuts: list[int] = []
    for mass in DEFAULT_MASS:
        c = int(np.searchsorted(cum, mass * cum[-1])) + 1  # smallest c with P(id < c) >= mass
        c = int(float(f"{c:.2g}"))
        if c < freqs.vocab_size and (not cuts or c > cuts[-1]):
            cuts.append(c)
    return tuple(cuts)


class _AdaptiveParams(nn.Module):
    """Head [E, H] (+ bias [H]) and per tail cluster (projection [E, D], output [D, S])."""

    bounds: tuple[int, ...]  # (cutoffs..., V)
    div_value: float
    head_bias: bool
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, width: int):
        init = nn.initializers.lecun_normal()
        num_tail = len(self.bounds) - 1
        head_size = self.bounds[0] + num_tail
        head = self.param("head_kernel", nn.with_logical_partitioning(init, ("embed", "vocab")),
                          (width, head_size), self.param_dtype)
        bias = None
        if self.head_bias:
            bias = self.param("head_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                              (head_size,), self.param_dtype)
        tails = []
        for i in range(num_tail):
            # PyTorch's width, but at least 1 (PyTorch would build a 0-wide map, a uniform cluster)
            proj_width = max(1, int(width // (self.div_value ** (i + 1))))
            size = self.bounds[i + 1] - self.bounds[i]
            proj = self.param(f"tail{i}_proj", nn.with_logical_partitioning(init, ("embed", None)),
                              (width, proj_width), self.param_dtype)
            out = self.param(f"tail{i}_out", nn.with_logical_partitioning(init, (None, "vocab")),
                             (proj_width, size), self.param_dtype)
            tails.append((proj, out))
        return head, bias, tails


@register("adaptive")
class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax: a frequent-id head plus low-rank tail clusters; loss = -log p(target).

    Params: `params/head_kernel` [E, cutoffs[0] + clusters], `params/head_bias` (with
    `head_bias`), `params/tail{i}_proj` [E, E // div_value^(i+1)], `params/tail{i}_out`
    [that, cluster size]. Requires ids sorted by frequency.
    """

    trains_nll: ClassVar[bool] = True
    # the sorted tail and its dense twin read the same parameters (`base.layout_options`)
    layout_options: ClassVar[frozenset] = frozenset({"mode", "chunk_logits"})

    vocab_size: int = 0
    cutoffs: tuple[int, ...] | None = None  # increasing, in (0, V); None: cost-model default
    div_value: float = 4.0  # tail i projects to max(1, E // div_value^(i+1))
    head_bias: bool = False  # PyTorch's default
    counts: Frequencies | None = None  # train counts per id; None: Zipf over sorted ids
    mode: str = "sorted"  # "sorted": tail work per token of the cluster; "dense": exact twin
    # float32 tail logits per chunk (chunk tokens = this // cluster size); None: by backend,
    # `default_chunk_logits()`
    chunk_logits: int | None = None
    dtype: jnp.dtype = jnp.float32  # matmul input dtype; logits and losses are float32
    param_dtype: jnp.dtype = jnp.float32

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        if frequency_sorted is False:
            raise config_error("output.name", "adaptive", "its cutoffs split ids by frequency, and "
                               "this task's ids are not ranked by frequency (bytes); use a task "
                               "with frequency-sorted ids (data.task='word_lm') or another output "
                               "layer (e.g. 'full', 'hierarchical')")
        mode = options.get("mode", cls.mode)
        if mode not in ("sorted", "dense"):
            raise config_error(f"{field}.mode", mode, "choose 'sorted' or 'dense'")
        div = options.get("div_value", cls.div_value)
        if (isinstance(div, bool) or not isinstance(div, numbers.Real) or not math.isfinite(div)
                or div <= 0):  # (a review, session 115: inf made every tail 1 wide)
            raise config_error(f"{field}.div_value", div, "must be a finite number > 0")
        if mode == "dense":
            refuse_unread(options, "chunk_logits", "mode='sorted'", "mode='dense'", field)
        chunk = options.get("chunk_logits", cls.chunk_logits)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):  # a bug hunt: checked at the model's init
            raise config_error(f"{field}.chunk_logits", chunk, "must be an integer >= 1 (float32 "
                               "tail logits per chunk), or None to choose by backend")
        cuts = options.get("cutoffs")
        if cuts is not None:
            if not isinstance(cuts, (list, tuple)):  # a README walk: one int was a TypeError
                raise config_error(f"{field}.cutoffs", cuts, "must be a list of increasing "
                                   "integers, e.g. [2000, 10000] (one cutoff: [2000])")
            cuts = tuple(cuts)
            if not _valid_cutoffs(cuts, vocab_size):
                raise config_error(f"{field}.cutoffs", cuts, "must be strictly increasing integers "
                                   f"in (0, model.vocab_size={vocab_size})")

    def setup(self):
        V = self.vocab_size
        if V <= 0:
            raise ValueError(f"AdaptiveSoftmax needs vocab_size > 0; got {V}")
        freqs = frequencies(self.counts, V)
        if self.counts is not None:
            freqs.require_sorted("adaptive softmax (cutoffs split ids by frequency)")
        if self.mode not in ("sorted", "dense"):
            raise ValueError(f"adaptive: mode={self.mode!r}; choose 'sorted' or 'dense'")
        if not self.div_value > 0:
            raise ValueError(f"adaptive: div_value={self.div_value} must be > 0")
        if self.chunk_logits is not None and self.chunk_logits < 1:
            raise ValueError(f"adaptive: chunk_logits={self.chunk_logits} must be >= 1")
        cuts = default_cutoffs(freqs) if self.cutoffs is None else self.cutoffs
        cuts = tuple(cuts)
        if not _valid_cutoffs(cuts, V):
            raise ValueError(f"adaptive: cutoffs={cuts} must be strictly increasing integers in "
                             f"(0, vocab_size={V}), e.g. (2000, 10000, 50000) for a large vocabulary")
        self.bounds = tuple(int(c) for c in cuts) + (V,)
        self.table = _AdaptiveParams(self.bounds, float(self.div_value), self.head_bias,
                                     self.param_dtype)

    def _head_log_prob(self, hidden_TE, head_EH, bias_H):
        logits_TH = jnp.dot(hidden_TE.astype(self.dtype), head_EH.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        if bias_H is not None:
            logits_TH = logits_TH + bias_H.astype(jnp.float32)[None, :]
        return jax.nn.log_softmax(logits_TH, axis=-1)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        del deterministic  # exact loss, no randomness
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        lead, width = targets_N.shape, hidden_NE.shape[-1]
        head_EH, bias_H, tails = self.table(width)
        h_TE = hidden_NE.reshape(-1, width)
        t_T = targets_N.reshape(-1).astype(jnp.int32)
        num_tail = len(tails)
        shortlist = self.bounds[0]
        # 0: head, i + 1: tail cluster i
        cluster_T = jnp.searchsorted(jnp.asarray(self.bounds[:-1], jnp.int32), t_T, side="right")
        cluster_T = cluster_T.astype(jnp.int32)
        head_idx_T = jnp.where(cluster_T == 0, t_T, shortlist + cluster_T - 1)
        head_lp_TH = self._head_log_prob(h_TE, head_EH, bias_H)
        nll_T = -jnp.take_along_axis(head_lp_TH, head_idx_T[:, None], axis=-1)[:, 0]
        if num_tail:
            if mask_N is not None:  # padding: a cluster id no loop visits
                cluster_T = jnp.where(mask_N.reshape(-1), cluster_T, num_tail + 1)
            tail = _sorted_tail_nll if self.mode == "sorted" else _dense_tail_nll
            nll_T = nll_T + tail(h_TE, t_T, cluster_T, tails, self.bounds, dtype=self.dtype,
                                 chunk_logits=(default_chunk_logits() if self.chunk_logits is None
                                               else self.chunk_logits))
        return masked(nll_T.reshape(lead), mask_N)

    def log_prob(self, hidden_NE):
        lead, width = hidden_NE.shape[:-1], hidden_NE.shape[-1]
        head_EH, bias_H, tails = self.table(width)
        h_TE = hidden_NE.reshape(-1, width)
        head_lp_TH = self._head_log_prob(h_TE, head_EH, bias_H)
        shortlist = self.bounds[0]
        parts = [head_lp_TH[:, :shortlist]]
        for i, (proj_ED, out_DS) in enumerate(tails):
            lp_TS = jax.nn.log_softmax(_tail_logits(h_TE, proj_ED, out_DS, self.dtype), axis=-1)
            parts.append(head_lp_TH[:, shortlist + i, None] + lp_TS)
        return jnp.concatenate(parts, axis=-1).reshape(lead + (self.vocab_size,))

    def top_k(self, hidden_NE, k: int):
        return jax.lax.top_k(self.log_prob(hidden_NE), k)

    def __call__(self, hidden_NE):
        return self.log_prob(hidden_NE)


def _tail_logits(h_CE, proj_ED, out_DS, dtype):
    x_CD = jnp.dot(h_CE.astype(dtype), proj_ED.astype(dtype), preferred_element_type=jnp.float32)
    return jnp.dot(x_CD.astype(dtype), out_DS.astype(dtype), preferred_element_type=jnp.float32)


def _dense_tail_nll(h_TE, t_T, cluster_T, tails, bounds, *, dtype, chunk_logits):
    """Exact twin: every token through every cluster, the wrong clusters masked out."""
    del chunk_logits
    nll_T = jnp.zeros(t_T.shape, jnp.float32)
    for i, (proj_ED, out_DS) in enumerate(tails):
        lp_TS = jax.nn.log_softmax(_tail_logits(h_TE, proj_ED, out_DS, dtype), axis=-1)
        rel_T = jnp.clip(t_T - bounds[i], 0, bounds[i + 1] - bounds[i] - 1)
        picked_T = jnp.take_along_axis(lp_TS, rel_T[:, None], axis=-1)[:, 0]
        nll_T = nll_T - jnp.where(cluster_T == i + 1, picked_T, 0.0)
    return nll_T


CPU_CHUNK_LOGITS = 1 << 21  # 8 MiB of float32 logits: a chunk's working set stays in cache
ACCELERATOR_CHUNK_LOGITS = 1 << 26  # 256 MiB: few, large steps keep a GPU busy


def default_chunk_logits(backend: str | None = None) -> int:
    """Tail logits per chunk for `backend` (default: JAX's default backend).

    The chunk loop runs its steps one after another. On a CPU a cache-sized chunk is
    fastest; on a GPU each step must be large enough to fill the device: with the CPU's
    2^21 the H200 took 15.0 ms at V=262K and 71.9 ms at V=1M (PyTorch's adaptive
    softmax: 6.8, 20.0), with 2^26 6.66 and 19.4 (`docs/benchmarks/softmax_h200_chunk_logits`).
    The default backend, not the device a computation is placed on: a CPU program on a GPU
    machine gets the large chunks unless `chunk_logits` is set.
    """
    backend = backend or jax.default_backend()
    return CPU_CHUNK_LOGITS if backend == "cpu" else ACCELERATOR_CHUNK_LOGITS


def chunk_tokens(cluster_size: int, num_tokens: int, chunk_logits: int) -> int:
    """Tokens per tail chunk: a power of two with chunk x size <= chunk_logits, at most ~T."""
    c = max(1, chunk_logits // cluster_size)
    c = 1 << (c.bit_length() - 1)
    return max(1, min(c, 1 << max(0, (num_tokens - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("bounds", "dtype", "chunk_logits"))
def _sorted_tail_nll(h_TE, t_T, cluster_T, tails, bounds, *, dtype, chunk_logits):
    """Tail -log p(target | cluster), cost proportional to the tokens in each cluster."""
    num_tokens, width = h_TE.shape
    num_tail = len(tails)
    chunks = [chunk_tokens(bounds[i + 1] - bounds[i], num_tokens, chunk_logits)
              for i in range(num_tail)]
    pad = max(chunks)
    order_T = jnp.argsort(cluster_T, stable=True)
    sizes = jnp.bincount(cluster_T, length=num_tail + 2).astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    h_PE = jnp.pad(h_TE[order_T], ((0, pad), (0, 0)))
    t_P = jnp.pad(t_T[order_T], (0, pad))
    nll_P = jnp.zeros((num_tokens + pad,), jnp.float32)
    for i, (proj_ED, out_DS) in enumerate(tails):
        rel_P = jnp.clip(t_P - bounds[i], 0, bounds[i + 1] - bounds[i] - 1)
        nll_P = nll_P + _cluster_nll(chunks[i], dtype, h_PE, rel_P, starts[i + 1], sizes[i + 1],
                                     proj_ED, out_DS)
    return jnp.zeros((num_tokens,), jnp.float32).at[order_T].set(nll_P[:num_tokens])


def _chunk(j, chunk, start, count, *arrays):
    """Rows [start + j*chunk, +chunk) of each array, and which of them lie in the cluster."""
    pos = start + j * chunk
    valid_C = j * chunk + jnp.arange(chunk) < count
    return pos, valid_C, [jax.lax.dynamic_slice_in_dim(a, pos, chunk) for a in arrays]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cluster_nll(chunk, dtype, h_PE, rel_P, start, count, proj_ED, out_DS):
    """-log softmax(h proj out)[rel] for sorted rows [start, start + count), zero elsewhere."""
    return _cluster_fwd(chunk, dtype, h_PE, rel_P, start, count, proj_ED, out_DS)[0]


def _cluster_fwd(chunk, dtype, h_PE, rel_P, start, count, proj_ED, out_DS):
    def body(j, carry):
        nll_P, lse_P = carry
        pos, valid_C, (h_CE, rel_C) = _chunk(j, chunk, start, count, h_PE, rel_P)
        logits_CS = _tail_logits(h_CE, proj_ED, out_DS, dtype)
        lse_C = jax.nn.logsumexp(logits_CS, axis=-1)
        picked_C = jnp.take_along_axis(logits_CS, rel_C[:, None], axis=-1)[:, 0]
        nll_P = _add_rows(nll_P, pos, jnp.where(valid_C, lse_C - picked_C, 0.0))
        lse_P = _add_rows(lse_P, pos, jnp.where(valid_C, lse_C, 0.0))
        return nll_P, lse_P

    zeros_P = jnp.zeros(rel_P.shape, jnp.float32)
    trips = (count + chunk - 1) // chunk
    nll_P, lse_P = jax.lax.fori_loop(0, trips, body, (zeros_P, zeros_P))
    return nll_P, (h_PE, rel_P, start, count, proj_ED, out_DS, lse_P)


def _cluster_bwd(chunk, dtype, res, g_P):
    h_PE, rel_P, start, count, proj_ED, out_DS, lse_P = res

    def body(j, carry):
        dh_PE, dproj_ED, dout_DS = carry
        pos, valid_C, (h_CE, rel_C, lse_C, g_C) = _chunk(j, chunk, start, count,
                                                         h_PE, rel_P, lse_P, g_P)
        x_CD = jnp.dot(h_CE.astype(dtype), proj_ED.astype(dtype), preferred_element_type=jnp.float32)
        logits_CS = jnp.dot(x_CD.astype(dtype), out_DS.astype(dtype), preferred_element_type=jnp.float32)
        # rows past the cluster (the next cluster's tokens, padding) have lse 0 saved and
        # untrained tail logits: exp could be inf there, and inf * 0 NaN (review r2)
        prob_CS = jnp.where(valid_C[:, None], jnp.exp(logits_CS - lse_C[:, None]), 0.0)
        hit_CS = jnp.arange(logits_CS.shape[1])[None, :] == rel_C[:, None]
        g_C = jnp.where(valid_C, g_C, 0.0)
        dlogits_CS = (jnp.where(hit_CS, prob_CS - 1.0, prob_CS) * g_C[:, None]).astype(dtype)
        dout_DS = dout_DS + jnp.dot(x_CD.astype(dtype).T, dlogits_CS, preferred_element_type=jnp.float32)
        dx_CD = jnp.dot(dlogits_CS, out_DS.astype(dtype).T, preferred_element_type=jnp.float32)
        dproj_ED = dproj_ED + jnp.dot(h_CE.astype(dtype).T, dx_CD.astype(dtype),
                                      preferred_element_type=jnp.float32)
        dh_CE = jnp.dot(dx_CD.astype(dtype), proj_ED.astype(dtype).T, preferred_element_type=jnp.float32)
        return _add_rows(dh_PE, pos, dh_CE), dproj_ED, dout_DS

    init = (jnp.zeros(h_PE.shape, jnp.float32), jnp.zeros(proj_ED.shape, jnp.float32),
            jnp.zeros(out_DS.shape, jnp.float32))
    trips = (count + chunk - 1) // chunk
    dh_PE, dproj_ED, dout_DS = jax.lax.fori_loop(0, trips, body, init)
    return (dh_PE.astype(h_PE.dtype), None, None, None, dproj_ED.astype(proj_ED.dtype),
            dout_DS.astype(out_DS.dtype))


_cluster_nll.defvjp(_cluster_fwd, _cluster_bwd)


def _add_rows(x, pos, rows):
    """x[pos : pos + len(rows)] += rows (chunks of neighbouring clusters may overlap)."""
    cur = jax.lax.dynamic_slice_in_dim(x, pos, rows.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(x, cur + rows.astype(x.dtype), pos, axis=0)
