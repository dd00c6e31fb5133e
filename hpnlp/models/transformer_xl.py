"""Transformer-XL: segment recurrence with relative positions, for the causal LM.

Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a Fixed-Length
Context". The idea that makes it cheap: each layer keeps the previous segment's hidden
states as a *memory* (stop-gradient, so the backward pass never leaves the segment) and
attends over [memory; current]. The context then reaches depth x M tokens back at the cost
of one segment. Positions are *relative* (a score depends on the distance i - j, never on
absolute positions), so cached states stay valid when reused at a new offset.

Score of query i and key j at distance d = i - j (paper eq. 4, with q = W_q x_i,
k = W_k x_j, R the sinusoidal table, u / v learned global biases):

    (q + u) . k  +  (q + v) . W_R R_d

The position term is computed for all K distances per query ([L, K], ordered d = K-1..0)
and moved to key order with the pad-and-reshape "rel_shift" trick of the authors' code
(`rel_shift`, one pad + reshape instead of a gather); `rel_gather` is its exact twin.

Masking: a key is attended iff it is real (memory slots of a fresh memory, and padding,
are not), at or before the query, and, inside the current segment, in the query's
segment id. Memory keys are visible to every query of the row: stream batches
(`data.batching = "stream"`, hpnlp/data/stream.py) have one document stream per row and no
padding except at the very end of the stream, so packing across the memory boundary is
not modelled.

**Compressive Transformer** (Rae et al. 2020, "Compressive Transformers for Long-Range
Sequence Modelling"; model.comp_mem_len > 0). Instead of dropping what falls out of the
memory, each layer compresses it R to one slot (`pool_compress`, strided mean, or
`ConvCompress`, a learned convolution with kernel = stride = R) into a second FIFO memory of
C slots, and attends over [compressed memory; memory; segment]: the context reaches
depth x (M + R C) tokens back for the cost of C + M keys. A compressed slot takes one
relative position, like any key (the authors' layout), so with R = 1 and pooling the model
*is* XL with memory C + M (the twin tests/test_compressive.py checks). A slot is valid iff
all R of its positions were (a group is never split by a fresh memory's edge, as R divides
L and M, so only the padding at a stream's end drops a slot). The compressed memory is
stop-gradient and made after the segment's loss reads it, so the LM loss never trains the
compressor; the *attention-reconstruction loss* does (paper sec 3.2, Algorithm 1,
`reconstruction_loss`): per layer, the squared error between the layer's content attention
over the evicted positions and over their compressed slots, queries from the segment's layer
inputs, with those inputs and the attention's parameters stop-gradient. Layers report it in
the `aux` collection (hpnlp.train.carry.fold_aux) as `loss_recon` (mean over layers), added
to the objective times model.comp_loss_weight (summed over layers).

Shape letters: B batch, L segment length, M memory length (model.mem_len, 0: = data.seq_len;
0 in a pass given no memory to carry on, `TransformerXLLM._memory`), C compressed memory
length (model.comp_mem_len), R compression rate (model.comp_rate), G = L / R slots each
segment compresses into, N = C + M keys before the segment, K = N + L keys, E width,
H heads, D head dim (E / H), F MLP width, X layers (model.depth), V vocabulary.

    >>> model = TransformerXLLM(cfg, deterministic=False)            # doctest: +SKIP
    >>> memory = init_memory(cfg, batch_size)                        # doctest: +SKIP
    >>> sums, memory = model.apply(variables, batch, memory, method="loss_and_memory")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from hpnlp.attention.base import attend
from hpnlp.config import Config, ModelConfig
from hpnlp.train.carry import AUX, Carry, fold_aux
from hpnlp.models.transformer import (Dropout, _init, dtypes, embed_tokens, layer_norm,
                                      make_embed, mlp, remat_block, sinusoidal_table)


class Memory(NamedTuple):
    """What one segment leaves for the next (a pytree; carried across steps). The compressed
    fields are None unless model.comp_mem_len > 0."""

    hidden_XBME: jax.Array  # each layer's *input* at the last M positions, stop-gradient
    valid_BM: jax.Array  # bool: a real token (False: fresh memory, padding)
    comp_XBCE: jax.Array | None = None  # each layer's compressed memory, oldest first, stop-gradient
    comp_valid_BC: jax.Array | None = None  # bool: built from R real tokens


def mem_len(cfg: Config) -> int:
    return cfg.model.mem_len or cfg.data.seq_len


def init_memory(cfg: Config, batch_size: int, *, slots: int | None = None) -> Memory:
    """An empty memory: nothing valid, so the first segment attends only to itself. `slots`:
    its plain slots M (default `mem_len`; 0 for a pass that carries no memory on)."""
    m, C = cfg.model, cfg.model.comp_mem_len
    M = mem_len(cfg) if slots is None else slots
    dt = dtypes(m)[0]
    comp = ((jnp.zeros((m.depth, batch_size, C, m.width), dt), jnp.zeros((batch_size, C), bool))
            if C else (None, None))
    return Memory(jnp.zeros((m.depth, batch_size, M, m.width), dt),
                  jnp.zeros((batch_size, M), bool), *comp)


def fresh_rows(memory: Memory, rows_B) -> Memory:
    """`memory` with the rows where `rows_B` is True emptied: no valid slot, and zeros in
    every slot. The values go too (found in review): a masked slot still meets the value
    product as 0 * v, and an overflowed row's inf turns NaN under the next segment's layer
    norm, so invalid alone gave every query of the row NaN and skipped the steps after."""
    keep_B1 = ~rows_B[:, None]

    def clear(x_XBSE):
        return None if x_XBSE is None else jnp.where(rows_B[None, :, None, None], 0, x_XBSE)
    return memory._replace(
        hidden_XBME=clear(memory.hidden_XBME), valid_BM=memory.valid_BM & keep_B1,
        comp_XBCE=clear(memory.comp_XBCE), comp_valid_BC=(
            None if memory.comp_valid_BC is None else memory.comp_valid_BC & keep_B1))


def carries_memory(cfg: Config) -> bool:
    """The Trainer carries memory across steps only on stream batches, where row b of the
    next batch continues row b of this one; on other batchings every batch starts afresh."""
    return cfg.model.arch == "transformer_xl" and cfg.data.batching == "stream"


def boxed_memory(cfg: Config, batch_size: int) -> Memory:
    """`init_memory` with logical axis names: its rows are split like the batch's."""
    hidden, valid = (None, "batch", None, "activation_embed"), ("batch", None)
    return Memory(*(None if x is None else nn.LogicallyPartitioned(x, names)
                    for x, names in zip(init_memory(cfg, batch_size), (hidden, valid, hidden, valid))))


