"""Kernel-feature attention in linear time: `performer` (FAVOR+) and `linear` (elu + 1).

Both replace softmax(QK^T)V by a factorized kernel: with a positive feature map phi,

    out_t = phi(q_t) . S / phi(q_t) . z,    S = sum_s phi(k_s) v_s^T,  z = sum_s phi(k_s),

so the [L, L] score matrix never exists and the cost is O(L M D), not O(L^2 D).

* Bidirectional: S and z are two einsums over all (non-padded) keys.
* Causal: S and z become prefix sums. The sequence is cut into chunks of C tokens and
  one `lax.scan` walks them, carrying S, z ([B, H, M, D + 1]); inside a chunk the masked
  quadratic form phi(Q_c) phi(K_c)^T (a [C, C] matrix) covers the chunk's own keys and
  phi(Q_c) S covers all earlier ones. No [L, M, D] tensor of per-token states is built:
  the forward pass holds O(L M + C^2) (features and one chunk's scores); training also
  keeps the scan's per-chunk S as residuals, L M D / C floats, i.e. O(L M) for C ~ D.
  A length that C does not divide is padded automatically.
* Decoding keeps only S, z (and the Performer's running stabilizer): O(1) per token.
* Training memory (`recompute`, on by default): autodiff would keep phi(Q) and phi(K),
  two [B, H, L, M] arrays per layer (M = 256 features is 4x the head dim), until the
  backward pass. Instead the attention runs under `jax.checkpoint` and keeps only its
  inputs and S, z (`KERNEL_STATE`: [B, H, M, D + 1], causally the one each chunk starts
  from); the backward pass recomputes the features from q, k. That costs one more
  feature map per layer, and a layer's training memory is then q, k, v and the S's
  (`bench train` shows what it comes to at L = 4096).
  On CPU this needs the train step's `train.step.step_compiler_options()`, which every
  hpnlp step uses: XLA's default pipeline merges the recomputation back into the forward.

Padding: `mask` != 0 marks real tokens. Padded keys are zeroed in feature space, so they
count in no sum; padded queries output zeros. Packed rows (several segment ids per row)
are not separated: these variants set `supports_segments = False` (the config refuses
`data.batching='pack'` for them), so any non-zero id is simply "real token".

Shape letters: B batch, L length, H heads, D head dim, M features (`num_features` for
the Performer, D for `linear`), E = D + 1 (values with a ones column appended, so one
matmul gives numerator and denominator), N chunks, C chunk length (T query / S key
positions inside a chunk).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hpnlp import linalg
from hpnlp.attention.base import Attention, check_inputs, check_one_token, register
from hpnlp.config import ConfigError

KERNEL_STATE = "kernel_state"  # checkpoint name of S, z: all that `recompute` keeps
EPS = 1e-6  # added to every denominator; also what makes rows with no keys output 0, not NaN
_FLOOR = -1e30  # stabilizer before any real key has been seen (finite, so no inf - inf)


# ----------------------------------------------------------------------------------------
# Feature maps
# ----------------------------------------------------------------------------------------

def orthogonal_random_features(key, num_features: int, dim: int):
    """[M, D] projection: Gaussian D x D blocks orthogonalized by QR, rows rescaled by
    chi(D)-distributed norms (the norms of fresh Gaussian vectors), so each row is still
    marginally N(0, I) but rows within a block are exactly orthogonal (lower variance)."""
    n_blocks = -(-num_features // dim)
    # One Gaussian draw for both parts (one threefry call compiles ~3x faster than two).
    g = jax.random.normal(key, (n_blocks * dim * dim + num_features * dim,), jnp.float32)
    g_NDD = g[: n_blocks * dim * dim].reshape(n_blocks, dim, dim)
    norms_M = jnp.linalg.norm(g[n_blocks * dim * dim:].reshape(num_features, dim), axis=-1)
    # Q of QR with diag(R) > 0 (Haar-distributed), by Gram-Schmidt: a LAPACK QR inside the
    # training step's feature redraw can deadlock XLA's CPU thread pool (hpnlp/linalg.py).
    q_NDD = jax.vmap(linalg.orthonormal_columns)(g_NDD)
    rows_MD = q_NDD.transpose(0, 2, 1).reshape(n_blocks * dim, dim)[:num_features]
    return rows_MD * norms_M[:, None]


def performer_features(q_BLHD, k_BLHD, w_MD, valid_BL, *, causal: bool):
    """FAVOR+ positive features phi(x) = exp(w.x - |x|^2 / 2) / sqrt(M), x = q / D^(1/4).

    E[phi(q) . phi(k)] = exp(q.k / sqrt(D)), the softmax kernel. Returns (phi_q_BHLM,
    phi_k_BHLM, shift_BHL) with the features *stabilized*: every constant factor that
    multiplies the numerator and the denominator of a query's ratio alike is dropped,
    which changes nothing but keeps exp() in range:

    * 1/sqrt(M) on both sides: a global constant.
    * queries: exp(-max_m g_tm), g = w.x - |x|^2/2, per query row and head. The largest
      query feature is then exactly 1.
    * keys: exp(-shift), shift = a max of w.y - |y|^2/2 over features and over the (real)
      keys a query sees, per batch row and head. Bidirectional: one max over the whole
      key set, shared by all queries. Causal: a max over the whole length would read
      future keys (they would decide what underflows: a numerical leak), so shift_t is
      the running max over keys s <= t (a per-position stabilizer, as in an online
      softmax). Key s is stored relative to its own shift_s and rescaled by
      exp(shift_s - shift_t) <= 1 when query t reads it, so for a fixed query every key
      carries the same factor exp(-shift_t), which cancels in the ratio exactly. The
      running max never decreases, so no rescale factor exceeds 1.

    Padded keys are excluded from the max and zeroed. The stabilizers go through
    stop_gradient: the ratio does not depend on them.
    """
    D = q_BLHD.shape[-1]
    # Head-major before projecting: transposing [.., D] inputs is cheaper than [.., M] outputs.
    x_BHLD = q_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3) * D ** -0.25
    y_BHLD = k_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3) * D ** -0.25
    w_MD = jax.lax.stop_gradient(w_MD.astype(jnp.float32))
    g_BHLM = (jnp.einsum("bhld,md->bhlm", x_BHLD, w_MD)
              - 0.5 * jnp.sum(x_BHLD * x_BHLD, axis=-1, keepdims=True))
    phi_q_BHLM = jnp.exp(g_BHLM - jax.lax.stop_gradient(jnp.max(g_BHLM, axis=-1, keepdims=True)))
    f_BHLM = (jnp.einsum("bhld,md->bhlm", y_BHLD, w_MD)
              - 0.5 * jnp.sum(y_BHLD * y_BHLD, axis=-1, keepdims=True))
    valid_B1L = valid_BL[:, None, :]
    fmax_BHL = jnp.where(valid_B1L, jnp.max(f_BHLM, axis=-1), _FLOOR)
    if causal:
        shift_BHL = jax.lax.cummax(fmax_BHL, axis=2)
    else:
        shift_BHL = jnp.broadcast_to(jnp.max(fmax_BHL, axis=2, keepdims=True), fmax_BHL.shape)
    shift_BHL = jax.lax.stop_gradient(shift_BHL)
    # Padded keys: exp(-inf) = 0 in value and gradient (never exp of a huge masked value).
    phi_k_BHLM = jnp.exp(jnp.where(valid_B1L[..., None], f_BHLM - shift_BHL[..., None], -jnp.inf))
    return phi_q_BHLM, phi_k_BHLM, shift_BHL


def elu_features(q_BLHD, k_BLHD, valid_BL):
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al.): no exponentials, so no stabilizer.
    Returns head-major (phi_q_BHLD, phi_k_BHLD), here M = D."""
    phi_q_BHLD = jax.nn.elu(q_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3)) + 1.0
    phi_k_BHLD = jax.nn.elu(k_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3)) + 1.0
    return phi_q_BHLD, jnp.where(valid_BL[:, None, :, None], phi_k_BHLD, 0.0)


