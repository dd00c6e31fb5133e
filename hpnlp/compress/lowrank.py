"""Low-rank factorization: product weights as two products through a rank r (`model.lowrank.*`).

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/hpnlp/lm_r32 \\
        --config.model.lowrank.rank=32 --config.train.init_from=/tmp/hpnlp/lm_bytes \\
        --config.train.steps=200

A chosen weight W (contraction axes first, flattened to [K, N]) becomes `qlinear.Factored`
U [K, r], V [r, N] in the parameter tree, at W's own path; `qeinsum` computes x U and then
(x U) V, so the layer's arithmetic and parameters fall from K N to r (K + N), and both
factors train like any parameter (their logical axes are W's: U keeps the contraction's,
V the output's).

- Fine-tuning a trained run (`train.init_from` with `model.lowrank.rank`): the run's float
  weights are restored and factorized by truncated SVD, U = U_r sqrt(S_r) and
  V = sqrt(S_r) V_r^T, the best rank-r approximation in Frobenius norm (Eckart-Young); at
  full rank it reproduces W.
- From scratch: the model's random init factorized the same way.
- `kept_energy` / `rank_for_energy`: the fraction of sum(S^2) a rank keeps, and the smallest
  rank keeping a given fraction. `model.lowrank.rank` is one rank for all; with
  `model.lowrank.energy` each weight gets its own (`resolve_energy`, from the weights
  `train.init_from` holds, when the run is built; `model.lowrank.ranks` in its config.json).

Kinds (`model.lowrank.layers`): the Transformer's `qkv`, `out`, `mlp` (an MoE layer's
experts too: each expert's weight [K, N] its own SVD, U [X, K, r] and V [X, r, N] a
`Factored` with `lead=1`, multiplied expert by expert by hpnlp.moe.dispatch; the shared
experts' wider MLP as any Dense), the classifier heads, and the tables of any model:
`embed`, the input embedding [V, E] as A [V, r] B [r, E] (ALBERT's factorized embedding: a
lookup of A's rows, then one product with B), and `output`, the output layer's vectors [V,
E] (a `VocabLayer`: full, sampled, nce, ...) with logits (h B^T) A^T + b, two products
through the rank, wherever logits are computed (evaluation, `full`'s loss, chunked or not,
hard_negative's search); the rows a sampled objective or hard_negative gathers are A[ids]
B, and class_based scores its members through the rank: training forms the [V, E] table
only where that costs less (`rows` of V ids or more, class_based at a small V). A tied
table is one weight, the output layer's: `output` factorizes it for both uses. The LSTM's
own products stay dense.

Quantized (`quant.*`, QAT or `python -m hpnlp.compress quantize`): each factor is a product
of its own (`qlinear._factored_product`): U and V quantized per output channel, x and x U
as product inputs; the packed file holds both factors (`ptq.save`). Factorized experts
quantize the same way, expert by expert (`hpnlp.moe.layer.expert_factors`). A factorized
output table is not quantized (config refuses `output` in both `layers` fields).
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.traverse_util as traverse
import jax
import jax.numpy as jnp

from hpnlp.compress import qlinear
from hpnlp.compress.qlinear import Factored


def _matrix(w, k_dims: int, lead: int = 0):
    """W as [*lead axes, K, N]: its `lead` batch axes, then its k_dims contraction axes."""
    b = tuple(w.shape[:lead])
    return w.reshape(b + (math.prod(w.shape[lead:lead + k_dims]), -1)).astype(jnp.float32)


def _each(fn, m_BKN, cov_BKK=None):
    """fn(matrix[, its covariance]) of every matrix of a batch [..., K, N] (the covariance
    [K, K] shared, or one per matrix), one LAPACK call each, results stacked. A batched
    call splits the batch over XLA's CPU thread pool and blocks a pool thread until the
    pieces finish, so two of them in one program (an expert layer's wi and wo, two
    attention layers' key/value conversions) can deadlock a 2-core machine with every
    thread idle (as hpnlp.linalg says of QR; seen here: the factorized experts' init hung
    about one run in two)."""
    lead = m_BKN.shape[:-2]
    flat = m_BKN.reshape((-1,) + m_BKN.shape[-2:])
    covs = None if cov_BKK is None else jnp.broadcast_to(
        cov_BKK, lead + cov_BKK.shape[-2:]).reshape((-1,) + cov_BKK.shape[-2:])
    parts = [fn(flat[i]) if covs is None else fn(flat[i], covs[i])
             for i in range(flat.shape[0])]
    return jax.tree.map(lambda *a: jnp.stack(a).reshape(lead + a[0].shape), *parts)


def singular_values(w, k_dims: int, lead: int = 0):
    return _each(lambda m: jnp.linalg.svd(m, compute_uv=False), _matrix(w, k_dims, lead))


def svd_factors(w, k_dims: int, rank: int, lead: int = 0) -> Factored:
    """Truncated SVD of W (contraction axes first, after `lead` batch axes, each weight of
    the batch on its own) at `rank`: the best rank-r W = U V."""
    w_KN = _matrix(w, k_dims, lead)
    K, N = w_KN.shape[-2:]
    most = min(K, N)
    if isinstance(rank, bool) or int(rank) != rank or not 1 <= rank <= most:
        raise ValueError(f"rank={rank!r}: the weight {tuple(w.shape)} is [{K}, {N}] (its "
                         f"{k_dims} axes after {lead} contracted), of rank at most "
                         f"{most}; choose a rank in [1, {most}]")
    rank = int(rank)
    U, V = fit_factors(w_KN, rank)
    b = tuple(w.shape[:lead])
    U = U.reshape(b + tuple(w.shape[lead:lead + k_dims]) + (rank,))
    V = V.reshape(b + (rank,) + tuple(w.shape[lead + k_dims:]))
    return Factored(u=U.astype(w.dtype), v=V.astype(w.dtype), lead=lead)


def fit_factors(m_EN, rank: int, cov_EE=None):
    """(W [..., E, r], V [..., r, N]) with W V the best rank-r approximation of M [..., E, N]
    (leading axes batched, each matrix on its own; `cov_EE` [E, E] shared or [..., E, E]):
    in Frobenius norm (cov None: U sqrt(S), sqrt(S) V^T), or of its outputs X M on inputs X
    with X^T X = `cov_EE` up to scale (whitened: with cov = L L^T, ||X (M - W V)|| = ||L^T
    (M - W V)||, so the SVD of L^T M gives W = L^-T U sqrt(S); SVD-LLM, Wang et al. 2024;
    the key/value conversions' calibration, hpnlp.compress.gqa). In float32; the covariance
    is regularized by 1e-6 of its mean diagonal, so directions no input took still have a
    finite (small) weight."""
    if m_EN.ndim > 2:  # one LAPACK call per matrix (`_each`)
        return _each(lambda m, *c: fit_factors(m, rank, *c), m_EN, cov_EE)
    m = m_EN.astype(jnp.float32)
    if cov_EE is None:
        u, sv, vt = jnp.linalg.svd(m, full_matrices=False)
        root = jnp.sqrt(sv[:rank])
        return u[:, :rank] * root[None, :], root[:, None] * vt[:rank, :]
    from jax.scipy.linalg import solve_triangular
    E = cov_EE.shape[-1]
    cov = cov_EE.astype(jnp.float32)
    cov = cov + 1e-6 * jnp.trace(cov) / E * jnp.eye(E, dtype=jnp.float32)
    chol = jnp.linalg.cholesky(cov)  # lower: cov = L L^T
    u, sv, vt = jnp.linalg.svd(chol.T @ m, full_matrices=False)
    root = jnp.sqrt(sv[:rank])
    w = solve_triangular(chol.T, u[:, :rank] * root[None, :], lower=False)
    return w, root[:, None] * vt[:rank, :]


def kept_energy(w, k_dims: int, rank: int, lead: int = 0) -> float:
    """The fraction of sum(S^2) a rank-`rank` truncated SVD keeps (of every weight of a
    batch, `lead` axes: the least among them, as `rank_for_energy` serves the neediest; a
    review, session 118: the batch was taken for one matrix)."""
    s2 = jnp.square(singular_values(w, k_dims, lead))
    return float(jnp.min(jnp.sum(s2[..., :rank], axis=-1) / jnp.sum(s2, axis=-1)))


def rank_for_energy(w, k_dims: int, energy: float, lead: int = 0) -> int:
    """Smallest r whose truncated SVD keeps `energy` of sum(S^2) (of every weight of a
    batch: the largest such r among them)."""
    s2 = jnp.square(singular_values(w, k_dims, lead))
    frac = jnp.cumsum(s2, axis=-1) / jnp.sum(s2, axis=-1, keepdims=True)
    need = int(jnp.max(jnp.sum(frac < energy - 1e-7, axis=-1))) + 1  # rank of the neediest
    # found in review: at energy 1.0 the float32 running sum can end below 1 - 1e-7, and
    # every value counted: one more than the full rank
    return min(need, s2.shape[-1])


def targets(cfg, model, params, batch) -> dict:
    """{path tuple: Product} of the weights `model.lowrank` factorizes."""
    found = qlinear.products(model, params, batch)
    return {k: v for k, v in found.items() if cfg.model.lowrank.applies(v.kind)}


def factorize(params, products: dict, rank):
    """`params` (arrays, or boxed with logical axis names) with every weight in `products`
    replaced by its rank-`rank` Factored (boxed like the weight: U keeps the contraction's
    names, V the output's). `rank`: one int, or a function of the path ("a/b/kernel")."""
    rank_of = rank if callable(rank) else (lambda _: rank)
    flat = traverse.flatten_dict(params)
    for path, prod in products.items():
        w = flat[path]
        k, b = len(prod.contraction), prod.lead
        rank = rank_of("/".join(path))
        if isinstance(w, nn.LogicallyPartitioned):
            f = svd_factors(w.value, k, rank, b)
            names = tuple(w.names)
            flat[path] = Factored(u=nn.LogicallyPartitioned(f.u, names[:b + k] + (None,)),
                                  v=nn.LogicallyPartitioned(f.v, names[:b] + (None,)
                                                            + names[b + k:]), lead=b)
        else:
            flat[path] = svd_factors(w, k, rank, b)
    return traverse.unflatten_dict(flat)


def init_transform(cfg, model, batch):
    """For `init_state`: the model's initial parameters with `model.lowrank`'s weights
    factorized (the same shapes a factorized checkpoint has)."""
    def transform(params):
        return factorize(params, targets(cfg, model, nn.unbox(params), batch),
                         cfg.model.lowrank.rank_of)
    return transform


def resolve_energy(cfg, model, batch, dense):
    """`cfg` with `model.lowrank.ranks` filled from `model.lowrank.energy`: each chosen
    weight of `dense` (the run `train.init_from` names) at the smallest rank keeping that
    fraction of its sum(S^2)."""
    import dataclasses

    import flax
    lr = cfg.model.lowrank
    flat = traverse.flatten_dict(dense)
    ranks = {"/".join(path): rank_for_energy(flat[path], len(prod.contraction), lr.energy,
                                             prod.lead)
             for path, prod in targets(cfg, model, dense, batch).items()}
    lr = dataclasses.replace(lr, ranks=flax.core.FrozenDict(ranks))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lowrank=lr))


def is_factored(x) -> bool:
    return isinstance(x, Factored)


def report(params) -> dict:
    """{path: (rank, shape)} of the factorized weights in a parameter tree."""
    flat = traverse.flatten_dict(params, is_leaf=lambda _, x: is_factored(x))
    return {"/".join(k): (v.rank, v.shape) for k, v in flat.items() if is_factored(v)}
