"""Registry of output layers and the pieces they share (see `hpnlp.softmax`).

Shape letters: N any leading dims (tokens), E hidden width, V vocabulary, S samples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.registry import Registry

_REGISTRY = Registry("output layer")
register = _REGISTRY.register
names = _REGISTRY.names
get = _REGISTRY.get


def check_config(name: str, options, *, vocab_size: int, frequency_sorted: bool | None,
                 field: str = "output.options") -> None:
    """Config-time checks of output layer `name` with `options` (run by `config.validate`
    before anything is built): a layer class may define
    `check_config(options, *, vocab_size, frequency_sorted, field)` raising ConfigError.
    `frequency_sorted`: whether the task's ids are ranked by frequency (None: unknown).
    Every layer that chunks over tokens (`chunk_tokens`) takes the same values, checked here
    (a bug hunt: hard_negative, class_based and hierarchical took -7 as -1)."""
    from hpnlp.config import config_error
    cls, options = get(name), dict(options)
    chunk = options.get("chunk_tokens", -1)
    if "chunk_tokens" in {f.name for f in dataclasses.fields(cls)} and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < -1):
        raise config_error(f"{field}.chunk_tokens", chunk, "must be an integer >= -1 (-1: "
                           "chunk automatically, 0: never)")
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(options, vocab_size=vocab_size, frequency_sorted=frequency_sorted, field=field)


def refuse_unread(options, name: str, reader: str, setting: str,
                  field: str = "output.options") -> None:
    """A ConfigError where `options` gives `name`, which only `reader` (e.g. "mode='ecc'")
    reads and this config's `setting` (e.g. "mode='plain'") does not: a bug hunt (session
    98) found such options taken, even out of range, and changing nothing."""
    from hpnlp.config import config_error
    if name in options:
        raise config_error(f"{field}.{name}", options[name], f"only {reader} reads it, and "
                           f"this config has {setting}; drop it")


def can_tie(name: str) -> bool:
    """Whether output layer `name` can use the input embedding as its table (an `embed` field)."""
    return "embed" in {f.name for f in dataclasses.fields(get(name))}


def trains_nll(name: str) -> bool:
    """Whether output layer `name`'s training `loss` is -log p(target) under its `log_prob`
    (its class's `trains_nll`; a layer that does not say is taken not to), so that exp of
    the training loss is a perplexity: not for sampled estimates, margins, logistic or
    bitwise objectives, nor a continuous output's (review r2: train lines read vmf's e^50)."""
    return bool(getattr(get(name), "trains_nll", False))


def layout_options(name: str) -> frozenset:
    """The options of output layer `name` that set only how its loss is computed (a chunk
    size, an exact twin): its class's `layout_options`, none where it says none. Neither a
    parameter's shape nor the loss beyond float rounding depends on them, so a resume may
    change them (hpnlp.train.checkpoint; review r3: another `chunk_tokens`, set to fit
    memory, was refused as a different model). Empty for a name not registered (an edited
    config.json's: the resume's check names it)."""
    try:
        return frozenset(getattr(get(name), "layout_options", ()))
    except (ValueError, TypeError):
        return frozenset()


def nll_and_argmax(layer, hidden_NE, targets_N):
    """(-log p(target) [N] float32, the most likely id [N] int32) of each token under
    `layer`'s `log_prob`, what evaluation reads: `layer.nll_and_argmax` where the layer has
    it (over token chunks, never the whole [N, V] where it would not fit: the VocabLayers,
    vmf), else read off the whole `log_prob` [N, V] (adaptive, hierarchical, binary_code:
    hierarchical's loss chunks over tokens, adaptive's its tail clusters, binary_code's needs
    no chunks ([N, bits]); their evaluation does not chunk yet)."""
    own = getattr(layer, "nll_and_argmax", None)
    if own is not None:
        return own(hidden_NE, targets_N)
    return log_prob_nll_and_argmax(layer.log_prob(hidden_NE), targets_N)


def log_prob_nll_and_argmax(logp_NV, targets_N):
    """`nll_and_argmax` read off log-probabilities [N, V]."""
    nll_N = -jnp.take_along_axis(logp_NV, targets_N[..., None], axis=-1)[..., 0]
    return nll_N, jnp.argmax(logp_NV, axis=-1).astype(jnp.int32)


def logits_nll_and_argmax(logits_NV, targets_N):
    """`nll_and_argmax` of a softmax of float32 `logits_NV`: logsumexp - logit[target], and
    the argmax (that of the log-probabilities too)."""
    lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
    picked_N = jnp.take_along_axis(logits_NV, targets_N[..., None], axis=-1)[..., 0]
    return lse_N - picked_N, jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)


def check_targets(targets, vocab_size: int | None = None, hidden=None, mask=None) -> None:
    """Targets must be integer ids in [0, vocab_size), one per hidden state ([*N] for
    `hidden` [*N, E]), and `mask` (where given) of the targets' shape.

    The dtype and shapes are checked always; the range whenever the values are concrete
    (eager calls, tests, notebooks). Inside `jit` the data layer has already checked every id.
    """
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
    if hidden is not None and tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, but hidden states "
                         f"{tuple(hidden.shape)} need one per state: shape "
                         f"{tuple(hidden.shape[:-1])}")
    if mask is not None and tuple(jnp.shape(mask)) != tuple(targets.shape):
        raise ValueError(f"mask has shape {tuple(jnp.shape(mask))}; it must match the targets' "
                         f"{tuple(targets.shape)} (or be None: no padding)")
    if vocab_size is None or isinstance(targets, jax.core.Tracer):
        return
    t = np.asarray(targets)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        bad = t[(t < 0) | (t >= vocab_size)].ravel()[0]
        raise ValueError(f"target id {int(bad)} is outside the vocabulary [0, {vocab_size}); "
                         "check model.vocab_size against the data's vocabulary")


def masked(loss_N, mask_N):
    """Zero the loss where `mask_N` is False (padding); `mask_N=None` keeps every token."""
    return loss_N if mask_N is None else jnp.where(mask_N, loss_N, 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class Frequencies:
    """Training counts per token id, `counts[V]`, for the frequency-based methods.

    Held by a Module field, so it hashes by identity (the array can be a million long).
    `Frequencies.zipf(V)` stands in when no counts are known: it assumes ids are sorted
    by frequency, as word vocabularies usually are (and hpnlp's `word_lm` is).
    """

    counts: np.ndarray  # [V] float64, >= 0

    @classmethod
    def of(cls, counts, vocab_size: int) -> "Frequencies":
        c = np.asarray(counts, np.float64)
        if c.shape != (vocab_size,):
            raise ValueError(f"token counts have shape {c.shape}; the output layer has "
                             f"vocab_size={vocab_size}, so they must have shape ({vocab_size},)")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise ValueError("token counts must be finite and >= 0")
        return cls(c)

    @classmethod
    def zipf(cls, vocab_size: int) -> "Frequencies":
        return cls(1.0 / np.arange(1, vocab_size + 1, dtype=np.float64))

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[0])

    @functools.cached_property
    def digest(self) -> bytes:
        """Hash of the counts' content (computed once), for caches keyed by content."""
        return hashlib.blake2b(self.counts.tobytes(), digest_size=16).digest()

    def is_sorted(self) -> bool:
        """True when id 0 is the most frequent and counts never increase with the id."""
        return bool(np.all(np.diff(self.counts) <= 0))

    def require_sorted(self, who: str) -> None:
        if not self.is_sorted():
            first = int(np.argmax(np.diff(self.counts) > 0))
            raise ValueError(
                f"{who} assumes token ids sorted by descending frequency, but id {first + 1} "
                f"(count {self.counts[first + 1]:.0f}) is more frequent than id {first} (count "
                f"{self.counts[first]:.0f}); renumber the vocabulary by frequency (hpnlp's "
                "word_lm already is) or pick a method that reads the counts themselves")

    def probs(self, power: float = 1.0, floor: float = 0.0) -> np.ndarray:
        """counts**power normalized; `floor` (a count) keeps unseen ids reachable.

        Directly, c**power / sum, wherever that is finite (bit for bit what the layers built
        on it read before review r2: class bins, adaptive cutoffs, sampler tables), else in
        log space (review r2: counts**power in float64 overflowed from power ~70 on the
        shipped word counts, inf / inf = NaN); a count of 0 keeps probability 0 (power > 0;
        counts**0 is 1 for every id)."""
        p = self._direct(power, floor)
        if p is not None:
            return p
        lp = self._shifted_log(power, floor)
        p = np.exp(lp)  # max(lp) = 0: the largest is 1, the sum in [1, V]
        return p / p.sum()

    def log_probs(self, power: float = 1.0, floor: float = 0.0) -> np.ndarray:
        """log of `probs(power, floor)`, without its underflow: finite for every id whose
        count (or `floor`) is > 0, however small its probability (np.log of the direct
        probabilities where each of those is > 0, else computed in log space)."""
        p = self._direct(power, floor)
        if p is not None and np.all((p > 0) | (np.maximum(self.counts, floor) == 0)):
            with np.errstate(divide="ignore"):  # a zero count: log 0 = -inf, as in log space
                return np.log(p)
        lp = self._shifted_log(power, floor)
        return lp - np.log(np.exp(lp).sum())

    def _direct(self, power: float, floor: float) -> np.ndarray | None:
        """c**power / its sum, or None where the powers overflow (or underflow to a zero
        sum from counts > 0): `_shifted_log`'s then."""
        _check_power(power)
        with np.errstate(over="ignore", under="ignore"):
            p = np.maximum(self.counts, floor) ** power
        total = p.sum()
        if not (np.isfinite(total) and total > 0):
            return None
        return p / total

    def _shifted_log(self, power: float, floor: float) -> np.ndarray:
        """power * log max(counts, floor), shifted so that its largest entry is 0."""
        _check_power(power)
        c = np.maximum(self.counts, floor)
        if power == 0:  # counts**0: 1 for every id, a count of 0 too (as numpy's 0.0**0)
            return np.zeros(c.shape)
        if not np.any(c > 0):
            raise ValueError("token counts are all zero; nothing to build a distribution from")
        with np.errstate(divide="ignore"):  # log 0 = -inf: a zero count keeps probability 0
            lp = power * np.log(c)
        return lp - lp.max()


def _check_power(power) -> None:
    if not (isinstance(power, (int, float, np.number)) and math.isfinite(power)
            and power >= 0):
        raise ValueError(f"power={power!r}: counts**power needs a finite number >= 0")


def frequencies(counts: Frequencies | np.ndarray | None, vocab_size: int) -> Frequencies:
    """The counts a layer was given, or Zipf's law over frequency-sorted ids."""
    if counts is None:
        return Frequencies.zipf(vocab_size)
    if isinstance(counts, Frequencies):
        if counts.vocab_size != vocab_size:
            raise ValueError(f"token counts cover {counts.vocab_size} ids; the output layer "
                             f"has vocab_size={vocab_size}")
        return counts
    return Frequencies.of(counts, vocab_size)


def fan_in_init():
    """Initializer for a [V, E] table used as E -> V weights (fan-in is E, the last axis)."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=-2)


class _OutputTable(nn.Module):
    """Output word vectors [V, E] and biases [V], created on first use once E is known."""

    vocab_size: int
    tied: bool
    param_dtype: jnp.dtype
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, width: int):
        kernel = None
        if not self.tied:
            from hpnlp.compress.qlinear import param  # a packed quantized weight, where one is
            kernel = param(self, "kernel", nn.with_logical_partitioning(fan_in_init(), ("vocab", "embed")),
                           (self.vocab_size, width), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, ("vocab",)),
                          (self.vocab_size,), self.param_dtype)
        return kernel, bias


class LogitsDistribution:
    """Mixin for layers whose evaluation distribution is a softmax of `logits(hidden)`."""

    # whether `loss` is -log_prob[target] (`trains_nll`): the exact objectives say True
    trains_nll: ClassVar[bool] = False

    def log_prob(self, hidden_NE):
        return jax.nn.log_softmax(self.logits(hidden_NE), axis=-1)

    def top_k(self, hidden_NE, k: int):
        return jax.lax.top_k(self.log_prob(hidden_NE), k)

    def __call__(self, hidden_NE):
        return self.log_prob(hidden_NE)

    def nll_and_argmax(self, hidden_NE, targets_N):
        """Each token's -log_prob[target] [N] and most likely id [N] (module-level
        `nll_and_argmax`), over token chunks (`eval_chunk_tokens`), so evaluation holds one
        chunk's [C, V] where training chunks its loss (review r2: 8K tokens x 1M ids, 32 GiB
        of logits, stopped a run that trained by chunks at its first eval); adaptive,
        hierarchical and binary_code are no LogitsDistributions, and their evaluation still
        reads the whole `log_prob` [N, V]. Unchunked, it is read off `log_prob` itself. No
        backward: no remat."""
        num_tokens = targets_N.size
        chunk = self.eval_chunk_tokens(num_tokens)
        if not chunk or chunk >= num_tokens:
            return log_prob_nll_and_argmax(self.log_prob(hidden_NE), targets_N)
        one_chunk, inputs = self.chunk_eval(hidden_NE)
        return map_token_chunks(one_chunk, targets_N.shape, chunk, *inputs, targets_N,
                                remat=False)

    def eval_chunk_tokens(self, num_tokens: int) -> int:
        """Tokens per eval chunk (0: none): the layer's `chunk_tokens` where it sizes the
        loss's [C, V] logits too and is set, else automatic (one chunk's [C, V] float32
        under 256 MiB per device)."""
        from hpnlp.softmax.full import auto_chunk_tokens
        chunk = getattr(self, "chunk_tokens", -1)
        return auto_chunk_tokens(num_tokens, self.vocab_size) if chunk < 0 else chunk

    def chunk_eval(self, hidden_NE):
        """(fn(*inputs_C, targets_C) -> `nll_and_argmax` of a chunk's C tokens, inputs [*N, ...]):
        the module's own calls made here (flax refuses them inside the chunk loop, a JAX
        transform), `fn` pure. Every layer that is a LogitsDistribution defines it."""
        raise NotImplementedError(f"{type(self).__name__} is a LogitsDistribution, so it must "
                                  "define chunk_eval (VocabLayer's and VMFOutput's are the models)")


class VocabLayer(LogitsDistribution, nn.Module):
    """Base of the output layers that score each id with a vector and a bias: h . w_v + b_v.

    Subclasses add an objective; they all share `logits` (every id, float32), `rows` (a
    subset of ids, for sampled objectives) and the exact `log_prob`, so a sampled objective
    evaluates with the full softmax of the very weights it trained. With `embed` given,
    the output vectors are the input embedding table (tied, Press & Wolf 2017).
    """

    vocab_size: int = 0
    embed: nn.Module | None = None  # tied: output vectors = embed.embedding [V, E]
    dtype: jnp.dtype = jnp.float32  # matmul input dtype; logits and losses are float32
    param_dtype: jnp.dtype = jnp.float32
    # config.QuantConfig (hpnlp.compress), when `quant.layers` covers "output": the table
    # fake-quantized per row (or decoded from a packed QWeight), the hidden states per token.
    quant: Any = None

    def setup(self):
        if self.vocab_size <= 0:
            raise ValueError(f"{type(self).__name__} needs vocab_size > 0; got {self.vocab_size}")
        self.table = _OutputTable(self.vocab_size, self.embed is not None, self.param_dtype,
                                  self.initial_bias())

    def initial_bias(self) -> Callable:
        """Initializer of the [V] bias; objectives that are not shift-invariant override it."""
        return nn.initializers.zeros

    def _stored(self, width: int):
        """(the product's weight as stored: [V, E] float, or packed [E, V]; b [V]), noted as
        the `output` product and, in `ptq.serve`'s pass, prepared for its integer kernel
        where one applies (the hidden states are quantized per token here whatever
        `quant.act_scale` says: see quant_hidden)."""
        from hpnlp.compress.qlinear import note_product, serve_weight
        kernel_VE, bias_V = self.table(width)
        owner, name = (self.embed, "embedding") if self.embed is not None else (self.table, "kernel")
        note_product(owner, name, "output", (1,))  # [V, E]: E contracts
        if self.embed is not None:
            kernel_VE = self.embed.embedding
        if self.quantized():
            serve_weight(owner, name, kernel_VE, dataclasses.replace(self.quant, act_scale="dynamic"))
        return kernel_VE, bias_V

    def weights(self, width: int):
        """(W [V, E], b [V]) in the parameter dtype."""
        return self._decoded(*self._stored(width), width)

    def _decoded(self, kernel_VE, bias_V, width: int):
        """`_stored`'s weight as the float [V, E] the product multiplies (decoded, or
        fake-quantized where `quant` covers the output layer), and b [V]."""
        from hpnlp.compress.qlinear import Factored
        if self.embed is not None:
            kernel_VE = tied_table(self.embed)
            _check_width(kernel_VE.shape[-1], width)
        elif isinstance(kernel_VE, Factored):  # model.lowrank: the table its factors make
            kernel_VE = kernel_VE.dense()
        elif self.quantized() or _is_packed(kernel_VE):
            from hpnlp.compress.qlinear import quant_weight
            kernel_VE = quant_weight(kernel_VE if _is_packed(kernel_VE) else kernel_VE.T, 1,
                                     self.quant, self.table, "kernel").T  # per row: E first
        return kernel_VE, bias_V

    def quantized(self) -> bool:
        return self.quant is not None and self.quant.applies("output")

    def quant_hidden(self, hidden_NE):
        """Hidden states as the output product reads them: per-token fake quantization when
        `quant.activations` is set for the output layer (always dynamic: a calibrated static
        range covers the trunk's products)."""
        return _quant_tokens(hidden_NE, self.quant.activations if self.quantized() else "none")

    def logits(self, hidden_NE):
        """float32 logits [N, V] for every id: by the integer kernel that computes the
        product where the weight was prepared for one (`ptq.serve`), else in XLA."""
        return self._logits_fn(hidden_NE.shape[-1])(hidden_NE)

    def _logits_fn(self, width: int):
        """`logits` as a pure function of hidden states [N, E], `_stored` read here once,
        so a chunk loop (where flax refuses the module's own calls) multiplies each chunk
        by the very product `logits` takes: a Served table by its integer kernel, a
        Factored one through the rank, else the decoded [V, E] table (found in review:
        chunked eval read a served table dequantized, a low-rank one densified)."""
        from hpnlp.compress.qlinear import Factored, Served, served_product
        stored, bias_V = self._stored(width)
        dtype = self.dtype
        if isinstance(stored, Served):  # quantizes the hidden states itself, as quant_hidden does
            return lambda h_NE: served_product(h_NE, stored, 1, jnp.float32,
                                               bias_V.astype(jnp.float32))
        if isinstance(stored, Factored):
            return factored_logits(stored, bias_V, dtype)
        kernel_VE, bias_V = self._decoded(stored, bias_V, width)
        activations = self.quant.activations if self.quantized() else "none"
        return lambda h_NE: scores(_quant_tokens(h_NE, activations), kernel_VE, bias_V, dtype)

    def chunk_eval(self, hidden_NE):
        """`log_softmax(logits)`'s per-chunk `nll_and_argmax`: each chunk through the
        product `logits` takes (`_logits_fn`), as `full`'s chunked loss walks them."""
        logits_fn = self._logits_fn(hidden_NE.shape[-1])

        def one_chunk(h_CE, t_C):
            return logits_nll_and_argmax(logits_fn(h_CE), t_C)
        return one_chunk, (hidden_NE,)

    def rows(self, ids, width: int):
        """Output vectors and biases of `ids`: ([*ids.shape, E], [*ids.shape])."""
        return self._rows_fn(width, ids.size)(ids)

    def _rows_fn(self, width: int, num_rows: int):
        """`rows` as a pure function of ids (`_stored` read here once, so a chunk loop may
        gather with it), for about `num_rows` ids a call. A Factored table (model.lowrank)
        gives U[ids] V, [R, r] x [r, E], where fewer rows than V are asked for: review r8,
        the sampled objectives and hard_negative multiplied out the whole [V, E] (2 V r E
        flops and a [V, E] buffer, and as much again backward) to gather R << V rows of it.
        From V rows on, multiplying the table out once costs less, and holds no more.
        Likewise a fake-quantized table (QAT) quantizes the gathered rows only
        (`qlinear.quant_rows`: the same values and gradients)."""
        from hpnlp.compress.qlinear import Factored, float_product, quant_rows, quantizes_rows
        stored, bias_V = self._stored(width)
        if isinstance(stored, Factored) and num_rows < self.vocab_size:
            if self.embed is not None:
                _check_width(stored.v.shape[-1], width)

            def factored(ids):
                u_Rr = jnp.take(stored.u, ids, axis=0)
                return float_product(u_Rr, stored.v, None, 1), jnp.take(bias_V, ids, axis=0)
            return factored
        # tied: quantized as the embedding's lookups are (`Embed.quant_rows`, its quant)
        owner, quant, quantized = ((self.embed, getattr(self.embed, "quant", None),
                                    getattr(self.embed, "quant_rows", False))
                                   if self.embed is not None else
                                   (self.table, self.quant, self.quantized()))
        if quantizes_rows(stored, quantized, num_rows, owner):
            # the rows gathered, then fake-quantized: as gathering the quantized table, in
            # values and gradients (each row its own scale), at R rows' cost, not V's
            if self.embed is not None:
                _check_width(stored.shape[-1], width)
            return lambda ids: (quant_rows(jnp.take(stored, ids, axis=0), quant),
                                jnp.take(bias_V, ids, axis=0))
        kernel_VE, bias_V = self._decoded(stored, bias_V, width)
        return lambda ids: (jnp.take(kernel_VE, ids, axis=0), jnp.take(bias_V, ids, axis=0))


def factored_logits(table, bias_V, dtype):
    """float32 logits of a Factored table (model.lowrank), W [V, E] = U [V, r] V [r, E], as a
    pure function of hidden states [N, E]: (h V^T) U^T + b, two products through the rank,
    never the [V, E] table."""
    from hpnlp.compress.qlinear import float_product

    def logits(h_NE):
        t_Nr = float_product(h_NE.astype(dtype), table.v.T.astype(dtype), None, 1)
        logits_NV = float_product(t_Nr, table.u.T.astype(dtype), None, 1, jnp.float32)
        return logits_NV + bias_V.astype(jnp.float32).reshape((1,) * (logits_NV.ndim - 1) + (-1,))
    return logits


def _check_width(table_width: int, width: int) -> None:
    if table_width != width:
        raise ValueError(f"tied output embedding has width {table_width}, hidden states have "
                         f"{width}")


def _quant_tokens(hidden_NE, activations: str):
    """`VocabLayer.quant_hidden` as a pure function: per-token fake quantization to
    `activations` ("none": unchanged)."""
    if activations == "none":
        return hidden_NE
    from hpnlp.compress.formats import fake_quant
    return fake_quant(hidden_NE, activations, (-1,))


def tied_table(embed):
    """A tied embedding's [V, E] table as the model uses it: `Embed.table()` (quantized rows,
    a packed export decoded), or a plain nn.Embed's parameter."""
    return embed.table() if hasattr(embed, "table") else embed.embedding


def _is_packed(w) -> bool:
    from hpnlp.compress.qlinear import QWeight, Served
    return isinstance(w, (QWeight, Served))


def scores(hidden_NE, kernel_VE, bias_V, dtype):
    """hidden . kernel^T + bias, matmul in `dtype`, accumulated and returned in float32."""
    logits_NV = jnp.einsum("...e,ve->...v", hidden_NE.astype(dtype), kernel_VE.astype(dtype),
                           preferred_element_type=jnp.float32)
    return logits_NV + bias_V.astype(jnp.float32).reshape((1,) * (logits_NV.ndim - 1) + (-1,))


def _row_groups(B: int, chunk: int) -> int:
    """The least divisor k of B whose groups of B / k rows fit `chunk` and split evenly over
    the devices the batch is split over (k dividing each one's rows), else the least that
    fits."""
    from hpnlp.softmax.full import batch_shards
    shards = batch_shards()
    fits = [k for k in range(1, B + 1) if B % k == 0 and B // k <= chunk]
    return next((k for k in fits if (B // k) % shards == 0), fits[0])


def map_token_chunks(fn, lead: tuple, chunk: int, *arrays, remat: bool = True):
    """`fn` on at most `chunk` tokens at a time; per-token outputs shaped `lead` (+ fn's
    trailing dims).

    `arrays` have leading dims `lead` (e.g. [B, L]); `fn` takes flat [C, ...] arrays. The
    first lead dim (the batch, which data and FSDP parallelism shard) stays whole in every
    chunk: chunks cut the other dims, so chunk i holds every device's own rows i*c..(i+1)*c
    and no device gathers another's tokens (cutting the flattened tokens instead makes each
    chunk live on one device, and every device then computes every chunk). Where `chunk` is
    under B, one token of every row is more than it: the rows are cut too, into k
    interleaved groups (rows j, j + k, j + 2k, ... with k the least divisor of B that brings
    a group to `chunk` rows, and that divides each device's rows where one does: `_row_groups`),
    so each group spreads evenly over the devices that split the batch (a review, session
    116: a chunk held B tokens whatever `chunk` said, 4x the automatic budget's logits at
    V = 2^20 and B = 256). `remat`: the backward recomputes a
    chunk instead of storing it (`lax.map` of a `jax.checkpoint`). `chunk == 0`, or no more
    tokens than `chunk`: one call on all tokens. `fn` may return a tuple of per-token arrays
    (each shaped back).
    """
    num_tokens = int(np.prod(lead))
    flat = lambda a, n: a.reshape((n,) + a.shape[len(lead):])  # noqa: E731
    if not chunk or chunk >= num_tokens:
        out = fn(*(flat(a, num_tokens) for a in arrays))
        return jax.tree.map(lambda o: o.reshape(tuple(lead) + o.shape[1:]), out)
    B = lead[0] if len(lead) > 1 else 1
    R = num_tokens // B
    k = 1 if chunk >= B else _row_groups(B, chunk)
    g = B // k  # rows per chunk: row i * k + j is row i of group j
    c = max(1, min(R, chunk // g))  # tokens per row per chunk
    pad = (-R) % c
    n = (R + pad) // c

    def split(a):  # [*lead, ...] -> [k * n, g, c, ...]
        tail = a.shape[len(lead):]
        a = a.reshape((g, k, R) + tail)
        a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * len(tail))
        a = jnp.moveaxis(a.reshape((g, k, n, c) + tail), 0, 2)  # [k, n, g, c, ...]
        return a.reshape((k * n, g, c) + tail)

    def body(xs):
        return fn(*(x.reshape((g * c,) + x.shape[2:]) for x in xs))

    def join(out):  # [k * n, g * c, ...] -> [*lead, ...]
        tail = out.shape[2:]
        out = jnp.moveaxis(out.reshape((k, n, g, c) + tail), 2, 0)  # [g, k, n, c, ...]
        out = out.reshape((g, k, n * c) + tail)[:, :, :R]
        return out.reshape(tuple(lead) + tail)

    out = jax.lax.map(jax.checkpoint(body) if remat else body, tuple(split(a) for a in arrays))
    return jax.tree.map(join, out)


def computed_vector(make_values: Callable[[], np.ndarray]) -> Callable:
    """An initializer returning `make_values()` (a [V] float array), computed only when the
    parameter is created, not in every `setup`."""
    def init(key, shape, dtype=jnp.float32):
        del key
        values = np.asarray(make_values())
        if tuple(shape) != values.shape:
            raise ValueError(f"bias shape {shape} does not match the {values.shape} initial values")
        return jnp.asarray(values, dtype)
    return init