# ----------------------------------------------------------------------------------------
# Linear attention given features: the fast paths and their slow twin
# ----------------------------------------------------------------------------------------

def _with_ones(v_BLHD):
    """[B, H, L, D + 1] values with a ones column: one matmul then yields the numerator
    (first D columns) and the denominator (last column) together. Written E = D + 1."""
    v_BHLD = v_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3)
    return jnp.concatenate([v_BHLD, jnp.ones(v_BHLD.shape[:3] + (1,), jnp.float32)], axis=-1)


def _ratio(numden_BHLE):
    """[B, H, L, D + 1] -> out [B, L, H, D] = num / (den + EPS)."""
    out_BHLD = numden_BHLE[..., :-1] / (numden_BHLE[..., -1:] + EPS)
    return out_BHLD.transpose(0, 2, 1, 3)


def kernel_attention(phi_q_BHLM, phi_k_BHLM, v_BLHD, shift_BHL=None, *, causal: bool,
                     chunk_size: int = 64):
    """out = phi(q) . S / (phi(q) . z + EPS) in float32, [B, L, H, D].

    `phi_k` must already be zero at padded keys. `shift` (causal only, None = all zero)
    is the per-position key stabilizer: key s is stored as phi_k[s] and read by query t
    (s <= t) as phi_k[s] * exp(shift[s] - shift[t]); it must be non-decreasing along L.
    """
    v_BHLE = _with_ones(v_BLHD)
    if not causal:
        s_BHME = checkpoint_name(jnp.einsum("bhsm,bhse->bhme", phi_k_BHLM, v_BHLE), KERNEL_STATE)
        return _ratio(jnp.einsum("bhlm,bhme->bhle", phi_q_BHLM, s_BHME))
    B, H, L, M = phi_q_BHLM.shape
    E = v_BHLE.shape[-1]
    C = min(chunk_size, L)
    N = -(-L // C)
    if N * C != L:  # pad: zero features count nowhere; the edge shift keeps it monotone
        pad = [(0, 0), (0, 0), (0, N * C - L), (0, 0)]
        phi_q_BHLM, phi_k_BHLM, v_BHLE = (jnp.pad(x, pad) for x in (phi_q_BHLM, phi_k_BHLM, v_BHLE))
        if shift_BHL is not None:
            shift_BHL = jnp.pad(shift_BHL, pad[:3], mode="edge")
    # Chunk-major, so one `lax.scan` walks the chunks in order.
    q_NBHCM = phi_q_BHLM.reshape(B, H, N, C, M).transpose(2, 0, 1, 3, 4)
    k_NBHCM = phi_k_BHLM.reshape(B, H, N, C, M).transpose(2, 0, 1, 3, 4)
    v_NBHCE = v_BHLE.reshape(B, H, N, C, E).transpose(2, 0, 1, 3, 4)
    stabilized = shift_BHL is not None
    if stabilized:
        sh_NBHC = shift_BHL.reshape(B, H, N, C).transpose(2, 0, 1, 3)
    else:
        sh_NBHC = jnp.zeros((N, B, H, C), jnp.float32)
    end_NBH = sh_NBHC[..., -1]  # the state after chunk n is kept at this scale
    prev_NBH = jnp.concatenate([jnp.full_like(end_NBH[:1], _FLOOR), end_NBH[:-1]], axis=0)
    causal_TS = jnp.tril(jnp.ones((C, C), bool))

    def chunk(s_BHME, xs):
        """S (keys of all earlier chunks, at scale prev) -> (S after this chunk, out)."""
        q_BHCM, k_BHCM, v_BHCE, sh_BHC, prev_BH, end_BH = xs
        s_BHME = checkpoint_name(s_BHME, KERNEL_STATE)  # `recompute` keeps each chunk's S
        a_BHTS = jnp.einsum("bhtm,bhsm->bhts", q_BHCM, k_BHCM)  # the in-chunk quadratic form
        inter_BHCE = jnp.einsum("bhtm,bhme->bhte", q_BHCM, s_BHME)  # everything before the chunk
        if stabilized:  # bring key s (stored at scale sh_s) and S (at prev) to query t's scale
            a_BHTS = a_BHTS * jnp.exp(jnp.minimum(sh_BHC[..., None, :] - sh_BHC[..., :, None], 0.0))
            inter_BHCE = inter_BHCE * jnp.exp(jnp.minimum(prev_BH[..., None] - sh_BHC, 0.0))[..., None]
        a_BHTS = jnp.where(causal_TS, a_BHTS, 0.0)
        out_BHCE = jnp.einsum("bhts,bhse->bhte", a_BHTS, v_BHCE) + inter_BHCE
        if stabilized:  # move S and the chunk's keys to the chunk's end scale (factors <= 1);
            # the per-key factor goes on the E-wide values, not the M-wide features
            v_BHCE = v_BHCE * jnp.exp(sh_BHC - end_BH[..., None])[..., None]
            s_BHME = s_BHME * jnp.exp(prev_BH - end_BH)[..., None, None]
        return s_BHME + jnp.einsum("bhsm,bhse->bhme", k_BHCM, v_BHCE), out_BHCE

    _, out_NBHCE = jax.lax.scan(chunk, jnp.zeros((B, H, M, E), jnp.float32),
                                (q_NBHCM, k_NBHCM, v_NBHCE, sh_NBHC, prev_NBH, end_NBH))
    return _ratio(out_NBHCE.transpose(1, 2, 0, 3, 4).reshape(B, H, N * C, E)[:, :, :L])


def kernel_attention_reference(phi_q_BHLM, phi_k_BHLM, v_BLHD, shift_BHL=None, *, causal: bool):
    """Slow twin of `kernel_attention`: the explicit [L, L] form phi(Q) phi(K)^T, masked."""
    L = phi_q_BHLM.shape[2]
    a_BHLS = jnp.einsum("bhlm,bhsm->bhls", phi_q_BHLM, phi_k_BHLM)
    if causal:
        if shift_BHL is not None:
            a_BHLS = a_BHLS * jnp.exp(jnp.minimum(shift_BHL[:, :, None, :] - shift_BHL[:, :, :, None], 0.0))
        a_BHLS = jnp.where(jnp.tril(jnp.ones((L, L), bool)), a_BHLS, 0.0)
    num_BLHD = jnp.einsum("bhls,bshd->blhd", a_BHLS, v_BLHD.astype(jnp.float32))
    den_BLH = jnp.sum(a_BHLS, axis=-1).transpose(0, 2, 1)
    return num_BLHD / (den_BLH[..., None] + EPS)


# ----------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------

def _check_positive_int(options, name, default, field):
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field `{field}.{name}` = {value!r} is not allowed: must be a "
                          "positive integer")


