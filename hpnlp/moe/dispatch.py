"""Moving tokens to their experts and back, two ways, and the exact twin both are tested on.

Shape letters as in `routing.py`; F expert width, P token-choice pairs (tokens x K),
R padded rows, N blocks of `b` rows.

**Capacity** (GShard, Switch): each expert has C slots per routing group. `gather` builds
the [G, X, C, M] buffer (an empty slot reads a zero row), the experts run over it one
product per expert (`expert_mlp`), and `combine` gathers each token's slots' outputs, times
their gates (a gather, not a scatter-add; a dropped choice reads no slot, so its token keeps
only the residual).

**Dropless**: every choice is computed. `jax.lax.ragged_dot` (grouped products) does not
serve here: on CPU jaxlib 0.10 lowers it to a dense product masked per group, X times the
work of the products themselves (measured: 69 ms against 7 ms for one expert's product,
8192 tokens, 8 experts, 128 -> 512). So this is sort + segment: the choices are sorted by
expert (stable: token order within an expert), each expert's run padded to a multiple of
`b` rows, and each block of `b` rows multiplies its expert's weights. Padding wastes at most
b - 1 rows per expert; nothing is dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hpnlp.compress.qlinear import Factored
from hpnlp.moe.routing import Choices


def gather(x_GSM, token_GXC):
    """[G, S, M] tokens -> [G, X, C, M] slot inputs (token index S: a zero row)."""
    G, X, C = token_GXC.shape
    x_pad = jnp.concatenate([x_GSM, jnp.zeros_like(x_GSM[:, :1])], axis=1)
    rows = jnp.take_along_axis(x_pad, token_GXC.reshape(G, X * C, 1), axis=1)
    return rows.reshape(G, X, C, x_GSM.shape[-1])


def combine(y_GXCM, slot_GSJ, gate_GSJ):
    """[G, X, C, M] slot outputs -> [G, S, M]: sum over a token's slots of gate * output.

    A gather by each token's slots, not a scatter-add by each slot's token (XLA:CPU runs a
    scatter serially: forward, 8192 tokens of width 256, 1.9 ms gathered, 2.7 ms scattered)."""
    G, X, C, M = y_GXCM.shape
    S, J = slot_GSJ.shape[1:]
    y_pad = jnp.concatenate([y_GXCM.reshape(G, X * C, M), jnp.zeros_like(y_GXCM[:, 0, :1])], 1)
    y_GSJM = jnp.take_along_axis(y_pad, slot_GSJ.reshape(G, S * J, 1), axis=1).reshape(G, S, J, M)
    return jnp.einsum("gsjm,gsj->gsm", y_GSJM, gate_GSJ.astype(y_GXCM.dtype))


def _same(x):
    return x


def linear(x_TK, w_XKN, b_XN, e: int, activation=None, rank_act=_same):
    """Expert e's product x w[e] + b[e], then `activation` ("gelu": jax.nn.gelu, the tanh
    form), in XLA: `expert_mlp`'s default `linear`. A factorized weight (model.lowrank:
    `Factored` U [X, K, r], V [X, r, N]) is two products, rank_act(x U[e]) V[e] (`rank_act`:
    how the second product reads its input, quantized or as is)."""
    if isinstance(w_XKN, Factored):
        y_TN = rank_act(x_TK @ w_XKN.u[e]) @ w_XKN.v[e] + b_XN[e][None]
    else:
        y_TN = x_TK @ w_XKN[e] + b_XN[e][None]
    return y_TN if activation is None else jax.nn.gelu(y_TN)


def expert_mlp(x_GXCM, wi_XMF, bi_XF, wo_XFM, bo_XM, *, act=_same, linear=linear):
    """Each expert's MLP on its slots: act(gelu(x wi + bi)) wo + bo (`act`: how the second
    product reads its input, quantized or as is; `linear(x, w, b, e, activation)`: how each
    product is computed, by default in XLA, by their kernels for served experts).

    One plain product per expert, not one batched einsum over the expert axis: XLA:CPU
    runs the batched product's backward pass ~1.4x slower than the same work as X separate
    products (forward + backward, 8 experts, 8192 slots, 256 -> 1024: 259 ms batched, 184 ms
    per expert, 186 ms for the dense MLP of the same work)."""
    G, X, C, M = x_GXCM.shape

    def one(e):
        h = act(linear(x_GXCM[:, e].reshape(G * C, M), wi_XMF, bi_XF, e, "gelu"))
        return linear(h, wo_XFM, bo_XM, e).reshape(G, C, M)
    return jnp.stack([one(e) for e in range(X)], axis=1)


class Rows(NamedTuple):
    """Dropless layout: the choices sorted by expert in padded blocks of equal expert."""

    token_R: jax.Array  # int32 token of each row (T: a padding row)
    gate_R: jax.Array  # float32 gate of each row (0 for padding)
    expert_N: jax.Array  # int32 expert of each block


def block_rows(pairs: int, experts: int, block: int = 0, tokens: int = 0) -> tuple[int, int]:
    """(b, R): rows per block (0: automatic, about P / 8X rounded down to a power of two in
    [8, 256], so padding costs at most ~1/16 of the rows on average; automatic or given, at most
    `tokens` where given: an expert gets at most one choice per token, so a longer block is
    only padding, as a decoded token's 8 rows for its one choice were) and the static row
    count, an upper bound of sum over experts of their choices rounded up to b.

    The bound, reached: an expert with s >= 1 choices takes ceil(s / b) = 1 + (s - 1) // b
    blocks, so n experts with choices take at most n + (P - n) // b, which never falls as n
    grows; at most n = min(X, P) experts get a choice (the worst case: n - 1 of them one
    choice each, the last the rest). Review r5: R was ceil(P / b) b + X b, so one decoded
    token (P = 1, X = 8) ran 72 rows through 9 experts' weights, where 8 rows hold it."""
    if not block:
        block = 1 << max(3, min(8, round(max(pairs / (8 * experts), 1.0)).bit_length() - 1))
    block = min(block, tokens) if tokens > 0 else block  # (model.moe.block_size's too: d1)
    n = min(experts, pairs)
    blocks = n + (pairs - n) // block
    return block, max(blocks, 1) * block


def sort_rows(choices: Choices, valid_T, *, experts: int, block: int = 0) -> Rows:
    """Token choices over T tokens ([T, K]) -> the dropless row layout (every valid choice
    gets a row; padding tokens get none)."""
    expert_TK, gate_TK = choices
    T, K = expert_TK.shape
    X, P = experts, T * K
    b, R = block_rows(P, X, block, tokens=T)
    e_P = jnp.where(valid_T[:, None], expert_TK, X).reshape(P)  # padding sorts last
    order_P = jnp.argsort(e_P, stable=True)
    e_sorted = e_P[order_P]
    size_X = jnp.bincount(e_P, length=X + 1)[:X]
    padded_X = -(-size_X // b) * b
    end_X = jnp.cumsum(padded_X)
    start_X, first_X = end_X - padded_X, jnp.cumsum(size_X) - size_X
    e_c = jnp.minimum(e_sorted, X - 1)
    row_P = jnp.where(e_sorted < X, start_X[e_c] + jnp.arange(P) - first_X[e_c], R)
    token_R = jnp.full((R + 1,), T, jnp.int32).at[row_P].set((order_P // K).astype(jnp.int32))
    gate_R = jnp.zeros((R + 1,), jnp.float32).at[row_P].set(gate_TK.reshape(P)[order_P])
    expert_N = jnp.searchsorted(end_X, jnp.arange(R // b) * b, side="right")
    return Rows(token_R[:R], gate_R[:R], jnp.minimum(expert_N, X - 1).astype(jnp.int32))


def block_linear(x_NbK, w_XKN, b_XN, e_N, activation=None, rank_act=_same):
    """Each block's product with its expert's weight, x[n] w[e[n]] + b[e[n]], then
    `activation` (as `linear`), in XLA: `dropless`'s default `linear` (a factorized weight
    as two products, as `linear`)."""
    if isinstance(w_XKN, Factored):
        t_NbR = rank_act(jnp.einsum("nbk,nkr->nbr", x_NbK, w_XKN.u[e_N]))
        y_NbN = jnp.einsum("nbr,nrf->nbf", t_NbR, w_XKN.v[e_N]) + b_XN[e_N][:, None]
    else:
        y_NbN = jnp.einsum("nbk,nkf->nbf", x_NbK, w_XKN[e_N]) + b_XN[e_N][:, None]
    return y_NbN if activation is None else jax.nn.gelu(y_NbN)


def dropless(x_TM, rows: Rows, wi_XMF, bi_XF, wo_XFM, bo_XM, *, act=_same, linear=block_linear):
    """Every row's expert MLP, block by block, combined back to [T, M] with the gates
    (`act` as in `expert_mlp`; `linear(x_NbK, w, b, e_N, activation)`: each block's product
    with its expert's weight, by default in XLA, by their kernels for served experts)."""
    T, M = x_TM.shape
    N = rows.expert_N.shape[0]
    x_pad = jnp.concatenate([x_TM, jnp.zeros_like(x_TM[:1])], axis=0)
    x_NbM = x_pad[rows.token_R].reshape(N, -1, M)
    e = rows.expert_N
    h = act(linear(x_NbM, wi_XMF, bi_XF, e, "gelu"))
    y_NbM = linear(h, wo_XFM, bo_XM, e)
    w_RM = y_NbM.reshape(-1, M) * rows.gate_R[:, None].astype(y_NbM.dtype)
    return jax.ops.segment_sum(w_RM, rows.token_R, num_segments=T + 1)[:T]


def reference(x_TM, combine_TX, wi_XMF, bi_XF, wo_XFM, bo_XM):
    """The exact twin: every expert on every token, summed with weights [T, X] (a choice's
    gate where it was kept, else 0). Costs X dense MLPs; for tests."""
    h = jnp.einsum("tm,xmf->txf", x_TM, wi_XMF) + bi_XF[None]
    y_TXM = jnp.einsum("txf,xfm->txm", jax.nn.gelu(h), wo_XFM) + bo_XM[None]
    return jnp.einsum("txm,tx->tm", y_TXM, combine_TX.astype(y_TXM.dtype))
