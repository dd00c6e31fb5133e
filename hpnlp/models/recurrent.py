"""A recurrent trunk (LSTM / GRU) with the Transformer trunk's interface.

`RNNTrunk(embed, tokens, seg, pos) -> hidden [B, L, E']` like `Trunk`, so the LM, the
classifier and the dual encoder in `heads.py` (same data, same output layers, same
training loop) run on either; `cfg.model.arch` picks. E' = width, or 2 x width for
bidirectional encoders.

Lengths: each row's real tokens are its non-zero segment ids, which batching puts first
(padding at the end), so `lengths = sum(seg > 0)`: padding never changes the state. A
packed LM row (several documents) is read as one stream, the state carrying across
document boundaries, as stream-trained RNN LMs do; use `data.batching="pad"` for
one document per row.

Shape letters: B batch, L length, E width.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from hpnlp.config import ModelConfig, RNNConfig
from hpnlp.models.transformer import dtypes, embed_tokens
from hpnlp.rnn import StackedRNN


class RNNTrunk(nn.Module):
    model: ModelConfig
    rnn: RNNConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, embed: nn.Module, tokens_BL, seg_BL, pos_BL):
        del pos_BL  # order is the recurrence itself
        m, r = self.model, self.rnn
        dt, pdt = dtypes(m)
        x_BLE = (embed_tokens(embed, tokens_BL, seg_BL).astype(dt)
                 * jnp.asarray(np.sqrt(m.width), dt))
        lengths_B = jnp.sum(seg_BL > 0, axis=1, dtype=jnp.int32)
        h_BLE, _ = StackedRNN(
            num_layers=m.depth, combine=r.combine, kind=m.arch, hidden=m.width,
            layer_norm=r.layer_norm, bidirectional=r.bidirectional, learned_init=r.learned_init,
            # every layer drops its input (the first: the embeddings), the stack its output, at
            # any depth (a bug hunt, session 99: depth 1 dropped its embeddings here and left
            # its output undropped)
            dropout=m.dropout, variational_dropout=r.variational_dropout,
            state_dropout=r.state_dropout, recurrent_dropout=r.recurrent_dropout, zoneout=r.zoneout,
            weight_drop=r.weight_drop, unroll=r.unroll, impl=r.impl, dtype=dt, param_dtype=pdt,
            quant=m.quant,
            name="rnn")(x_BLE, lengths_B, deterministic=self.deterministic)
        return h_BLE
