"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft LM proposes
`draft_tokens` tokens one at a time, the target LM scores them all in one call, and the
longest prefix the target agrees with is kept, plus one token of the target's own. The
output is the target's: token for token its greedy decoding when `greedy` (the one call on
k + 1 tokens and k + 1 single steps agree to float rounding, about 2e-5 in the tests, so
only a near-tie in the target's argmax could tell them apart), and when sampling, every
token is distributed as the target's next-token distribution p (a draft token d is kept with
probability min(1, p(d) / q(d)); at the first one refused, a token is drawn from the
residual max(p - q, 0), renormalized). That holds for any p, and any q that is exactly the
distribution each draft was drawn from (`draw` hands `accept` the very probabilities it drew
from), so the sampling options (`generate.sampling_logits`: temperature, top-k, top-p, min-p)
process both, and the output follows the target's processed distribution.

A round costs `draft_tokens + 1` draft steps and one target call on `draft_tokens + 1`
tokens (`TransformerLM.decode_tokens`), and emits between 1 and `draft_tokens + 1` tokens.
It pays where the target's step costs much more than the draft's and scoring k + 1 tokens
costs little more than one token (batch 1, where a step reads every weight once), and the
draft (a distilled student: `train.distill`) agrees with it often
(`python -m hpnlp.bench speculative`).

