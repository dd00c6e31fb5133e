"""Task models on the shared trunk: causal LM, classifier, dual encoder (matching).

Each model's `__call__(batch)` returns metric *sums* plus their denominator `weight`
(real tokens or real examples), so they add across devices and microbatches; the train
step divides once. `evaluate(batch)` returns the same keys measured exactly (for the LM:
the normalized log-probability of the output layer, whatever its training objective, read
token by token: `lm_eval_sums`; over token chunks for most layers, not yet for adaptive,
hierarchical and binary_code).

Shape letters as in `transformer.py`; C classes, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import attention as attention_lib
from hpnlp import softmax as softmax_lib
from hpnlp.compress.qlinear import Dense
from hpnlp.config import Config
from hpnlp.softmax.base import check_targets
from hpnlp.models.transformer import Trunk, _init, dtypes, make_embed, positions_of


def _output_layer(cfg: Config, embed: nn.Module | None, token_counts=None):
    """The registry output layer, given only the fields its class declares.

    Frequency-based layers (a `counts` field) get the task's train counts per id.
    """
    cls = softmax_lib.get(cfg.output.name)
    fields = {f.name for f in dataclasses.fields(cls)}
    dt, pdt = dtypes(cfg.model)
    kwargs = dict(cfg.output.options)
    kwargs["vocab_size"] = cfg.model.vocab_size
    if cfg.output.tie_embeddings:
        if not softmax_lib.can_tie(cfg.output.name):
            raise ValueError(f"output.tie_embeddings=True, but output layer {cfg.output.name!r} "
                             "cannot share the input embedding; set output.tie_embeddings=False")
        kwargs["embed"] = embed
    kwargs.update({k: v for k, v in (("dtype", dt), ("param_dtype", pdt),
                                     ("quant", cfg.model.quant)) if k in fields})
    if "counts" in fields and token_counts is not None:
        kwargs["counts"] = softmax_lib.frequencies(token_counts, cfg.model.vocab_size)
    return cls(**kwargs, name="output")


def lm_eval_sums(output: nn.Module, hidden_BLE, batch) -> dict:
    """An LM's exact eval sums under `output`'s normalized log-probabilities: NLL, correct
    argmax and real tokens. Each token's NLL and argmax only (`softmax.nll_and_argmax`),
    over token chunks where the layer walks them (review r2: the whole [B, L, V] was 32 GiB
    at 8K tokens x 1M ids): full, the sampled objectives, class_based, vmf. Adaptive,
    hierarchical and binary_code still read their whole [B, L, V] `log_prob` here (their
    losses do not: hierarchical's chunks over tokens, adaptive's over its tail clusters,
    binary_code's is [N, bits]): their evaluation needs that much memory. The targets are checked
    (`check_targets`) where they are concrete: the gather reads an id past the vocabulary
    as NaN (a review, session 114: Transformer-XL's evaluate did not check them)."""
    check_targets(batch["targets"], output.vocab_size)
    mask_BL = batch["segment_ids"] > 0
    nll_BL, pred_BL = softmax_lib.nll_and_argmax(output, hidden_BLE, batch["targets"])
    return {"loss": jnp.sum(jnp.where(mask_BL, nll_BL, 0.0), dtype=jnp.float32),
            "correct": jnp.sum((pred_BL == batch["targets"]) & mask_BL, dtype=jnp.float32),
            "weight": jnp.sum(mask_BL, dtype=jnp.float32)}


def make_trunk(cfg: Config, *, causal: bool, deterministic: bool, decode: bool = False):
    """The Transformer trunk, or the recurrent one for model.arch = "lstm" | "gru"."""
    if cfg.model.arch == "transformer":
        return Trunk(cfg.model, cfg.attention, causal=causal, deterministic=deterministic,
                     decode=decode)
    if decode:
        raise ValueError(f"incremental decoding (generate) is implemented for Transformer LMs; "
                         f"model.arch={cfg.model.arch!r} has no decode cache yet")
    from hpnlp.models.recurrent import RNNTrunk
    return RNNTrunk(cfg.model, cfg.rnn, deterministic=deterministic)


def check_token_losses(output, loss_BL, mask_BL) -> None:
    """A ValueError naming the output layer where its `loss` is not one value per token (a
    bug hunt (session 96): a registered layer's scalar mean trained, its gradients scaled down
    by the token count; a review (session 118): Transformer-XL's loss did not check, and a [B]
    loss broadcast against [L, L] took row j's loss at each position j)."""
    if loss_BL.shape != mask_BL.shape:
        raise ValueError(f"output layer {type(output).__name__}.loss returned shape "
                         f"{tuple(loss_BL.shape)}; it must return each token's loss, of "
                         f"the targets' shape {tuple(mask_BL.shape)} (the model sums them)")


class TransformerLM(nn.Module):
    """Causal LM (decoder-only Transformer, or an LSTM/GRU for model.arch="lstm"|"gru").
    Batches: inputs, targets, segment_ids, positions [B, L]."""

    cfg: Config
    deterministic: bool = True
    decode: bool = False
    token_counts: Any = None  # softmax.Frequencies (or [V] counts), for frequency-based output layers
    embed_weights: Any = None  # RowWeights of model.embed_grad_scale="corpus" (models.build)

    def setup(self):
        m = self.cfg.model
        self.embed = make_embed(m, tied=self.cfg.output.tie_embeddings, grad_weights=self.embed_weights)
        self.trunk = make_trunk(self.cfg, causal=True, deterministic=self.deterministic,
                                decode=self.decode)
        self.output = _output_layer(self.cfg, self.embed, self.token_counts)
        if self.decode:
            self.position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))

    def hidden(self, batch):
        return self.trunk(self.embed, batch["inputs"], batch["segment_ids"], batch["positions"])

    def __call__(self, batch):
        mask_BL = batch["segment_ids"] > 0
        loss_BL = self.output.loss(self.hidden(batch), batch["targets"], mask_BL,
                                   deterministic=self.deterministic)
        check_token_losses(self.output, loss_BL, mask_BL)
        # masked here too, as `lm_eval_sums` does (review r1): a registered layer that leaves
        # a value at padding (NaN included: NaN * 0 is NaN) added padding loss to training
        return {"loss": jnp.sum(jnp.where(mask_BL, loss_BL, 0.0), dtype=jnp.float32),
                "weight": jnp.sum(mask_BL, dtype=jnp.float32)}

    def evaluate(self, batch):
        return lm_eval_sums(self.output, self.hidden(batch), batch)  # (targets checked)

    def log_probs(self, batch):
        """[B, L, V] next-token log-probabilities (teacher forcing)."""
        return self.output.log_prob(self.hidden(batch))

    def decode_step(self, tokens_B1):
        """One token per row at the cached position -> next-token log-probs [B, V]."""
        return self.decode_tokens(tokens_B1)[:, 0]

    def decode_tokens(self, tokens_BK):
        """K tokens per row at the cached positions pos..pos + K - 1 (`pos` one position, or
        [B], each row's own, where the caller set the cache's positions per row), each seeing
        the cache and the tokens before it -> next-token log-probs [B, K, V] (speculative
        decoding's verification; K = 1 is `decode_step`). K > 1 needs the exact key/value cache
        (`Attention.exact_cache`)."""
        return self.output.log_prob(self.prefill(tokens_BK))

    def prefill(self, tokens_BK):
        """`decode_tokens` without its output layer: the K tokens into the cache -> their
        hidden states [B, K, E]. A prompt's prefill reads only the cache, and called eagerly
        (no jit to drop dead outputs) the log-probs it threw away were a [B, K, V] array (a
        review, session 107: 16 GiB at 8 prompts of 512 tokens over 1M ids)."""
        pos = self.position.value
        K = tokens_BK.shape[1]
        if K > 1 and not attention_lib.get(self.cfg.attention.name).exact_cache():
            raise ValueError(f"decode_tokens: {K} tokens in one call need the exact key/value "
                             f"cache, which attention.name={self.cfg.attention.name!r} does not "
                             "keep (its decode cache is its own); feed it one token a call")
        # the position: one for every row, or [B], each row's own (speculative decoding)
        pos_BK = jnp.reshape(pos, (-1, 1)) + jnp.arange(K, dtype=jnp.int32)[None]
        h_BKE = self.trunk(self.embed, tokens_BK, jnp.ones_like(tokens_BK),
                           jnp.broadcast_to(pos_BK, tokens_BK.shape))
        if not self.is_initializing():
            self.position.value = pos + K
        return h_BKE