class _KernelAttention(Attention):
    """Shared machinery: padding, the causal chunked prefix sums, and the O(1) decode state.

    Subclasses define `_feature_params(head_dim)` (an array, e.g. the Performer's
    projection, or None), `_feature_map(q, k, params, valid_BL, causal) -> (phi_q_BHLM,
    phi_k_BHLM, shift_BHL | None)` (pure: no module state, so it can be recomputed) and
    `_num_features(head_dim)`. `recompute` (default on): keep only q, k, v and the state S
    for the backward pass and recompute the features there (module docstring).
    """

    supports_segments: ClassVar[bool] = False
    # every head's features come from one map (Performer: one projection a layer, shared by
    # the heads): structured pruning may remove heads (a review, session 117)
    heads_independent = True
    # the causal prefix sums' chunks and the backward's recomputation: one function (a
    # review, session 117: a resume that changed them was refused as a different model)
    layout_options = frozenset({"chunk_size", "recompute"})
    chunk_size: int = 64
    recompute: bool = True

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        _check_positive_int(options, "chunk_size", cls.chunk_size, field)
        if not isinstance(options.get("recompute", True), bool):
            raise ConfigError(f"config field `{field}.recompute` = {options['recompute']!r} is "
                              "not allowed: must be True or False")

    def _features(self, q, k, valid_BL, causal):
        return self._feature_map(q, k, self._feature_params(q.shape[-1]), valid_BL, causal)

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"{self.registry_name} attention is self-attention: q and k lengths "
                             f"differ, q{q.shape} k{k.shape}")
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"{self.registry_name}: chunk_size={self.chunk_size!r} must be a "
                             "positive integer")
        B, L = q.shape[:2]
        valid_BL = jnp.ones((B, L), bool) if mask is None else mask != 0

        def attend(q, k, v, params):
            phi_q_BHLM, phi_k_BHLM, shift_BHL = self._feature_map(q, k, params, valid_BL, causal)
            return kernel_attention(phi_q_BHLM, phi_k_BHLM, v, shift_BHL if causal else None,
                                    causal=causal, chunk_size=self.chunk_size)

        if self.recompute:
            attend = jax.checkpoint(
                attend, policy=jax.checkpoint_policies.save_only_these_names(KERNEL_STATE))
        out_BLHD = attend(q, k, v, self._feature_params(q.shape[-1]))
        return jnp.where(valid_BL[:, :, None, None], out_BLHD, 0.0).astype(q.dtype)

    def init_cache(self, batch: int, max_len: int, num_heads: int, head_dim: int, dtype):
        """Recurrent state, independent of max_len: S [B, H, M, D], z [B, H, M], the running
        key stabilizer [B, H] (Performer only; unused by `linear`), all float32."""
        M = self._num_features(head_dim)
        return {"s": jnp.zeros((batch, num_heads, M, head_dim), jnp.float32),
                "z": jnp.zeros((batch, num_heads, M), jnp.float32),
                "shift": jnp.full((batch, num_heads), _FLOOR, jnp.float32),
                "index": jnp.zeros((), jnp.int32)}

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        """One token: S <- S * decay + phi(k) v^T, out = phi(q) . S / (phi(q) . z + EPS)."""
        check_one_token(self.registry_name, cache, q_B1HD)
        valid_B1 = jnp.ones(q_B1HD.shape[:2], bool)
        phi_q_BH1M, phi_k_BH1M, shift_BH1 = self._features(q_B1HD, k_B1HD, valid_B1, True)
        phi_q_BHM, phi_k_BHM = phi_q_BH1M[:, :, 0], phi_k_BH1M[:, :, 0]
        if shift_BH1 is None:
            shift_BH = cache["shift"]
            decay_BH = jnp.ones_like(shift_BH)
        else:  # phi_k is relative to its own max; bring old state and new key to the new max
            shift_BH = jnp.maximum(cache["shift"], shift_BH1[:, :, 0])
            decay_BH = jnp.exp(cache["shift"] - shift_BH)
            phi_k_BHM = phi_k_BHM * jnp.exp(shift_BH1[:, :, 0] - shift_BH)[..., None]
        s_BHMD = (cache["s"] * decay_BH[..., None, None]
                  + jnp.einsum("bhm,bhd->bhmd", phi_k_BHM, v_B1HD[:, 0].astype(jnp.float32)))
        z_BHM = cache["z"] * decay_BH[..., None] + phi_k_BHM
        num_BHD = jnp.einsum("bhm,bhmd->bhd", phi_q_BHM, s_BHMD)
        den_BH = jnp.einsum("bhm,bhm->bh", phi_q_BHM, z_BHM)
        out_B1HD = (num_BHD / (den_BH[..., None] + EPS))[:, None].astype(q_B1HD.dtype)
        return out_B1HD, {"s": s_BHMD, "z": z_BHM, "shift": shift_BH, "index": cache["index"] + 1}