class MemoryCarry(Carry):
    """The memory as the train state's `memory` carry (hpnlp.train.carry): each step's
    segment reads the previous one's memory and leaves its own (stop-gradient inside the
    model, so no gradient crosses the step boundary). The layers' reports (the compressive
    memory's reconstruction loss) fold into the sums like model_loss's."""

    name = "memory"  # validate keeps train.grad_accum at 1: row b continues row b of the last batch

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def init(self, model, params, batch, batch_size: int) -> Memory:
        return boxed_memory(self.cfg, batch_size)

    def skipped(self, new, old, applied):
        """The stream has moved on past the segment a skipped float16 step read, so the
        memory does too (found in review: the old one came back, and the next segment read
        the one before its predecessor as its predecessor); where the forward pass itself
        overflowed, the rows start afresh."""
        del old, applied
        finite_B = jnp.all(jnp.isfinite(new.hidden_XBME), axis=(0, 2, 3))
        if new.comp_XBCE is not None:
            finite_B &= jnp.all(jnp.isfinite(new.comp_XBCE), axis=(0, 2, 3))
        return fresh_rows(new, ~finite_B)

    def loss(self, model, inner):
        del inner  # the memory replaces the model's plain loss (validate: nothing else wraps it)

        def memory_loss(params, carry, batch, rngs):
            (sums, memory), aux = model.apply({"params": params}, batch, carry["memory"],
                                              method="loss_and_memory", rngs=rngs, mutable=[AUX])
            return fold_aux(sums, aux.get(AUX)), {**carry, "memory": memory}
        return memory_loss


