"""Routers: which experts each token goes to, and with what gate. All in float32.

Shape letters: G routing groups, S tokens per group, M model width, X experts, K choices per
token, C slots per expert and group (capacity).

A token-choice router (`switch`, `top_k`) gives each token K (expert, gate) choices;
`slots_from_choices` then fills each expert's C slots. The expert-choice router fills the
slots itself: each expert takes the C tokens that score it highest (Zhou et al. 2022), so
every expert is exactly full and a token may get any number of experts, zero included.
Padding tokens (`valid` False) are chosen by no router and enter no statistic.
"""

from __future__ import annotations

import fractions
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Choices(NamedTuple):
    """A token-choice router's decision."""

    expert_GSK: jax.Array  # int32 expert of each choice, best first
    gate_GSK: jax.Array  # float32 weight of each choice's output


class Slots(NamedTuple):
    """Each expert's slots in each group, both ways: the token in each slot (dispatch reads
    it) and each token's slots with their gates (combine reads them). J is a token's most
    slots: K for token choice, X for expert choice."""

    token_GXC: jax.Array  # int32 in [0, S]; S: an empty slot
    slot_GSJ: jax.Array  # int32 flat slot x * C + c in [0, X * C]; X * C: none (dropped)
    gate_GSJ: jax.Array  # float32 gate of each of those slots, 0 for none


def capacity(tokens: int, *, experts: int, top_k: int, factor: float) -> int:
    """C = ceil(factor * tokens * top_k / experts) slots per expert, at least 1 and at most
    `tokens` (an expert never holds a token twice). Exact in the factor as written (a review,
    session 116: 1.1 * 720 / 8 in floats is 99 + 2^-46, which ceil made 100)."""
    exact = fractions.Fraction(repr(float(factor))) * tokens * top_k / experts
    return max(1, min(tokens, math.ceil(exact)))


def switch(probs_GSX, *, top_k: int) -> Choices:
    """Switch (Fedus et al. 2021): the top-1 expert, gated by its probability (so the router
    learns from the task loss through the gate)."""
    gate_GSK, expert_GSK = jax.lax.top_k(probs_GSX, top_k)
    return Choices(expert_GSK.astype(jnp.int32), gate_GSK)


def top_k(probs_GSX, *, top_k: int) -> Choices:
    """Token choice (Shazeer et al. 2017): the k best experts, gates a softmax over their
    logits (= their probabilities renormalized to sum to 1)."""
    gate_GSK, expert_GSK = jax.lax.top_k(probs_GSX, top_k)
    return Choices(expert_GSK.astype(jnp.int32), gate_GSK / jnp.sum(gate_GSK, -1, keepdims=True))


ROUTERS = {"switch": switch, "top_k": top_k}  # token choice; "expert_choice" below


def expert_choice(probs_GSX, valid_GS, *, slots: int) -> Slots:
    """Expert choice (Zhou et al. 2022): expert x takes the `slots` valid tokens with the
    highest probability of x (ties: the earlier token); gate = that probability."""
    S = probs_GSX.shape[1]
    score_GXS = jnp.where(valid_GS[:, None, :], jnp.swapaxes(probs_GSX, 1, 2), -1.0)
    gate_GXC, token_GXC = jax.lax.top_k(score_GXS, slots)
    taken = gate_GXC >= 0.0  # a padding token only when fewer valid tokens than slots
    token_GXC = jnp.where(taken, token_GXC, S).astype(jnp.int32)
    # The other way: token s's slot with expert x (if x took it), J = X.
    G, X, C = token_GXC.shape
    g = jnp.arange(G)[:, None, None]
    x = jnp.arange(X)[None, :, None]
    flat_GXC = (x * C + jnp.arange(C)[None, None, :]).astype(jnp.int32)
    slot_GSX = jnp.full((G, S + 1, X), X * C, jnp.int32).at[g, token_GXC, x].set(flat_GXC)
    gate_GSX = jnp.zeros((G, S + 1, X), jnp.float32).at[g, token_GXC, x].set(
        jnp.where(taken, gate_GXC, 0.0))
    return Slots(token_GXC, slot_GSX[:, :S], gate_GSX[:, :S])