Each row keeps its own drafts: the caches hold a position per row (the key/value caches'
`index` and the LM's `position` as [B]), so a row that accepts more advances further, and
every row's tokens are those it would get decoded alone when greedy (sampled: the same
distribution, but a round's draws are made over the batch, so other tokens). After a round
both caches are set back to each row's kept tokens by resetting those positions, which is
exact for the key/value cache every variant without its own decode cache uses
(`Attention.exact_cache`): entries past a row's position are never read and are
overwritten. Variants with their own
cache (windows, recurrent states, features) are refused by `check`. A row that is done
idles (its tokens and counts no longer change) until the last row is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hpnlp.config import Config

# the leaves of a rewindable decode cache: the default key/value cache's (an int8 one's scales
# too: like its codes, what lies past the index is overwritten before it is read) and the
# LM's position
_CACHE_LEAVES = {"k", "v", "k_scale", "v_scale", "index", "position"}


def check(cfg: Config, draft_cfg: Config, *, length: int, draft_tokens: int,
          prompt_len: int) -> None:
    """Raises ValueError, naming the field and the fix, where speculative decoding of `cfg`
    with `draft_cfg` as the draft cannot run."""
    from hpnlp import attention as attention_lib

    if draft_tokens < 1:
        raise ValueError(f"speculative decoding: draft_tokens={draft_tokens}; it needs >= 1")
    for role, c in (("target", cfg), ("draft", draft_cfg)):
        if c.model.kind != "lm" or c.model.arch != "transformer":
            raise ValueError(f"speculative decoding: the {role} is a model.kind={c.model.kind!r}, "
                             f"model.arch={c.model.arch!r} run; it needs a Transformer LM")
        from hpnlp.models.generate import check_decodes
        try:
            check_decodes(c)
        except ValueError as e:
            raise ValueError(f"speculative decoding: the {role}: {e}") from None
        if not attention_lib.get(c.attention.name).exact_cache():
            raise ValueError(
                f"speculative decoding: the {role}'s attention.name={c.attention.name!r} keeps a "
                "decode cache of its own, which cannot be rewound to the accepted tokens; use a "
                "variant with the exact key/value cache (e.g. 'dense' or 'chunked')")
        if draft_tokens >= c.model.max_len:
            raise ValueError(f"speculative decoding: draft_tokens={draft_tokens} must be below the "
                             f"{role}'s model.max_len={c.model.max_len}; lower draft_tokens")
        # the only guard: a round's cache writes past max_len would be clamped onto earlier
        # entries (dynamic_update_slice), not refused
        if length + draft_tokens - 1 > c.model.max_len:
            raise ValueError(
                f"speculative decoding: length={length} with draft_tokens={draft_tokens} writes "
                f"{length + draft_tokens - 1} cache positions, past the {role}'s model.max_len="
                f"{c.model.max_len}; lower length or draft_tokens")
    from hpnlp.data import different_encoding
    why = different_encoding(cfg.data, draft_cfg.data)
    if why is None and cfg.model.vocab_size != draft_cfg.model.vocab_size:
        why = (f"model.vocab_size={draft_cfg.model.vocab_size!r} (the target: "
               f"{cfg.model.vocab_size!r})")
    if why:
        raise ValueError(f"speculative decoding: the draft has {why}; draft with a model of the "
                         "same task and vocabulary")
    if not 1 <= prompt_len < length:
        raise ValueError(f"speculative decoding: a prompt of {prompt_len} tokens with "
                         f"length={length}; it needs 1 to {length - 1} tokens: shorten the "
                         "prompt or raise length")


def same_tokenizer(workdir: str, draft_workdir: str) -> bool:
    """Whether two runs encode text alike: neither trained a subword model, or both kept the
    same one (WORKDIR/tokenizer, hpnlp.data.tokenizers)."""
    import os

    from hpnlp.data.tokenizers import DIRNAME, MODEL_FILE

    def model(w):
        path = os.path.join(w, DIRNAME, MODEL_FILE)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()
    return model(workdir) == model(draft_workdir)


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def rewind(cache, position):
    """The decode cache with every position (the key/value caches' `index`, the LM's
    `position`) set to `position`, one for every row or [B], each row's own (the leaves
    take its shape): the tokens from there on are forgotten."""
    def f(path, leaf):
        name = _leaf_name(path)
        if name not in _CACHE_LEAVES:
            raise ValueError(f"speculative decoding: the decode cache has a {name!r} entry "
                             f"({jax.tree_util.keystr(path)}), which rewinding cannot reset; "
                             "decode with a model whose only cache is the exact key/value one "
                             "(Attention.exact_cache)")
        if name not in ("index", "position"):
            return leaf
        pos = jnp.asarray(position, leaf.dtype)
        if any(getattr(k, "key", None) == "blocks" for k in path):  # model.stack_layers: one
            # per layer on a leading axis (found in review: [B] replaced it, so layer i read
            # row i's position, or the scan failed)
            pos = jnp.broadcast_to(pos, leaf.shape[:1] + pos.shape)
        return pos
    return jax.tree_util.tree_map_with_path(f, cache)


def _normalized(x_BKV):
    """Probabilities from processed logits (`sampling_logits`'), whose row maximum is
    exactly 0: no second shift, so the most probable token's e^0 = 1 keeps every sum >= 1
    (a bug hunt: at temperature 1e-10 the tempered logits reached -1e11, XLA:CPU's fused
    max-reduction and subtraction rounded x / T differently by hundreds, every shifted logit
    underflowed, and softmax gave NaN rows: every draft refused and token 0 emitted; the
    shift was made here until sampling_logits made it itself)."""
    e_BKV = jnp.exp(x_BKV)
    return e_BKV / jnp.sum(e_BKV, axis=-1, keepdims=True)


def _probs(logp_BKV, **opts):
    """The processed distribution (`sampling_logits` under `opts`) as probabilities."""
    from hpnlp.models.generate import sampling_logits
    return _normalized(sampling_logits(logp_BKV, **opts))


def draw(logq_BV, key, *, greedy: bool, temperature=1.0, top_k: int = 0, top_p=1.0,
         min_p=0.0):
    """A draft step's token d_B from the draft's log-probs [B, V] (masked by `known_ids`
    already), and q_BV: the processed distribution it was drawn from, as probabilities, for
    `accept` (None when greedy: the argmax, and a verdict that reads no q). q is computed
    here from the very logits d is drawn from, so its support is d's by construction: review
    r4 found `accept` recomputing it from the log-probs at [B, k, V], in another program and
    shape, where a reduction summed in another order could move a data-dependent cut (top-p's
    mass threshold, a tie at the k-th value, min-p's floor) by one token, and a draft outside
    the recomputed support (q = 0) would be kept with probability 1, not min(1, p / q)."""
    if greedy:
        return jnp.argmax(logq_BV, axis=-1).astype(jnp.int32), None
    from hpnlp.models.generate import sampling_logits
    x_BV = sampling_logits(logq_BV, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p)
    return jax.random.categorical(key, x_BV, axis=-1).astype(jnp.int32), _normalized(x_BV)


def accept(logp_BKV, q_BKV, d_BK, key, *, greedy: bool, temperature: float, top_k: int = 0,
           top_p=1.0, min_p=0.0):
    """One round's verdict, row by row. logp: the target's log-probs at the k + 1 positions
    after the pending token (the last follows all k drafts); q: the draft's processed
    distribution at the first k, the probabilities each d was drawn from (`draw`'s; unread
    when greedy, None will do). Returns (n_B, y_B): the drafts each row keeps (its longest
    accepted prefix) and its next token after them: the target's argmax (greedy), or a draw
    from the residual max(p - q, 0) at the first refused draft, or from p after all k were
    kept; p is processed here by `sampling_logits` (temperature, top_k, top_p, min_p) as
    `draw` processed q."""
    B, K1, _ = logp_BKV.shape
    k = K1 - 1
    rows = jnp.arange(B)
    if greedy:
        ok_BK = d_BK == jnp.argmax(logp_BKV[:, :k], axis=-1)
    else:
        ku, key = jax.random.split(key)
        p_BKV = _probs(logp_BKV, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p)
        p_BK = jnp.take_along_axis(p_BKV[:, :k], d_BK[..., None], axis=-1)[..., 0]
        q_BK = jnp.take_along_axis(q_BKV, d_BK[..., None], axis=-1)[..., 0]
        # u < p/q without the division: a draft outside p's support (p = 0) is refused, and
        # one with q = 0 (which a draw cannot give: q is `draw`'s own) is never a NaN
        ok_BK = jax.random.uniform(ku, (B, k)) * q_BK < p_BK
    n_B = jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=1), axis=1)
    if greedy:
        return n_B, jnp.argmax(logp_BKV[rows, n_B], axis=-1).astype(jnp.int32)
    p_BV = p_BKV[rows, n_B]
    q_BV = jnp.where((n_B < k)[:, None], q_BKV[rows, jnp.minimum(n_B, k - 1)], 0.0)
    r_BV = jnp.maximum(p_BV - q_BV, 0.0)
    r_BV = jnp.where(jnp.sum(r_BV, -1, keepdims=True) > 0, r_BV, p_BV)
    return n_B, jax.random.categorical(key, jnp.log(r_BV), axis=-1).astype(jnp.int32)


