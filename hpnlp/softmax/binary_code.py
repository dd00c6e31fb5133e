"""`binary_code`: predict each id's bits instead of the id (Oda et al. 2017, "Neural Machine
Translation via Binary Code Prediction").

The fast idea: an id is a B-bit code with B ~ log2 V, and the model predicts the bits
independently with B sigmoids, log p(code | h) = sum_b log sigma(+-s_b), so the output layer
is an E x B matrix instead of E x V: O(N B E) for training, whatever the vocabulary.

Modes (field `mode`):
- `plain`: id of frequency rank r gets the code binary(r), B = ceil(log2 V).
- `hybrid`: a softmax over the K most frequent ids plus one "other" class; only the rest
  (ranks >= K) get bits, binary(r - K) with ceil(log2 (V - K)) bits. Oda et al.'s best
  trade-off: frequent words keep an exact softmax.
- `ecc`: the B data bits are encoded with a convolutional code of rate 1/`redundancy`
  (constraint length 7, the standard generators, terminated with 6 zero bits), so a few
  mispredicted bits still decode to the right id. It is a linear code, codeword = data G
  mod 2, so the whole code is the small generator matrix G [B, Bc].

Training loss vs evaluation. The bit model puts mass on all 2^Bc bit patterns, of which only
V are codewords, so sum_b log sigma(+-s_b) is not a normalized log-probability over ids. The
training loss is the bit-wise binary cross-entropy sum_b -log sigma(+-s_b) (plus, for hybrid,
the softmax part), as in the paper; it upper-bounds -log_prob[target]. `log_prob` renormalizes
over the V codewords, which is exact ML decoding over valid codewords. Since
log sigma(s) - log sigma(-s) = s, that distribution is just softmax over ids of
<code(v), s>: one [N, Bc] x [Bc, V] matmul.

Shape letters: N any leading dims (tokens), E hidden width, V vocabulary, B data bits,
Bc code bits (B for plain/hybrid, redundancy * (B + 6) for ecc), K softmax size (hybrid),
R ids with bits (V, or V - K for hybrid).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.softmax.base import (Frequencies, check_targets, masked, refuse_unread, register,
                                scores)
from hpnlp.softmax.tree import Vectors, cached_tables, frequency_rank

MODES = ("plain", "hybrid", "ecc")
# Constraint-length-7 convolutional codes with maximal free distance (octal taps; free
# distance 10, 15, 20 for rates 1/2, 1/3, 1/4): Oda et al. use the rate-1/2 pair.
GENERATORS = {2: (0o171, 0o133), 3: (0o171, 0o133, 0o165), 4: (0o117, 0o127, 0o155, 0o171)}
CONSTRAINT = 7


def num_bits(n: int) -> int:
    """ceil(log2 n) bits give n distinct codes (at least one bit)."""
    return max(1, (n - 1).bit_length())


def convolutional_generator(data_bits: int, redundancy: int) -> np.ndarray:
    """Generator matrix [B, Bc] of the terminated rate-1/`redundancy` convolutional code.

    Output step t (of B + 6), generator g: bit = XOR_k tap_g[k] u[t - k], tap k is the
    k-th delay (the octal taps read from the most significant bit, the current input).
    """
    taps = GENERATORS[redundancy]
    steps = data_bits + CONSTRAINT - 1
    gen = np.zeros((data_bits, steps, redundancy), np.int32)
    for g, octal in enumerate(taps):
        for delay in range(CONSTRAINT):
            if octal >> (CONSTRAINT - 1 - delay) & 1:
                for i in range(data_bits):
                    gen[i, i + delay, g] = 1
    return gen.reshape(data_bits, steps * redundancy)


@dataclasses.dataclass(frozen=True)
class Codes:
    """Codes of one layer: id -> frequency rank -> data bits (MSB first) -> codeword."""

    rank_V: np.ndarray | None  # [V] int32 frequency rank of each id; None when ids are sorted
    softmax_size: int  # K (hybrid), else 0: ranks < K are softmax classes, ranks >= K get bits
    data_bits: int  # B
    generator: np.ndarray | None  # [B, Bc] int32 (ecc), None for identity (plain, hybrid)

    @property
    def code_bits(self) -> int:
        return self.data_bits if self.generator is None else int(self.generator.shape[1])

    def encode(self, index):
        """Codewords [..., Bc] int32 (0/1) of bit-coded indices `index` (rank - K), jnp."""
        shifts = jnp.arange(self.data_bits - 1, -1, -1, dtype=jnp.int32)
        bits = (index[..., None] >> shifts.reshape((1,) * index.ndim + (-1,))) & 1
        if self.generator is None:
            return bits
        return jnp.einsum("...b,bc->...c", bits, jnp.asarray(self.generator)) % 2

    def rank(self, ids):
        return ids if self.rank_V is None else jnp.take(self.rank_V, ids)


def build_codes(freqs: Frequencies, mode: str, softmax_size: int, redundancy: int) -> Codes:
    rank_V = np.empty(freqs.vocab_size, np.int32)
    rank_V[frequency_rank(freqs)] = np.arange(freqs.vocab_size, dtype=np.int32)
    if np.array_equal(rank_V, np.arange(freqs.vocab_size)):
        rank_V = None  # frequency-sorted ids: the id is its rank
    size = softmax_size if mode == "hybrid" else 0
    data_bits = num_bits(freqs.vocab_size - size)
    generator = convolutional_generator(data_bits, redundancy) if mode == "ecc" else None
    return Codes(rank_V, size, data_bits, generator)


def bit_nll(score_NC, code_NC):
    """sum_b -log sigma(+-s_b): the bit-wise binary cross-entropy of a codeword."""
    sign_NC = (2 * code_NC - 1).astype(jnp.float32)
    return -jnp.sum(jax.nn.log_sigmoid(sign_NC * score_NC), axis=-1)


def _is_redundancy(r) -> bool:
    """An int (numpy's too, not a bool or a float: 2.0 failed in numpy) that GENERATORS has."""
    return (isinstance(r, (int, np.integer)) and not isinstance(r, bool)
            and int(r) in GENERATORS)


@register("binary_code")
class BinaryCode(nn.Module):
    """Binary code prediction (Oda et al. 2017): sigmoids over an id's bits, not a softmax.

    Params: `bits/kernel` [Bc, E], `bits/bias` [Bc]; hybrid adds `head/kernel` [K + 1, E],
    `head/bias` [K + 1]. Training loss: bit-wise BCE (+ softmax NLL for hybrid), which is
    >= -log_prob[target] (equal for hybrid's softmax ids); `log_prob` is normalized over V.
    """

    trains_nll: ClassVar[bool] = False  # the BCE only bounds -log p: no perplexity of it

    vocab_size: int = 0
    counts: Frequencies | None = None  # train counts per id; None = ids already sorted by frequency
    mode: str = "plain"  # plain | hybrid | ecc
    softmax_size: int = 0  # hybrid: K most frequent ids in the softmax; 0 = min(1024, V // 2)
    redundancy: int = 2  # ecc: code bits per data bit (rate 1/redundancy convolutional code), 2-4
    dtype: jnp.dtype = jnp.float32  # matmul input dtype; scores and losses are float32
    param_dtype: jnp.dtype = jnp.float32

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        del frequency_sorted
        from hpnlp.config import config_error
        mode = options.get("mode", cls.mode)
        if mode not in MODES:
            raise config_error(f"{field}.mode", mode, f"choose one of {list(MODES)}")
        for name, reader in (("softmax_size", "hybrid"), ("redundancy", "ecc")):
            if mode != reader:
                refuse_unread(options, name, f"mode={reader!r}", f"mode={mode!r}", field)
        # these two were checked only in `setup`, as errors without their config field
        size = options.get("softmax_size", cls.softmax_size)
        if mode == "hybrid" and (isinstance(size, bool) or not isinstance(size, int)
                                 or not (size == 0 or 1 <= size < vocab_size)):
            raise config_error(f"{field}.softmax_size", size, f"must be an integer in [1, "
                               f"model.vocab_size={vocab_size}) for mode='hybrid', or 0 for "
                               "min(1024, V // 2)")
        redundancy = options.get("redundancy", cls.redundancy)
        # a bug hunt (session 103): 2.0 passed (2.0 == 2) and failed at init in numpy
        if mode == "ecc" and not _is_redundancy(redundancy):
            raise config_error(f"{field}.redundancy", redundancy, f"choose one of "
                               f"{sorted(GENERATORS)} (code bits per data bit)")

    def setup(self):
        vocab_size = self.vocab_size
        if vocab_size <= 0:
            raise ValueError(f"binary_code needs vocab_size > 0; got {vocab_size}")
        if self.mode not in MODES:
            raise ValueError(f"binary_code mode={self.mode!r}; choose one of {list(MODES)}")
        softmax_size = 0
        if self.mode == "hybrid":
            if vocab_size < 2:
                raise ValueError(f"binary_code mode='hybrid' needs vocab_size >= 2; got {vocab_size}")
            softmax_size = self.softmax_size or min(1024, vocab_size // 2)
            if not 1 <= softmax_size < vocab_size:
                raise ValueError(f"binary_code softmax_size={self.softmax_size} must be in [1, vocab_size="
                                 f"{vocab_size}) for mode='hybrid'; use 0 for min(1024, V // 2)")
        if self.mode == "ecc" and not _is_redundancy(self.redundancy):
            raise ValueError(f"binary_code redundancy={self.redundancy}; choose one of "
                             f"{sorted(GENERATORS)} (code bits per data bit)")
        self.codes = cached_tables(build_codes, self.counts, vocab_size, self.mode, softmax_size,
                                   self.redundancy if self.mode == "ecc" else 0)
        self.bits = Vectors(self.codes.code_bits, None, self.param_dtype)
        if softmax_size:
            self.head = Vectors(softmax_size + 1, None, self.param_dtype)

    def _bit_scores(self, hidden_NE):
        kernel_CE, bias_C = self.bits(hidden_NE.shape[-1])
        return scores(hidden_NE, kernel_CE, bias_C, self.dtype)

    def _head_log_probs(self, hidden_NE):
        kernel_KE, bias_K = self.head(hidden_NE.shape[-1])
        return jax.nn.log_softmax(scores(hidden_NE, kernel_KE, bias_K, self.dtype), axis=-1)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        """Bit-wise BCE of the target's codeword (+ the hybrid softmax's NLL); not -log_prob."""
        del deterministic  # no randomness
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        codes, size = self.codes, self.codes.softmax_size
        rank_N = codes.rank(targets_N)
        bit_index_N = jnp.maximum(rank_N - size, 0)
        loss_N = bit_nll(self._bit_scores(hidden_NE), codes.encode(bit_index_N))
        if size:
            head_lp_NK = self._head_log_probs(hidden_NE)
            in_head_N = rank_N < size
            head_nll_N = -jnp.take_along_axis(head_lp_NK, jnp.minimum(rank_N, size)[..., None], -1)[..., 0]
            loss_N = head_nll_N + jnp.where(in_head_N, 0.0, loss_N)
        return masked(loss_N, mask_N)

    def log_prob(self, hidden_NE):
        """Normalized over the V ids: softmax of <codeword, bit scores> over valid codewords."""
        codes, size = self.codes, self.codes.softmax_size
        code_RC = codes.encode(jnp.arange(self.vocab_size - size, dtype=jnp.int32)).astype(jnp.float32)
        logits_NR = jnp.einsum("...c,rc->...r", self._bit_scores(hidden_NE), code_RC)
        logp_NV = jax.nn.log_softmax(logits_NR, axis=-1)  # in rank order
        if size:
            head_lp_NK = self._head_log_probs(hidden_NE)
            logp_NV = jnp.concatenate([head_lp_NK[..., :size], head_lp_NK[..., size:] + logp_NV], -1)
        return logp_NV if codes.rank_V is None else jnp.take(logp_NV, codes.rank_V, axis=-1)

    def top_k(self, hidden_NE, k: int):
        """The k most likely ids (for ecc: the k most likely valid codewords)."""
        return jax.lax.top_k(self.log_prob(hidden_NE), k)

    def __call__(self, hidden_NE):
        return self.log_prob(hidden_NE)