def slots_from_choices(choices: Choices, valid_GS, *, experts: int, slots: int
                       ) -> tuple[Slots, jax.Array]:
    """Token choices -> each expert's slots, at most `slots` per expert and group.

    Priority (who gets a slot when an expert is over capacity): every token's first choice
    before any token's second choice, and within one choice rank, the earlier token (GShard).
    Returns the slots and `kept_GSK` (a choice that got its slot; padding never does).
    """
    expert_GSK, gate_GSK = choices
    G, S, K = expert_GSK.shape
    X, C = experts, slots
    hot_GKSX = jax.nn.one_hot(jnp.swapaxes(expert_GSK, 1, 2), X, dtype=jnp.int32) \
        * valid_GS[:, None, :, None].astype(jnp.int32)
    # Place in the expert's queue: choice-major, then token order.
    queue_GKSX = jnp.cumsum(hot_GKSX.reshape(G, K * S, X), axis=1).reshape(G, K, S, X) - 1
    pos_GSK = jnp.swapaxes(jnp.sum(queue_GKSX * hot_GKSX, -1), 1, 2)
    kept_GSK = valid_GS[..., None] & (pos_GSK < C)
    slot_GSK = jnp.where(kept_GSK, expert_GSK * C + pos_GSK, X * C)  # X * C: nowhere
    g_GSK = jnp.broadcast_to(jnp.arange(G)[:, None, None], slot_GSK.shape)
    s_GSK = jnp.broadcast_to(jnp.arange(S)[None, :, None], slot_GSK.shape)
    token_GP = jnp.full((G, X * C + 1), S, jnp.int32).at[g_GSK, slot_GSK].set(s_GSK)
    return Slots(token_GP[:, :-1].reshape(G, X, C), slot_GSK.astype(jnp.int32),
                 jnp.where(kept_GSK, gate_GSK, 0.0)), kept_GSK


# -- Losses and statistics, over valid tokens only ---------------------------------------

def balance_loss(probs_GSX, expert_GSK, valid_GS):
    """Switch's load-balancing loss X * sum_i f_i P_i: f_i the fraction of (valid) choices
    routed to expert i, P_i the mean router probability of i. A uniform router gives 1
    whatever the routing, and a zero gradient only where the routing is balanced too (a
    token's logit j gets (X f_j - 1) / (X n), n valid tokens: a bug hunt, session 103, found
    "vanishes whatever the routing" here); one collapsed onto an expert gives X.

    Over the whole batch: f and P sum over every routing group G as well as its tokens, not
    per group as Switch and GShard take it (Mesh-TF's gating reduces over a group's tokens,
    then averages f_i P_i over the groups). Capacity binds per group, so an imbalance local
    to the groups that cancels across them (group 0's tokens on expert 0, group 1's on expert
    1) reads 1 here, with no gradient, while each group drops past its capacity: the layer's
    `moe_dropped_frac` shows it, `moe_load_max_vs_mean` (the same sums) does not. In
    exchange the loss does not depend on how many groups, by default the data-parallel
    device count, the batch is split into."""
    X = probs_GSX.shape[-1]
    w_GS = valid_GS.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_GS), 1.0)
    routed_X = jnp.sum(jax.nn.one_hot(expert_GSK, X) * w_GS[..., None, None], axis=(0, 1, 2))
    f_X = routed_X / (n * expert_GSK.shape[-1])
    p_X = jnp.sum(probs_GSX * w_GS[..., None], axis=(0, 1)) / n
    return X * jnp.sum(f_X * p_X)


def z_loss(logits_GSX, valid_GS):
    """ST-MoE's router z-loss: mean over valid tokens of logsumexp(logits)^2 (keeps the
    router's logits small, so its softmax stays out of float32 round-off)."""
    w_GS = valid_GS.astype(jnp.float32)
    z_GS = jax.nn.logsumexp(logits_GSX, axis=-1)
    return jnp.sum(z_GS ** 2 * w_GS) / jnp.maximum(jnp.sum(w_GS), 1.0)


def entropy_sum(probs_GSX, valid_GS):
    """Sum over valid tokens of the router distribution's entropy (nats)."""
    h_GS = -jnp.sum(probs_GSX * jnp.log(jnp.maximum(probs_GSX, 1e-30)), -1)
    return jnp.sum(jnp.where(valid_GS, h_GS, 0.0))