def _pool(h_BLE, seg_BL, how: str):
    if how == "first":
        return h_BLE[:, 0]
    mask_BL1 = (seg_BL > 0)[..., None].astype(jnp.float32)
    return jnp.sum(h_BLE.astype(jnp.float32) * mask_BL1, axis=1) / jnp.maximum(mask_BL1.sum(1), 1.0)


def stack_sides(*sides_BL):
    """[B * S, W]: the rows of S sides (each [B, W_s]) interleaved, row b's sides next to each
    other (rows b*S ... b*S + S - 1), each widened with zeros (empty slots) to the widest W:
    how `encode_sides` lays out its one trunk call."""
    W = max(a_BL.shape[1] for a_BL in sides_BL)
    a_BSL = jnp.stack([jnp.pad(a_BL, ((0, 0), (0, W - a_BL.shape[1]))) for a_BL in sides_BL],
                      axis=1)
    return a_BSL.reshape(-1, W)


def unstack_sides(x_NW, widths):
    """`stack_sides` undone for what that call reports per token ([B * S, W, ...], a numpy or
    jax array): each side's [B, W_s, ...], `widths` the sides' own W_s."""
    x_BSW = x_NW.reshape((-1, len(widths)) + tuple(x_NW.shape[1:]))
    return [x_BSW[:, s, :w] for s, w in enumerate(widths)]