def speculative_generate(cfg: Config, params, draft_cfg: Config, draft_params, prompt_BP, *,
                         length: int, draft_tokens: int = 4, rng=None, temperature: float = 1.0,
                         greedy: bool = True, top_k: int = 0, top_p=1.0, min_p=0.0,
                         token_counts=None, draft_token_counts=None,
                         known_ids: int | None = None):
    """Returns (tokens [B, length]: the prompt followed by the target's continuation,
    stats {"rounds": target calls after the prompt, "accepted" [B]: drafts each row kept,
    "row_rounds" [B]: the calls each row took part in, before it was done}). Every row's
    prompt is the whole of `prompt_BP` (same length). Jit it with the configs static, like
    `generate.generate`; `check` runs here, before any tracing. Sampled, `top_k`, `top_p`
    and `min_p` act as in `generate` on both the draft's and the target's distributions, so
    the tokens follow the target's processed one; `temperature`, `top_p` and `min_p` may be
    arrays of one value per row, [B] or [B, 1], as there. `known_ids` (as in `generate`: the
    ids the tokenizer decodes) masks the ids from it on in both too, before the options, so
    neither model drafts nor emits them, greedy or sampled. `token_counts` and
    `draft_token_counts`: each run's train counts (`Trainer.task.token_counts`), which output
    layers that build tables from them need (`generate.check_token_counts`)."""
    from hpnlp.models import build
    from hpnlp.models.generate import (check_call, check_known_ids, check_prompt, check_sampling,
                                       check_temperature, check_token_counts, mask_unknown)

    check_prompt(cfg, prompt_BP)
    check_call(length, rng, draft_tokens=draft_tokens)
    B, P = prompt_BP.shape
    k = draft_tokens
    check(cfg, draft_cfg, length=length, draft_tokens=k, prompt_len=P)
    # each model's frequency-based tables from its own run's counts (a review, session 107:
    # without them both decoded through a Zipf stand-in, unsaid)
    check_token_counts(cfg, token_counts, "token_counts", "speculative decoding: the target's ")
    check_token_counts(draft_cfg, draft_token_counts, "draft_token_counts",
                       "speculative decoding: the draft's ")
    check_temperature(temperature, greedy, batch=B)
    check_known_ids(known_ids)
    check_sampling(top_k, top_p, min_p, greedy, cfg.model.vocab_size, known_ids=known_ids,
                   batch=B)
    opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    target = build(cfg, deterministic=True, decode=True, token_counts=token_counts)
    draft = build(draft_cfg, deterministic=True, decode=True, token_counts=draft_token_counts)
    zeros_B1 = jnp.zeros((B, 1), jnp.int32)

    def decoder(model, params):
        """(its empty decode cache, `apply(cache, tokens, method) -> (log-probs, or the hidden
        states with method='prefill', {"cache": ...})`)."""
        cache = model.init(jax.random.key(0), zeros_B1, method="decode_step")["cache"]
        return cache, lambda c, toks, method="decode_tokens": model.apply(
            {"params": params, "cache": c}, toks, method=method, mutable=["cache"])
    tcache, apply_t = decoder(target, params)
    dcache, apply_d = decoder(draft, draft_params)
    if P > 1:  # the prompt but its last token, in one call each, into the caches alone
        tcache = apply_t(tcache, prompt_BP[:, :-1], "prefill")[1]["cache"]
        dcache = apply_d(dcache, prompt_BP[:, :-1], "prefill")[1]["cache"]
    # a round writes up to k + 1 tokens after a row's pending one, past `length` in the last
    out_BL = jnp.zeros((B, length + k), jnp.int32).at[:, :P].set(prompt_BP)
    rng = jax.random.key(0) if rng is None else rng
    rows = jnp.arange(B)

    def draft_step(carry, _):
        dcache, tok_B, key = carry
        logq_B1V, upd = apply_d(dcache, tok_B[:, None])
        key, sub = jax.random.split(key)
        # masked before the options, as p is; q: what d was drawn from (None when greedy)
        d_B, q_BV = draw(mask_unknown(logq_B1V[:, 0], known_ids), sub, greedy=greedy, **opts)
        return (upd["cache"], d_B, key), (d_B, q_BV)

    def positions(t_B):
        """The caches' positions for rows at t: their own, or, for a row that is done (t
        past length - 2), length - 2, so its idle rounds write within max_len (`check`)."""
        return jnp.minimum(t_B, length - 2)

    def round_(state):
        t_B, out_BL, tcache, dcache, rng, rounds, accepted_B, row_rounds_B = state
        active_B = t_B < length - 1
        rng, kd, ka = jax.random.split(rng, 3)
        pending_B = out_BL[rows, t_B]
        # k + 1 draft steps: the last feeds the k-th draft, so the draft's cache holds every
        # token the round may keep
        (dcache, _, _), (d_KB, q_KBV) = jax.lax.scan(draft_step, (dcache, pending_B, kd),
                                                       None, length=k + 1)
        d_BK = d_KB[:k].T
        q_BKV = None if greedy else jnp.moveaxis(q_KBV[:k], 0, 1)
        logp_BKV, upd = apply_t(tcache, jnp.concatenate([pending_B[:, None], d_BK], axis=1))
        logp_BKV = mask_unknown(logp_BKV, known_ids)  # p masked as q was
        n_B, y_B = accept(logp_BKV, q_BKV, d_BK, ka, greedy=greedy, **opts)
        n_B = jnp.where(active_B, n_B, 0)
        j_1K = jnp.arange(k + 1)[None]
        new_BK1 = jnp.where(j_1K < n_B[:, None], jnp.pad(d_BK, ((0, 0), (0, 1))), y_B[:, None])
        # a row's kept drafts and its own token; nothing of a row that is done
        col_BK1 = jnp.where(active_B[:, None] & (j_1K <= n_B[:, None]),
                            t_B[:, None] + 1 + j_1K, out_BL.shape[1])
        out_BL = out_BL.at[rows[:, None], col_BK1].set(new_BK1, mode="drop")
        t_prev_B, t_B = t_B, jnp.where(active_B, t_B + n_B + 1, t_B)
        return (t_B, out_BL, rewind(upd["cache"], positions(t_B)),
                rewind(dcache, positions(t_B)), rng, rounds + 1,
                # the drafts it kept within the length (a bug hunt, session 100: those past
                # it were counted: 40 of 40 accepted where 48 tokens took 10 target calls)
                accepted_B + jnp.where(active_B, jnp.minimum(n_B, length - 1 - t_prev_B), 0),
                row_rounds_B + active_B)

    t_B = jnp.full((B,), P - 1, jnp.int32)
    zeros_B = jnp.zeros((B,), jnp.int32)
    state = (t_B, out_BL, rewind(tcache, t_B), rewind(dcache, t_B), rng, jnp.int32(0), zeros_B,
             zeros_B)
    _, out_BL, *_, rounds, accepted_B, row_rounds_B = jax.lax.while_loop(
        lambda s: jnp.any(s[0] < length - 1), round_, state)
    return out_BL[:, :length], {"rounds": rounds, "accepted": accepted_B,
                                "row_rounds": row_rounds_B}