def memory_sharding(cfg: Config, batch_size: int, mesh, rules) -> Memory:
    from hpnlp.parallel.mesh import state_shardings
    return state_shardings(jax.eval_shape(lambda: boxed_memory(cfg, batch_size)), mesh, rules)


# -- relative attention --------------------------------------------------------------------


def rel_shift(x_BHLK):
    """[.., L, K] indexed (query i, column r = distance K-1-r) -> (query i, key j), where
    key j is at distance d = M + i - j (M = K - L memory slots before query 0).

    Pad a zero column in front, view the [L, K+1] block as [K+1, L], drop the first row
    and view it back as [L, K]: row i moves left by L-1-i. Entries with j > M + i (future
    keys, always masked) hold garbage.
    """
    B, H, L, K = x_BHLK.shape
    x_BHLK1 = jnp.pad(x_BHLK, ((0, 0), (0, 0), (0, 0), (1, 0)))
    return x_BHLK1.reshape(B, H, K + 1, L)[:, :, 1:].reshape(B, H, L, K)


def rel_gather(x_BHLK):
    """The exact twin of `rel_shift` on every allowed entry: an explicit gather of column
    r = L-1-i+j (future keys clipped to a valid column)."""
    B, H, L, K = x_BHLK.shape
    col_LK = np.clip(np.arange(K)[None, :] - np.arange(L)[:, None] + L - 1, 0, K - 1)
    return jnp.take_along_axis(x_BHLK, jnp.broadcast_to(jnp.asarray(col_LK), x_BHLK.shape), axis=-1)


def rel_attention(q_BLHD, k_BKHD, v_BKHD, r_KHD, u_HD, w_HD, allowed_BLK, *, shift=rel_shift):
    """Exact softmax attention with Transformer-XL relative scores, in float32.

    `r_KHD` is the projected relative table ordered by distance K-1..0; `u_HD` / `w_HD` are
    the content / position biases (the paper's u and v). Rows with no allowed key give 0.
    """
    D = q_BLHD.shape[-1]
    f32 = jnp.float32
    q_BLHD = q_BLHD.astype(f32)
    content_BHLK = jnp.einsum("blhd,bkhd->bhlk", q_BLHD + u_HD.astype(f32)[None, None],
                              k_BKHD.astype(f32))
    position_BHLK = shift(jnp.einsum("blhd,khd->bhlk", q_BLHD + w_HD.astype(f32)[None, None],
                                     r_KHD.astype(f32)))
    logits_BHLK = (content_BHLK + position_BHLK) / jnp.asarray(math.sqrt(D), f32)
    allowed_B1LK = allowed_BLK[:, None]
    logits_BHLK = jnp.where(allowed_B1LK, logits_BHLK, -1e30)
    m_BHL1 = jax.lax.stop_gradient(jnp.max(logits_BHLK, axis=-1, keepdims=True))
    p_BHLK = jnp.where(allowed_B1LK, jnp.exp(logits_BHLK - m_BHL1), 0.0)
    p_BHLK = p_BHLK / jnp.maximum(jnp.sum(p_BHLK, axis=-1, keepdims=True), 1e-30)
    return attend(p_BHLK, v_BKHD, k_BKHD.dtype)


def allowed_keys(seg_BL, valid_BM):
    """[B, L, K] bool: real keys, causal, memory visible to all, current keys in the
    query's segment."""
    B, L = seg_BL.shape
    M = valid_BM.shape[1]
    K = M + L
    valid_BK = jnp.concatenate([valid_BM, seg_BL > 0], axis=1)
    seg_BK = jnp.concatenate([jnp.zeros((B, M), seg_BL.dtype), seg_BL], axis=1)
    j_K, i_L = np.arange(K), np.arange(L)
    causal_LK = jnp.asarray(j_K[None, :] <= M + i_L[:, None])
    in_memory_K = jnp.asarray(j_K < M)
    same_BLK = seg_BL[:, :, None] == seg_BK[:, None, :]
    return (valid_BK[:, None, :] & causal_LK[None] &
            (in_memory_K[None, None, :] | same_BLK))


# -- compressive memory ------------------------------------------------------------------