def encode_sides(encode, *sides):
    """Each side's vectors [B, E], from ONE call of `encode(tokens_NL, seg_NL) -> [N, E]` over
    every side's rows (`sides`: (tokens_BL, seg_BL) pairs of the same B; `stack_sides`).

    One call, because a shared trunk's random features (Performer's projections, LSH's
    rotations, a reversible stack's per-block keys) come from flax's `make_rng`, whose counter
    moves on at every call of the same layer within one apply: a call per side gave each side
    another draw, so the two towers were two functions, and neither side's the one `encode`
    alone (the pool's evaluation, search, mining) applies (review r1). Row b's sides lie next
    to each other, so a data shard's rows stay on it and a batch that pipeline microbatches
    split still splits. A narrower side gets empty slots up to the widest (mined negatives
    are seq_len wide beside a bucket's rows); what the trunk's layers report per token
    (`hpnlp.moe.route`) comes back per side with `unstack_sides`. So under
    `data.batching='bucket'` with mining (`model.encoder.mine_every`) every side is widened to
    `data.seq_len`, 3 * seq_len tokens a row through the trunk where a bucket of width W held
    2 * W + seq_len (2.4x at W=64, seq_len=512; more with quadratic attention): 'pad' or a
    smaller `data.seq_len` avoids the cost."""
    B, S = sides[0][0].shape[0], len(sides)
    tok_NW = stack_sides(*(tok_BL for tok_BL, _ in sides))
    seg_NW = stack_sides(*(seg_BL for _, seg_BL in sides))
    v_BSE = encode(tok_NW, seg_NW).reshape(B, S, -1)
    return [v_BSE[:, i] for i in range(S)]


