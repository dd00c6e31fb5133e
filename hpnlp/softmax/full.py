"""`full`: the exact softmax over the whole vocabulary, the reference for every approximation.

Logits and the log-sum-exp run in float32 whatever the compute dtype. Options: tied input
and output embeddings (Press & Wolf 2017; the model passes its `nn.Embed`), z-loss
(`z_loss * logsumexp^2`, PaLM) that pushes the normalizer towards 1 so that the
unnormalized logit is usable as a log-probability, and token chunking of the loss.

The z-loss is a regularizer, kept out of `loss` as MoE's router losses are: `loss` returns
each token's NLL alone, and the penalty, z_loss times the mean of logsumexp^2 over the real
tokens, is sown into the AUX collection (hpnlp.train.carry.fold_aux), which adds it to the
objective the step minimizes and logs it as `loss_output_z`. So a train line's `loss` and
`ppl` are the NLL's, on the scale of the eval lines' (review r8: they carried the penalty,
1.08 nats at z_loss=0.01 and V=32K at init); the gradient is what it was, except under
distillation, whose (1 - alpha) weight of the hard loss no longer scales the penalty: it
counts at full weight there, as MoE's router losses do. An apply that does not make AUX
mutable (`per_example`) leaves the penalty out, as it does MoE's.

Token chunking is what lets the exact loss run where the logits cannot exist: 8K tokens
x 1M classes is 32 GiB of float32 logits. The loss is a `lax.map` over chunks of tokens
whose body is `jax.checkpoint`ed, so the forward keeps one chunk's logits at a time and
the backward recomputes each chunk's logits instead of storing them: memory is
O(chunk x V + V x E), the arithmetic the same as unchunked. Evaluation, which needs only
each token's NLL and argmax (`nll_and_argmax`), walks the same chunks.

Shape letters: N any leading dims, T flattened tokens, C tokens per chunk, E hidden
width, V vocabulary, K top-k.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from hpnlp.softmax.base import VocabLayer, check_targets, map_token_chunks, masked, register

CHUNK_LOGITS_BYTES = 256 * 2**20  # auto chunking keeps one chunk's float32 logits under this


def auto_chunk(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk so that a chunk's float32 logits fit CHUNK_LOGITS_BYTES (0: no chunking)."""
    if num_tokens * vocab_size * 4 <= CHUNK_LOGITS_BYTES:
        return 0
    chunk = max(1, CHUNK_LOGITS_BYTES // (vocab_size * 4))
    return 1 << (chunk.bit_length() - 1)  # a power of two: divides typical token counts


def batch_shards() -> int:
    """Devices the batch is split over in the current mesh and logical-axis rules (1 outside
    a mesh). Automatic chunk sizes are per device: a data-parallel device holds only its
    share of the tokens, so chunking by the global count would chunk (and, under GSPMD,
    reduce the output layer's gradient inside the chunk loop) where nothing needs it."""
    import flax.linen as nn

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    axes = nn.logical_to_mesh_axes(("batch",))[0]
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    n = 1
    for a in axes:
        n *= mesh.shape.get(a, 1)
    return n


def auto_chunk_tokens(num_tokens: int, floats_per_token: int) -> int:
    """`auto_chunk` of each device's tokens, as a global tokens-per-chunk count."""
    shards = batch_shards()
    return auto_chunk(num_tokens // shards, floats_per_token) * shards


def chunked_nll(logits_fn, hidden_NE, targets_N, *, chunk: int):
    """Per-token (-log softmax(logits_fn(h))[target], logsumexp) [N] each, about `chunk`
    tokens at a time (each chunk a slice of every row: see `base.map_token_chunks`);
    `logits_fn`: the layer's product (`VocabLayer._logits_fn`)."""
    def one_chunk(h_CE, t_C):
        return _nll_and_lse(logits_fn(h_CE), t_C)
    return map_token_chunks(one_chunk, targets_N.shape, chunk, hidden_NE, targets_N)


def _nll_and_lse(logits_NV, targets_N):
    lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
    return lse_N - jnp.take_along_axis(logits_NV, targets_N[..., None], axis=-1)[..., 0], lse_N


@register("full")
class FullSoftmax(VocabLayer):
    """Softmax over all V classes (the reference): loss = logsumexp(h W^T + b) - (h W^T + b)[target].

    Params: `table/kernel` [V, E] (absent when tied) and `table/bias` [V].
    """

    trains_nll: ClassVar[bool] = True  # -log p(target); z_loss's penalty goes to AUX
    layout_options: ClassVar[frozenset] = frozenset({"chunk_tokens"})  # (`base.layout_options`)

    z_loss: float = 0.0
    chunk_tokens: int = -1  # tokens per loss chunk; -1 = auto (chunk above 256 MiB of logits), 0 = never

    @classmethod
    def check_config(cls, options, *, vocab_size, frequency_sorted, field="output.options"):
        """Found in review: a negative z_loss was taken, and the loss fell without bound;
        inf made every loss inf or NaN (review r2). chunk_tokens: checked for every layer by
        `base.check_config`."""
        from hpnlp.config import config_error
        z = options.get("z_loss", cls.z_loss)
        if (isinstance(z, bool) or not isinstance(z, (int, float)) or not z >= 0
                or not math.isfinite(z)):
            raise config_error(f"{field}.z_loss", z, "must be a number >= 0 and finite (a "
                               "negative one rewards large logits without bound)")

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        del deterministic  # the exact loss has no randomness
        check_targets(targets_N, self.vocab_size, hidden_NE, mask_N)
        width = hidden_NE.shape[-1]
        num_tokens = targets_N.size
        chunk = auto_chunk_tokens(num_tokens, self.vocab_size) if self.chunk_tokens < 0 else self.chunk_tokens
        if chunk and chunk < num_tokens:
            # each chunk through the product `logits` takes: a factorized table (model.lowrank)
            # through its rank, not densified to [V, E] (as the chunked eval since session 105)
            nll_N, lse_N = chunked_nll(self._logits_fn(width), hidden_NE, targets_N, chunk=chunk)
        else:
            nll_N, lse_N = _nll_and_lse(self.logits(hidden_NE), targets_N)
        if self.z_loss:
            self.sow_z_loss(lse_N, mask_N)
        return masked(nll_N, mask_N)

    def sow_z_loss(self, lse_N, mask_N):
        """z_loss * mean(logsumexp^2) over the real tokens into the AUX collection (module
        doc): `loss`, a per-token mean the train step adds to the objective times the real
        tokens (so it adds z_loss * sum(lse^2), what the per-token penalty added), and
        `loss_output_z`, the same penalty logged beside the NLL."""
        from hpnlp.train.carry import AUX  # late: hpnlp.train imports the models
        sq_N = masked(jnp.square(lse_N), mask_N)
        real = sq_N.size if mask_N is None else jnp.sum(mask_N, dtype=jnp.float32)
        penalty = self.z_loss * jnp.sum(sq_N) / jnp.maximum(real, 1.0)
        self.sow(AUX, "z_loss", {"loss": penalty, "loss_output_z": penalty})