def pool_compress(old_BLE, rate: int):
    """Strided mean pooling: each run of `rate` positions -> one slot, [B, L / rate, E]."""
    B, L, E = old_BLE.shape
    old_BGRE = old_BLE.astype(jnp.float32).reshape(B, L // rate, rate, E)
    return jnp.mean(old_BGRE, axis=2).astype(old_BLE.dtype)


class ConvCompress(nn.Module):
    """The paper's best compression function: a 1-D convolution with kernel = stride = R, one
    per layer (slot g = b + sum_r W_r old[g R + r]). It starts as mean pooling (W_r = I / R),
    so the compressed memory is useful from the first step; only the reconstruction loss
    trains it."""

    model: ModelConfig

    @nn.compact
    def __call__(self, old_BLE):
        m = self.model
        dt, pdt = dtypes(m)
        R, E = m.comp_rate, m.width
        B, L, _ = old_BLE.shape

        def mean_pool(key, shape, dtype):
            return jnp.broadcast_to(jnp.eye(E, dtype=dtype) / R, shape)

        w_REE = self.param("kernel", _init(mean_pool, (None, "embed", None)), (R, E, E), pdt)
        b_E = self.param("bias", _init(nn.initializers.zeros, (None,)), (E,), pdt)
        old_BGRE = old_BLE.astype(dt).reshape(B, L // R, R, E)
        return jnp.einsum("bgre,ref->bgf", old_BGRE, w_REE.astype(dt)) + b_E.astype(dt)[None, None]


def content_attention(block, m: ModelConfig, h_BLE, kv_BNE, valid_BN):
    """Algorithm 1's attn(h, mem) with an XL block's parameters `block` (its `norm1` and
    query/key/value projections): plain content softmax over `kv` (no positions, and no
    causal mask: the compressor's reconstruction target, whose keys may include positions of
    the current segment where model.mem_len < data.seq_len; only later segments read the
    compressed slots, so nothing past a prediction reaches it), each head's output
    [B, L, H, D] before
    the output projection, in float32. Rows with no valid key give 0."""
    f32 = jnp.float32
    norm = nn.LayerNorm(dtype=f32, param_dtype=dtypes(m)[1], parent=None)
    ln = lambda x: norm.apply({"params": block["norm1"]}, x.astype(f32))  # noqa: E731
    w_E3HD = block["attention"]["qkv"].astype(f32)
    q_BLHD = jnp.einsum("ble,ehd->blhd", ln(h_BLE), w_E3HD[:, 0])
    kv_BN2HD = jnp.einsum("bne,ejhd->bnjhd", ln(kv_BNE), w_E3HD[:, 1:])
    logits_BHLN = jnp.einsum("blhd,bnhd->bhln", q_BLHD, kv_BN2HD[:, :, 0]) / jnp.asarray(
        math.sqrt(q_BLHD.shape[-1]), f32)
    valid_B11N = valid_BN[:, None, None, :]
    logits_BHLN = jnp.where(valid_B11N, logits_BHLN, -1e30)
    p_BHLN = jnp.where(valid_B11N, jnp.exp(logits_BHLN - jnp.max(logits_BHLN, -1, keepdims=True)), 0.0)
    p_BHLN = p_BHLN / jnp.maximum(jnp.sum(p_BHLN, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bhln,bnhd->blhd", p_BHLN, kv_BN2HD[:, :, 1])


def reconstruction_loss(block, m: ModelConfig, h_BLE, old_BLE, new_BGE, valid_BG, query_BL):
    """The attention-reconstruction loss of one layer (paper sec 3.2, Algorithm 1):
    || attn(h, old) - attn(h, compressed(old)) ||^2, the mean over real queries, heads and
    dims. `h` (the segment's layer inputs), `old` (the evicted positions) and the block's
    parameters are stop-gradient, so only the compressor that made `new` learns from it.
    The evicted positions are read under their slots' validity, so both sides see the same
    tokens."""
    sg = jax.lax.stop_gradient
    block, h_BLE, old_BLE = jax.tree.map(sg, (block, h_BLE, old_BLE))
    R = old_BLE.shape[1] // new_BGE.shape[1]
    target_BLHD = content_attention(block, m, h_BLE, old_BLE, jnp.repeat(valid_BG, R, axis=1))
    got_BLHD = content_attention(block, m, h_BLE, new_BGE, valid_BG)
    err_BL = jnp.sum(jnp.square(got_BLHD - target_BLHD), axis=(2, 3))
    w_BL = query_BL.astype(jnp.float32)
    H, D = target_BLHD.shape[2:]
    return jnp.sum(err_BL * w_BL) / (jnp.maximum(jnp.sum(w_BL), 1.0) * H * D)


# -- layers ------------------------------------------------------------------------------


class XLAttention(nn.Module):
    """Fused QKV (queries from the segment, keys/values from [memory; segment]), the
    relative projection W_R, relative attention, output projection. Same parameter names
    and logical axes as transformer.MultiHeadAttention, plus `rel` [E, H, D]."""

    model: ModelConfig

    @nn.compact
    def __call__(self, h_BKE, rel_KE, u_HD, w_HD, allowed_BLK):
        m = self.model
        dt, pdt = dtypes(m)
        H, D = m.num_heads, m.dims_per_head()
        L = allowed_BLK.shape[1]
        w_E3HD = self.param("qkv", _init(nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2, 3)),
                                         ("embed", None, "heads", "kv")), (m.width, 3, H, D), pdt)
        w_EHD = self.param("rel", _init(nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
                                        ("embed", "heads", "kv")), (m.width, H, D), pdt)
        h_BKE = h_BKE.astype(dt)
        q_BLHD = jnp.einsum("ble,ehd->blhd", h_BKE[:, -L:], w_E3HD[:, 0].astype(dt))
        kv_BK2HD = checkpoint_name(jnp.einsum("bke,enhd->bknhd", h_BKE,
                                              w_E3HD[:, 1:].astype(dt)), "qkv")
        r_KHD = jnp.einsum("ke,ehd->khd", rel_KE.astype(dt), w_EHD.astype(dt))
        out_BLHD = checkpoint_name(
            rel_attention(q_BLHD, kv_BK2HD[:, :, 0], kv_BK2HD[:, :, 1], r_KHD, u_HD, w_HD,
                          allowed_BLK), "context")
        w_HDE = self.param("out", _init(nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
                                        ("heads", "kv", "embed")), (H, D, m.width), pdt)
        return checkpoint_name(jnp.einsum("blhd,hde->ble", out_BLHD.astype(dt), w_HDE.astype(dt)),
                               "attention_out")


class XLBlock(nn.Module):
    """Pre-LN block like transformer.Block; the attention reads LN([memory; x]) (`mem_BME`:
    every key before the segment, [compressed; memory] for the Compressive Transformer)."""

    model: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BLE, mem_BME, rel_KE, u_HD, w_HD, allowed_BLK):
        m = self.model
        drop = functools.partial(Dropout, rate=m.dropout, deterministic=self.deterministic)
        h_BKE = layer_norm(m, "norm1")(jnp.concatenate([mem_BME.astype(x_BLE.dtype), x_BLE], axis=1))
        x_BLE = x_BLE + drop()(XLAttention(m, name="attention")(h_BKE, rel_KE, u_HD, w_HD,
                                                                  allowed_BLK))
        x_BLE = x_BLE + drop()(mlp(m, layer_norm(m, "norm2")(x_BLE)))
        return nn.with_logical_constraint(x_BLE, ("batch", "length", "activation_embed"))


class XLTrunk(nn.Module):
    """Token embeddings (no absolute positions), `depth` XL blocks, final LayerNorm.

    Returns (hidden [B, L, E], the new Memory). With a compressed memory, each layer also
    compresses the L positions it evicts (the oldest of [memory; segment]) and, when the
    `aux` collection is mutable (training), reports its reconstruction loss there.
    `window_LK` and `frozen_L` exist for the reference twin only (tests): an extra key mask,
    and positions whose layer inputs are stop-gradient (what a memory is).
    """

    model: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, embed: nn.Module, tokens_BL, seg_BL, memory: Memory, *,
                 window_LK=None, frozen_L=None):
        m = self.model
        dt, pdt = dtypes(m)
        H, D = m.num_heads, m.dims_per_head()
        B, L = tokens_BL.shape
        M = memory.valid_BM.shape[1]
        comp = memory.comp_XBCE is not None
        C = memory.comp_XBCE.shape[2] if comp else 0
        K = C + M + L
        if memory.hidden_XBME.shape != (m.depth, B, M, m.width):
            raise ValueError(f"memory holds {memory.hidden_XBME.shape}, expected [depth, batch, "
                             f"mem_len, width] = {(m.depth, B, M, m.width)}; make it with init_memory")
        if bool(m.comp_mem_len) != comp:
            raise ValueError(f"model.comp_mem_len={m.comp_mem_len} but the memory "
                             f"{'has' if comp else 'has no'} compressed part; make it with init_memory")
        # Shared by all layers (the paper's global u, v); zero init: training starts from
        # plain content + position scores.
        u_HD = self.param("u", _init(nn.initializers.zeros, ("heads", "kv")), (H, D), pdt)
        w_HD = self.param("v", _init(nn.initializers.zeros, ("heads", "kv")), (H, D), pdt)
        rel_KE = jnp.asarray(sinusoidal_table(K, m.width)[::-1].copy())  # distance K-1 .. 0
        # Keys [compressed; memory; segment]: the compressed slots are more memory to allowed_keys.
        read_valid_BN = (jnp.concatenate([memory.comp_valid_BC, memory.valid_BM], axis=1) if comp
                         else memory.valid_BM)
        allowed_BLK = allowed_keys(seg_BL, read_valid_BN)
        window_valid_BW = jnp.concatenate([memory.valid_BM, seg_BL > 0], axis=1)  # W = M + L
        if comp:
            R = m.comp_rate
            slot_valid_BG = jnp.all(window_valid_BW[:, :L].reshape(B, L // R, R), axis=-1)
            recon = self.is_mutable_collection(AUX)
        if window_LK is not None:
            allowed_BLK = allowed_BLK & window_LK[None]
        x_BLE = (embed_tokens(embed, tokens_BL, seg_BL).astype(dt)
                 * jnp.asarray(np.sqrt(m.width), dt))
        x_BLE = Dropout(m.dropout, deterministic=self.deterministic)(x_BLE)
        x_BLE = nn.with_logical_constraint(x_BLE, ("batch", "length", "activation_embed"))
        block_cls = remat_block(XLBlock, m)
        new_XBME, new_XBCE = [], []
        for i in range(m.depth):
            if frozen_L is not None:
                x_BLE = jnp.where(frozen_L[None, :, None], jax.lax.stop_gradient(x_BLE), x_BLE)
            mem_BME = memory.hidden_XBME[i].astype(dt)
            window_BWE = jnp.concatenate([mem_BME, x_BLE], axis=1)
            new_XBME.append(jax.lax.stop_gradient(window_BWE[:, L:]))
            read_BNE = mem_BME
            if comp:  # the L oldest of [memory; segment] leave the memory: compress them
                cmem_BCE = memory.comp_XBCE[i].astype(dt)
                read_BNE = jnp.concatenate([cmem_BCE, mem_BME], axis=1)
                old_BLE = jax.lax.stop_gradient(window_BWE[:, :L])
                new_BGE = (pool_compress(old_BLE, R) if m.comp_fn == "pool" else
                           ConvCompress(m, name=f"compress_{i}")(old_BLE)).astype(dt)
                new_XBCE.append(jax.lax.stop_gradient(
                    jnp.concatenate([cmem_BCE, new_BGE], axis=1)[:, -C:]))
            x_next_BLE = block_cls(m, self.deterministic, name=f"block_{i}")(
                x_BLE, read_BNE, rel_KE, u_HD, w_HD, allowed_BLK)
            if comp and recon:
                block = nn.unbox(self.variables["params"][f"block_{i}"])
                loss = reconstruction_loss(block, m, x_BLE, old_BLE, new_BGE, slot_valid_BG,
                                           seg_BL > 0)
                self.sow(AUX, "reconstruction", {"loss": m.comp_loss_weight * loss,
                                                 "loss_recon": loss})
            x_BLE = x_next_BLE
        valid_BM = window_valid_BW[:, L:]
        hidden_BLE = layer_norm(m, "final_norm")(x_BLE)
        new = Memory(jnp.stack(new_XBME).astype(memory.hidden_XBME.dtype), valid_BM)
        if comp:
            new = new._replace(
                comp_XBCE=jnp.stack(new_XBCE).astype(memory.comp_XBCE.dtype),
                comp_valid_BC=jnp.concatenate([memory.comp_valid_BC, slot_valid_BG], axis=1)[:, -C:])
        return hidden_BLE, new


class TransformerXLLM(nn.Module):
    """Causal LM on the XL trunk, with any registry output layer (heads._output_layer).

    `loss_and_memory(batch, memory)` / `evaluate_and_memory(batch, memory)` carry the
    memory; `__call__(batch)` / `evaluate(batch)` start every batch from no memory (what
    the generic Trainer does: no state beyond the parameters; M = 0, a compressive model
    its empty slots: `_memory`). Batches: inputs, targets, segment_ids [B, L]; positions,
    where present, are not embedded (XL is relative), but a row whose first position is 0
    starts a new text, so its memory is emptied (`_memory`: the first batch of a stream's
    epoch, a pad or pack batch given a memory). With model.comp_mem_len > 0 the memory
    carries the compressed memory too, and an apply with the `aux` collection mutable gets
    the reconstruction loss there (MemoryCarry folds it in).
    """

    cfg: Config
    deterministic: bool = True
    decode: bool = False
    token_counts: Any = None
    embed_weights: Any = None  # RowWeights of model.embed_grad_scale="corpus" (models.build)

    def setup(self):
        from hpnlp.models.heads import _output_layer  # heads imports the model registry
        if self.decode:
            raise ValueError("model.arch='transformer_xl' has no incremental decode cache yet; "
                             "generate with model.arch='transformer'")
        self.embed = make_embed(self.cfg.model, grad_weights=self.embed_weights)
        self.trunk = XLTrunk(self.cfg.model, self.deterministic)
        self.output = _output_layer(self.cfg, self.embed, self.token_counts)

    def _memory(self, batch, memory):
        if memory is None:  # nothing before the batch: no plain slots (review r11: M =
            # data.seq_len empty ones doubled every pack/pad pass's keys, all masked; the
            # outputs are the same, as a real key's distance does not depend on M). A
            # compressive model keeps its M: with none its segment would be what leaves the
            # memory, compressed and reconstructed (another loss_recon and compressed memory)
            plain = None if self.cfg.model.comp_mem_len else 0
            return init_memory(self.cfg, batch["inputs"].shape[0], slots=plain)
        if "positions" in batch:  # a stream row at position 0 starts over (a new epoch, at
            # another offset): nothing before it (found in review: it read the last epoch's)
            memory = fresh_rows(memory, batch["positions"][:, 0] == 0)
        return memory

    def hidden(self, batch, memory=None, **reference):
        return self.trunk(self.embed, batch["inputs"], batch["segment_ids"],
                          self._memory(batch, memory), **reference)

    def loss_and_memory(self, batch, memory=None, **reference):
        """(sums {"loss", "weight"} like heads.TransformerLM, the new Memory)."""
        mask_BL = batch["segment_ids"] > 0
        h_BLE, new = self.hidden(batch, memory, **reference)
        loss_BL = self.output.loss(h_BLE, batch["targets"], mask_BL, deterministic=self.deterministic)
        from hpnlp.models.heads import check_token_losses  # heads imports the model registry
        check_token_losses(self.output, loss_BL, mask_BL)
        return {"loss": jnp.sum(jnp.where(mask_BL, loss_BL, 0.0), dtype=jnp.float32),
                "weight": jnp.sum(mask_BL, dtype=jnp.float32)}, new

    def evaluate_and_memory(self, batch, memory=None):
        """Exact sums (the output layer's normalized log-probs, token-chunked as the loss
        where the layer chunks its logits: `heads.lm_eval_sums`) and the new Memory."""
        from hpnlp.models.heads import lm_eval_sums  # heads imports the model registry
        h_BLE, new = self.hidden(batch, memory)
        return lm_eval_sums(self.output, h_BLE, batch), new

    def log_probs(self, batch, memory=None):
        return self.output.log_prob(self.hidden(batch, memory)[0])

    def __call__(self, batch):
        return self.loss_and_memory(batch)[0]

    def evaluate(self, batch):
        return self.evaluate_and_memory(batch)[0]
