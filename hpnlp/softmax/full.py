"""`full`: the exact softmax over the whole vocabulary, the reference for every approximation.

Logits and the log-sum-exp run in float32 whatever the compute dtype. Options: tied input
and output embeddings (Press & Wolf 2017; the model passes its `nn.Embed`), and z-loss
(`z_loss * logsumexp^2`, PaLM) that pushes the normalizer towards 1 so that the
unnormalized logit is usable as a log-probability.

Shape letters: N any leading dims, E hidden width, V vocabulary, K top-k.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.softmax.base import check_targets, register


@register("full")
class FullSoftmax(nn.Module):
    """Softmax over all V classes: loss = logsumexp(h W + b) - (h W + b)[target]."""

    vocab_size: int = 0
    z_loss: float = 0.0
    embed: nn.Module | None = None  # tied: logits = h @ embed.embedding.T
    dtype: jnp.dtype = jnp.float32  # matmul input dtype
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        if self.vocab_size <= 0:
            raise ValueError(f"FullSoftmax needs vocab_size > 0; got {self.vocab_size}")
        if self.embed is None:
            self.proj = nn.DenseGeneral(
                self.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "vocab")))
        self.bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                               (self.vocab_size,), self.param_dtype)

    def logits(self, hidden_NE):
        """float32 logits [N, V]."""
        if self.embed is not None:
            logits_NV = self.embed.attend(hidden_NE.astype(self.dtype))
        else:
            logits_NV = self.proj(hidden_NE)
        bias = self.bias.astype(jnp.float32).reshape((1,) * (logits_NV.ndim - 1) + (-1,))
        return logits_NV.astype(jnp.float32) + bias

    def log_prob(self, hidden_NE):
        logits_NV = self.logits(hidden_NE)
        return jax.nn.log_softmax(logits_NV, axis=-1)

    def loss(self, hidden_NE, targets_N, mask_N=None, *, deterministic: bool = True):
        check_targets(targets_N)
        logits_NV = self.logits(hidden_NE)
        lse_N = jax.nn.logsumexp(logits_NV, axis=-1)
        target_logit_N = jnp.take_along_axis(logits_NV, targets_N[..., None], axis=-1)[..., 0]
        loss_N = lse_N - target_logit_N
        if self.z_loss:
            loss_N = loss_N + self.z_loss * jnp.square(lse_N)
        if mask_N is not None:
            loss_N = jnp.where(mask_N, loss_N, 0.0)
        return loss_N

    def top_k(self, hidden_NE, k: int):
        return jax.lax.top_k(self.log_prob(hidden_NE), k)

    def __call__(self, hidden_NE):
        return self.log_prob(hidden_NE)