def _classification_sums(logits_BC, label_B, weight_B):
    if not isinstance(label_B, jax.core.Tracer):  # eager calls; the data layer checked the rest
        C, lab = logits_BC.shape[-1], np.asarray(label_B)
        if lab.size and (lab.min() < 0 or lab.max() >= C):
            raise ValueError(f"label {int(lab[(lab < 0) | (lab >= C)].ravel()[0])} is outside the "
                             f"classes [0, {C}) (its gather reads NaN); check model.num_classes "
                             "against the data's labels")
    logp_BC = jax.nn.log_softmax(logits_BC.astype(jnp.float32), axis=-1)
    nll_B = -jnp.take_along_axis(logp_BC, label_B[:, None], axis=-1)[:, 0]
    correct_B = (jnp.argmax(logp_BC, axis=-1) == label_B).astype(jnp.float32)
    return {"loss": jnp.sum(nll_B * weight_B), "correct": jnp.sum(correct_B * weight_B),
            "weight": jnp.sum(weight_B)}


def _memory_sums(logits_BC, q_BQ, batch, memory, mc):
    """The head's sums, plus the key-value memory's: `correct_memory` (its nearest key's value
    is the label), `correct_head`, `loss_memory` (the margin loss, summed like `loss`), and
    `correct` as `mc.predict` chooses. The memory gets no gradient."""
    from hpnlp.retrieval import memory as kv
    label_B, weight_B = batch["label"], batch["weight"]
    sums = _classification_sums(logits_BC, label_B, weight_B)
    memory = jax.lax.stop_gradient(memory)
    hit_B = (kv.predict(memory, q_BQ) == label_B).astype(jnp.float32)
    loss_B = kv.margin_loss(memory, q_BQ, label_B, k=mc.k, margin=mc.margin)
    sums.update(correct_head=sums["correct"], correct_memory=jnp.sum(hit_B * weight_B),
                loss_memory=jnp.sum(loss_B * weight_B))
    if mc.predict == "memory":
        sums["correct"] = sums["correct_memory"]
    return sums


class Classifier(nn.Module):
    """Encoder + pooled linear head. Batches: inputs, segment_ids [B, L]; label, weight [B].

    With `model.memory.size` > 0 it also queries a key-value memory with ages (Kaiser et al.
    2017, hpnlp.retrieval.memory; Q = model.memory.key_dim): the query is the normalized
    projection of the pooled encoding. The memory is not a parameter: it is passed in
    (`loss_and_memory`, `evaluate`; the train state's `kv_memory` carry holds it), and a call
    without one sees an empty memory."""

    cfg: Config
    deterministic: bool = True
    embed_weights: Any = None  # RowWeights of model.embed_grad_scale="corpus" (models.build)

    def setup(self):
        m = self.cfg.model
        self.embed = make_embed(m, grad_weights=self.embed_weights)
        self.trunk = make_trunk(self.cfg, causal=m.causal, deterministic=self.deterministic)
        pdt = dtypes(m)[1]
        self.head = Dense(m.num_classes, quant=m.quant, kind="head", dtype=jnp.float32,
                          param_dtype=pdt,
                          kernel_init=_init(nn.initializers.lecun_normal(), ("embed", None)),
                          bias_init=_init(nn.initializers.zeros, (None,)))
        if m.memory.size:  # the key-value memory's query projection
            self.memory_query = nn.Dense(
                m.memory.key_dim, dtype=jnp.float32, param_dtype=pdt,
                kernel_init=_init(nn.initializers.lecun_normal(), ("embed", None)),
                bias_init=_init(nn.initializers.zeros, (None,)))

    def pooled(self, batch):
        """The pooled encoding [B, E] the head (and the memory's query) reads."""
        seg_BL = batch["segment_ids"]
        h_BLE = self.trunk(self.embed, batch["inputs"], seg_BL, positions_of(seg_BL))
        return _pool(h_BLE, seg_BL, self.cfg.model.pool)

    def logits(self, batch):
        return self.head(self.pooled(batch))

    def query(self, h_BE):
        """The memory's unit query [B, Q] of pooled encodings."""
        from hpnlp.retrieval import memory as kv
        return kv.normalize(self.memory_query(h_BE))

    def _memory(self, memory):
        from hpnlp.retrieval import memory as kv
        mc = self.cfg.model.memory
        return kv.empty(mc.size, mc.key_dim) if memory is None else memory

    def __call__(self, batch):
        if not self.cfg.model.memory.size:
            return _classification_sums(self.logits(batch), batch["label"], batch["weight"])
        return self.evaluate(batch)

    def loss_and_memory(self, batch, memory=None):
        """(sums, the memory updated by the batch's examples in order); the sums measure the
        memory as it was before this batch."""
        from hpnlp.retrieval import memory as kv
        h_BE = self.pooled(batch)
        q_BQ, memory = self.query(h_BE), self._memory(memory)
        sums = _memory_sums(self.head(h_BE), q_BQ, batch, memory, self.cfg.model.memory)
        return sums, kv.update(memory, q_BQ, batch["label"], batch["weight"])

    def evaluate(self, batch, memory=None):
        if not self.cfg.model.memory.size:
            return _classification_sums(self.logits(batch), batch["label"], batch["weight"])
        h_BE = self.pooled(batch)
        return _memory_sums(self.head(h_BE), self.query(h_BE), batch, self._memory(memory),
                            self.cfg.model.memory)

    def predictions(self, batch, memory=None):
        """{"head": the head's class [B], and with a memory "memory": its nearest key's value
        [B] (-1 while the memory is empty)}."""
        h_BE = self.pooled(batch)
        out = {"head": jnp.argmax(self.head(h_BE), axis=-1).astype(jnp.int32)}
        if self.cfg.model.memory.size:
            from hpnlp.retrieval import memory as kv
            out["memory"] = kv.predict(self._memory(memory), self.query(h_BE))
        return out


