"""`clustered`: content-based sparse attention by online k-means routing (Roy et al. 2021,
"Efficient Content-Based Sparse Attention with Routing Transformers").

The idea: queries and keys that are close in direction are the ones with large dot
products, so route every token to its nearest of `num_clusters` centroids and let it
attend only within its cluster. Tokens are sorted by (segment, cluster, position) and a
token attends to the tokens of its own cluster and segment that lie within `chunk_size`
slots of it in that order (causal: its own and the `chunk_size - 1` previous ones; not
causal: up to `chunk_size - 1` on each side). The sorted sequence is cut into chunks of
`chunk_size`, and a chunk only looks at itself and its neighbours, so scores cost
O(L * chunk_size), never O(L^2), as in Reformer's sort-and-chunk.

Routing: one assignment per token, the centroid c maximizing cos(q, c) + cos(k, c) (the
joint nearest centroid of the token's unit query and unit key), so a token's query meets
its own key and every real query has at least one key. Positions are kept through the
sort: in causal mode a token attends only to earlier tokens, and which tokens it sees
depends on the past alone (its last `chunk_size` cluster-mates), so decoding with a
key/value/cluster cache reproduces the forward pass exactly. With one cluster and
chunk_size >= L this is dense attention.

Centroids: a `centroids` parameter [H, C, D] (spherical: compared after normalizing).
The training step only updates `params`, so the paper's exponential moving average cannot
be stored; instead the optimizer trains the centroids on the k-means objective
sum_t (|u(q_t) - mu_c(t)|^2 + |u(k_t) - mu_c(t)|^2) / 2, u(x) = x / |x| (mini-batch
k-means by gradient descent). Its gradient, the sum over the tokens of cluster c of
(2 mu_c - u(q_t) - u(k_t)), is injected through a custom VJP, because the attention
output depends on the centroids only through the discrete assignment (zero task
gradient). q and k get no gradient from routing, as in the paper. Being no gradient of the
objective, it is left out of global-norm clipping and the logged grad_norm
(`train.state.clips`): a review (session 109) measured it at 95-100% of the norm, which scaled
every other gradient by 1/8 to 1/21 in the byte LM and 7.3e-4 in the LRA ListOps
classifier. The injected gradient is not scaled by the cotangent that arrives, so
float16's loss scale (which the train step multiplies into the loss and divides out of every
gradient) would divide it: a new run of `clustered` with model.dtype='float16' is refused
(`config.checks.check_new_run`); a layer cannot learn the scale from its cotangents alone.

Reversible blocks: the assignment is kept in the `routing` variable collection when the
caller makes it mutable and read from it when the caller passes it (`base.kept_routing`),
so a reversible backward, which recomputes attention on an input rebuilt from the block's
outputs (equal only to rounding), routes as the forward did (a bug hunt (session 100): in
bfloat16 one rounding can flip the argmax).

Shape letters: B batch, L length (P once padded to whole chunks), H heads, D head dim,
C clusters, N chunks, W chunk size, K key slots a chunk sees (2W causal, 3W not), T cache.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.attention.base import (Attention, cache_put, check_inputs, check_one_token,
                                  kept_routing, masked_softmax_attention, register)
from hpnlp.config import ConfigError

_NEG = -1e30


def _unit(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


def route(q_BLHD, k_BLHD, centroids_HCD):
    """Cluster of every token and head -> int32 [B, L, H]: argmax_c cos(q, c) + cos(k, c)."""
    x_BLHD = jax.lax.stop_gradient(_unit(q_BLHD) + _unit(k_BLHD))
    c_HCD = jax.lax.stop_gradient(_unit(centroids_HCD))
    return jnp.argmax(jnp.einsum("blhd,hcd->blhc", x_BLHD, c_HCD), axis=-1).astype(jnp.int32)


def kmeans_grad(q_BLHD, k_BLHD, centroids_HCD, cluster_BLH, valid_BL):
    """d/d mu of sum_t (|u(q_t) - mu_c(t)|^2 + |u(k_t) - mu_c(t)|^2) / 2 over real tokens."""
    C = centroids_HCD.shape[1]
    onehot_BLHC = jax.nn.one_hot(cluster_BLH, C, dtype=jnp.float32) * valid_BL[:, :, None, None]
    x_BLHD = _unit(q_BLHD) + _unit(k_BLHD)
    count_HC = jnp.sum(onehot_BLHC, axis=(0, 1))
    total_HCD = jnp.einsum("blhc,blhd->hcd", onehot_BLHC, x_BLHD)
    return 2.0 * count_HC[:, :, None] * centroids_HCD - total_HCD


@jax.custom_vjp
def _with_kmeans_grad(q_BLHD, centroids_HCD, grad_HCD):
    """Identity on q; in the backward pass the centroids receive `grad_HCD`."""
    return q_BLHD


def _tap_fwd(q_BLHD, centroids_HCD, grad_HCD):
    return q_BLHD, grad_HCD


def _tap_bwd(grad_HCD, g_BLHD):
    return g_BLHD, grad_HCD, jnp.zeros_like(grad_HCD)


_with_kmeans_grad.defvjp(_tap_fwd, _tap_bwd)


def clustered_attention(q_BLHD, k_BLHD, v_BLHD, cluster_BLH, seg_BL, *, causal: bool,
                        chunk_size: int):
    """Attention within (segment, cluster) groups, windowed by `chunk_size` in sorted order."""
    B, L, H, D = q_BLHD.shape
    W = chunk_size
    pad = -L % W
    if pad:
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q_BLHD, k_BLHD, v_BLHD, cluster_BLH, seg_BL = map(
            widen, (q_BLHD, k_BLHD, v_BLHD, cluster_BLH, seg_BL))
    P, N = L + pad, (L + pad) // W

    # Sort every (row, head) by (segment, cluster, position); padding (segment 0) goes last.
    # Sorted arrays carry an `s` prefix: slot i of the sorted order holds position spos[i].
    seg_BHP = jnp.broadcast_to(seg_BL[:, None, :], (B, H, P))
    segkey_BHP = jnp.where(seg_BHP == 0, jnp.iinfo(jnp.int32).max, seg_BHP)
    cl_BHP = cluster_BLH.transpose(0, 2, 1)
    pos_BHP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, H, P))
    _, scl_BHP, spos_BHP = jax.lax.sort((segkey_BHP, cl_BHP, pos_BHP), dimension=-1, num_keys=3)
    sseg_BHP = jnp.take_along_axis(seg_BHP, spos_BHP, axis=-1)
    gather = lambda x_BLHD: jnp.take_along_axis(x_BLHD.transpose(0, 2, 1, 3),
                                                spos_BHP[..., None], axis=2)
    sq_BHPD, sk_BHPD, sv_BHPD = gather(q_BLHD), gather(k_BLHD), gather(v_BLHD)

    # Chunks of W sorted slots; each chunk also sees its previous (and, not causal, next) one.
    chunk = lambda x: x.reshape(x.shape[:2] + (N, W) + x.shape[3:])
    shifts = (1, 0) if causal else (1, 0, -1)
    around = lambda x: jnp.concatenate([jnp.roll(chunk(x), s, axis=2) for s in shifts], axis=3)
    q_BHNWD = chunk(sq_BHPD)
    k_BHNKD, v_BHNKD = around(sk_BHPD), around(sv_BHPD)
    slot_NW = jnp.arange(P).reshape(N, W)
    kslot_NK = jnp.concatenate([jnp.roll(slot_NW, s, axis=0) for s in shifts], axis=1)
    n_N = jnp.arange(N)
    exists_NK = jnp.concatenate(  # chunk n - s exists (no wrap-around)
        [jnp.broadcast_to(((n_N - s >= 0) & (n_N - s < N))[:, None], (N, W)) for s in shifts],
        axis=1)

    segq_BHNW, segk_BHNK = chunk(sseg_BHP), around(sseg_BHP)
    clq_BHNW, clk_BHNK = chunk(scl_BHP), around(scl_BHP)
    dist_NWK = slot_NW[:, :, None] - kslot_NK[:, None, :]  # sorted-slot distance i - j
    near_NWK = (dist_NWK >= 0) & (dist_NWK < W) if causal else jnp.abs(dist_NWK) < W
    near_NWK &= exists_NK[:, None, :]
    ok_BHNWK = ((segq_BHNW[..., :, None] == segk_BHNK[..., None, :])
                & (segk_BHNK[..., None, :] != 0)
                & (clq_BHNW[..., :, None] == clk_BHNK[..., None, :]) & near_NWK[None, None])

    scale = 1.0 / jnp.sqrt(jnp.float32(D))
    logits_BHNWK = jnp.einsum("bhnqd,bhnkd->bhnqk", q_BHNWD, k_BHNKD,
                              preferred_element_type=jnp.float32) * scale
    logits_BHNWK = jnp.where(ok_BHNWK, logits_BHNWK, _NEG)
    m_BHNW1 = jax.lax.stop_gradient(jnp.max(logits_BHNWK, axis=-1, keepdims=True))
    p_BHNWK = jnp.where(ok_BHNWK, jnp.exp(logits_BHNWK - m_BHNW1), 0.0)
    p_BHNWK = p_BHNWK / jnp.maximum(jnp.sum(p_BHNWK, axis=-1, keepdims=True), 1e-30)
    sout_BHPD = jnp.einsum("bhnqk,bhnkd->bhnqd", p_BHNWK,
                           v_BHNKD.astype(jnp.float32)).reshape(B, H, P, v_BLHD.shape[-1])

    # Undo the sort (rows with no allowed key, i.e. padding, are zeros).
    inv_BHP = jnp.argsort(spos_BHP, axis=-1)
    out_BHPD = jnp.take_along_axis(sout_BHPD, inv_BHP[..., None], axis=2)
    return out_BHPD.transpose(0, 2, 1, 3)[:, :L].astype(q_BLHD.dtype)


def _positive_int(options, cls, name, field):
    value = options.get(name, getattr(cls, name))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field `{field}.{name}` = {value!r} is not allowed: "
                          "must be a positive integer")


@register("clustered")
class ClusteredAttention(Attention):
    """Routing Transformer (Roy et al. 2021): online k-means routes queries and keys to
    `num_clusters` centroids and tokens attend only within their cluster, sorted and
    chunked so the cost is O(L * chunk_size).

    Options: `num_clusters` (default 4), `chunk_size` (window in cluster-sorted order,
    default 64; lengths are padded to a multiple). Causal (exact incremental decoding with
    a key/value/cluster cache) and packed segments are supported.
    """

    num_clusters: int = 4
    chunk_size: int = 64

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        _positive_int(options, cls, "num_clusters", field)
        _positive_int(options, cls, "chunk_size", field)

    def _check(self):
        if self.num_clusters <= 0 or self.chunk_size <= 0:
            raise ValueError(f"clustered: num_clusters={self.num_clusters} and chunk_size="
                             f"{self.chunk_size} must be positive")

    @nn.compact
    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        self._check()
        B, L, H, D = q.shape
        if k.shape[1] != L:
            raise ValueError(f"clustered is self-attention: q and k lengths differ, "
                             f"q{q.shape} k{k.shape}")
        centroids_HCD = self.param("centroids", nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("heads", None, "kv")), (H, self.num_clusters, D),
            jnp.float32)
        seg_BL = jnp.ones((B, L), jnp.int32) if mask is None else mask.astype(jnp.int32)
        cluster_BLH = kept_routing(self, "cluster", lambda: route(q, k, centroids_HCD))
        if cluster_BLH.shape != (B, L, H):
            raise ValueError(f"clustered: the kept routing has shape {cluster_BLH.shape}, not "
                             f"[B, L, H] = {(B, L, H)}; pass the one this input's forward kept")
        grad_HCD = jax.lax.stop_gradient(
            kmeans_grad(q, k, centroids_HCD, cluster_BLH, seg_BL != 0))
        q = _with_kmeans_grad(q, centroids_HCD, grad_HCD)
        return clustered_attention(q, k, v, cluster_BLH, seg_BL, causal=causal,
                                   chunk_size=self.chunk_size)

    def init_cache(self, batch: int, max_len: int, num_heads: int, head_dim: int, dtype):
        cache = super().init_cache(batch, max_len, num_heads, head_dim, dtype)
        cache["cluster"] = jnp.zeros((batch, max_len, num_heads), jnp.int32)
        return cache

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        """Token at cache['index'] attends to its last `chunk_size` cluster-mates so far."""
        check_one_token(self.registry_name, cache, q_B1HD)
        check_inputs(q_B1HD, k_B1HD, v_B1HD, None)
        self._check()
        idx = cache["index"]
        centroids_HCD = nn.unbox(self.get_variable("params", "centroids"))
        c_B1H = route(q_B1HD, k_B1HD, centroids_HCD)
        put = lambda buf, x: cache_put(buf, x, idx)  # noqa: E731
        k_BTHD, v_BTHD = put(cache["k"], k_B1HD), put(cache["v"], v_B1HD)
        cl_BTH = put(cache["cluster"], c_B1H)
        T = k_BTHD.shape[1]
        mate_BTH = (cl_BTH == c_B1H) & (jnp.arange(T) <= idx)[None, :, None]
        # Cluster-mates after key j up to this token; the forward pass keeps those < W.
        rank_BTH = jnp.cumsum(mate_BTH, axis=1)
        after_BTH = rank_BTH[:, -1:, :] - rank_BTH
        allowed_BH1T = (mate_BTH & (after_BTH < self.chunk_size)).transpose(0, 2, 1)[:, :, None, :]
        out = masked_softmax_attention(q_B1HD, k_BTHD.astype(q_B1HD.dtype),
                                       v_BTHD.astype(q_B1HD.dtype), allowed_BH1T)
        return out, {"k": k_BTHD, "v": v_BTHD, "cluster": cl_BTH, "index": idx + 1}