@register("performer")
class PerformerAttention(_KernelAttention):
    """Choromanski et al. 2021, "Rethinking Attention with Performers" (FAVOR+).

    The fast idea: softmax's kernel exp(q.k / sqrt(D)) is an expectation of a product of
    positive random features, exp(q.k) = E_w[exp(w.q - |q|^2/2) exp(w.k - |k|^2/2)], so
    attention becomes phi(Q) (phi(K)^T V): linear in length. Orthogonal random features
    (`orthogonal_random_features`) cut the variance; one projection per layer is shared
    by queries, keys and heads. Numerical stabilizers are explained in
    `performer_features`.

    The projection comes from `make_rng("features")` when the caller supplies that stream
    (the train/eval steps do; its key changes every `train.feature_redraw_every` steps, so
    the redraw schedule is an explicit RNG, not data), else from `jax.random.key(seed)`.
    `redraw=False` always uses the seed key. One draw per call, so a layer's forward pass
    and its decode steps agree when they are given the same `features` key.
    """

    random_features: ClassVar[bool] = True

    num_features: int = 256
    redraw: bool = True
    seed: int = 0
    chunk_size: int = 64

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        _check_positive_int(options, "num_features", cls.num_features, field)
        if not isinstance(options.get("redraw", True), bool):
            raise ConfigError(f"config field `{field}.redraw` = {options['redraw']!r} is not "
                              "allowed: must be True or False")
        seed = options.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"config field `{field}.seed` = {seed!r} is not allowed: must be "
                              "an integer")
        if seed != cls.seed and options.get("redraw", cls.redraw):  # a bug hunt: never read
            raise ConfigError(f"config field `{field}.seed` = {seed!r} is not allowed: with "
                              f"{field}.redraw=True the features come from the run's `features` "
                              "stream (the config's seed, redrawn every "
                              "train.feature_redraw_every steps), so this option is never read; "
                              "drop it, or set redraw=False (one fixed draw from this seed)")

    def _num_features(self, head_dim: int) -> int:
        return self.num_features

    def projection(self, head_dim: int):
        """The [M, D] projection: from the `features` stream if present and redraw, else seed."""
        if not isinstance(self.num_features, int) or self.num_features <= 0:
            raise ValueError(f"performer: num_features={self.num_features!r} must be a positive "
                             "integer")
        if self.redraw and self.scope is not None and self.has_rng("features"):
            key = self.make_rng("features")
        else:
            key = jax.random.key(self.seed)
        return orthogonal_random_features(key, self.num_features, head_dim)

    def _feature_params(self, head_dim: int):
        return self.projection(head_dim)

    def _feature_map(self, q, k, w_MD, valid_BL, causal):
        return performer_features(q, k, w_MD, valid_BL, causal=causal)


@register("linear")
class LinearAttention(_KernelAttention):
    """Katharopoulos et al. 2020, "Transformers are RNNs": attention with the feature map
    phi(x) = elu(x) + 1 in place of exp(q.k). The fast idea: sim(q, k) = phi(q).phi(k) is
    associative, so phi(Q) (phi(K)^T V) costs O(L D^2), and causally it is an RNN whose
    state is S = sum phi(k) v^T (O(1) per decoded token)."""

    chunk_size: int = 64

    def _num_features(self, head_dim: int) -> int:
        return head_dim

    def _feature_params(self, head_dim: int):
        return None

    def _feature_map(self, q, k, params, valid_BL, causal):
        phi_q_BHLD, phi_k_BHLD = elu_features(q, k, valid_BL)
        return phi_q_BHLD, phi_k_BHLD, None