class DualEncoder(nn.Module):
    """Siamese encoder for matching (LRA retrieval): one shared trunk encodes both texts, in
    one call (`encode_sides`); the head sees [u, v, u*v, u-v]. Batches: inputs1/2,
    segment_ids1/2, label, weight."""

    cfg: Config
    deterministic: bool = True
    embed_weights: Any = None  # RowWeights of model.embed_grad_scale="corpus" (models.build)

    def setup(self):
        m = self.cfg.model
        pdt = dtypes(m)[1]
        self.embed = make_embed(m, grad_weights=self.embed_weights)
        self.trunk = make_trunk(self.cfg, causal=False, deterministic=self.deterministic)
        dense = lambda n, name: Dense(n, quant=m.quant, kind="head", dtype=jnp.float32,
                                      param_dtype=pdt, name=name,
                                      kernel_init=_init(nn.initializers.lecun_normal(), (None, None)),
                                      bias_init=_init(nn.initializers.zeros, (None,)))
        self.mlp = dense(m.mlp_dim, "mlp")
        self.head = dense(m.num_classes, "head")

    def encode(self, tokens_BL, seg_BL):
        h_BLE = self.trunk(self.embed, tokens_BL, seg_BL, positions_of(seg_BL))
        return _pool(h_BLE, seg_BL, self.cfg.model.pool)

    def sides(self, batch):
        """(u, v) [B, E]: both texts through one trunk call (`encode_sides`: one random-feature
        draw for both)."""
        return encode_sides(self.encode, (batch["inputs1"], batch["segment_ids1"]),
                            (batch["inputs2"], batch["segment_ids2"]))

    def logits(self, batch):
        u_BE, v_BE = self.sides(batch)
        feats = jnp.concatenate([u_BE, v_BE, u_BE * v_BE, u_BE - v_BE], axis=-1)
        return self.head(nn.gelu(self.mlp(feats)))

    def __call__(self, batch):
        return _classification_sums(self.logits(batch), batch["label"], batch["weight"])

    evaluate = __call__
