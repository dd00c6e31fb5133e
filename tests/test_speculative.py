"""Speculative decoding: the target's own greedy tokens, its sampling distribution, the
cache rewind, and the errors before any compile."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import AttentionConfig, DataConfig
from hpnlp.models import speculative
from test_models import V, init, lm_batch, make_cfg

LEN = 14  # generated length; the configs' max_len is 16


@pytest.fixture(scope="module")
def lms():
    """A target LM and an unrelated, smaller draft (random weights: they agree sometimes)."""
    cfg = make_cfg("lm")
    draft_cfg = make_cfg("lm", width=16, depth=1, num_heads=2, mlp_dim=32)
    batch = lm_batch()
    return cfg, init(cfg, batch)[1], draft_cfg, init(draft_cfg, batch)[1], batch["inputs"]


@pytest.mark.parametrize("prompt_len, draft_tokens, self_draft", [(4, 3, False), (1, 2, True)])
def test_greedy_speculative_decoding_emits_the_targets_own_greedy_tokens(
        lms, prompt_len, draft_tokens, self_draft):
    cfg, params, draft_cfg, draft_params, inputs = lms
    if self_draft:  # the target drafting for itself: every draft is kept
        draft_cfg, draft_params = cfg, params
    prompt = inputs[:, :prompt_len]
    want = jax.jit(lambda p, pr: models.generate(cfg, p, pr, jnp.full((2,), prompt_len),
                                                 length=LEN))(params, prompt)
    got, stats = jax.jit(lambda p, dp, pr: speculative.speculative_generate(
        cfg, p, draft_cfg, dp, pr, length=LEN, draft_tokens=draft_tokens))(
            params, draft_params, prompt)
    np.testing.assert_array_equal(got, want)
    rounds, kept = int(stats["rounds"]), int(stats["accepted"])
    # each round emits its kept drafts and one token of the target's own (the last round's
    # past `length` are cut)
    assert LEN - prompt_len <= rounds + kept < LEN - prompt_len + draft_tokens + 1
    if self_draft:
        assert kept == rounds * draft_tokens
        assert rounds == -(-(LEN - prompt_len) // (draft_tokens + 1))
    else:
        assert kept < rounds * draft_tokens  # some draft was refused


def test_generate_prefills_a_whole_prompt_in_one_call_with_the_same_tokens(lms):
    cfg, params, *_, inputs = lms
    for greedy in (True, False):
        run = jax.jit(lambda p, pr, lens, greedy=greedy: models.generate(
            cfg, p, pr, lens, length=LEN, greedy=greedy, rng=jax.random.key(5)))
        stepwise = run(params, inputs[:, :6], jnp.full((2,), 6))
        np.testing.assert_array_equal(run(params, inputs[:, :6], None), stepwise)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_accepted_or_resampled_tokens_follow_the_targets_distribution(temperature):
    """Many rounds of one row with k = 2 drafts drawn from q (per-position distributions
    that ignore the context, so the target's tokens are independent): the token a round
    emits at each position it reaches (a kept draft, a residual draw after a refusal, or the
    target's own after both were kept) is distributed as p at that position."""
    logp = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    logq = jnp.log(jnp.array([[0.3, 0.3, 0.2, 0.2], [0.4, 0.3, 0.2, 0.1]]))

    def one(key):
        kd, ka = jax.random.split(key)
        d_2 = jax.random.categorical(kd, logq / temperature, axis=-1).astype(jnp.int32)
        n, y = speculative.accept(logp[None], logq[None], d_2[None], ka, greedy=False,
                                  temperature=temperature)
        return n, jnp.where(jnp.arange(3) < n, jnp.pad(d_2, (0, 1)), y[0])  # emitted tokens

    n, emitted = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), 60000))
    n, emitted = np.asarray(n), np.asarray(emitted)
    for pos in range(3):
        reached = emitted[n >= pos, pos]  # rounds that emit a token at this position
        assert len(reached) > 5000
        want = jax.nn.softmax(logp[pos] / temperature)
        np.testing.assert_allclose(np.bincount(reached, minlength=4) / len(reached), want,
                                   atol=5 * np.sqrt(0.25 / len(reached)))


def test_rewind_forgets_tokens_and_refuses_a_cache_it_cannot_reset():
    cache = {"trunk": {"state": {"k": jnp.ones((1, 4)), "v": jnp.ones((1, 4)),
                                 "index": jnp.int32(3)}}, "position": jnp.int32(3)}
    out = speculative.rewind(cache, 1)
    assert int(out["position"]) == 1 and int(out["trunk"]["state"]["index"]) == 1
    with pytest.raises(ValueError, match="'memory' entry"):
        speculative.rewind({"memory": jnp.zeros(2)}, 0)


def test_bad_drafts_and_lengths_are_refused_before_compiling():
    cfg = make_cfg("lm")
    ok = dict(length=LEN, draft_tokens=2, prompt_len=3)
    speculative.check(cfg, cfg, **ok)
    cases = [
        (dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=V + 1)), ok,
         "model.vocab_size=41"),
        (dataclasses.replace(cfg, data=DataConfig(task="word_lm")), ok, "data.task='word_lm'"),
        (dataclasses.replace(cfg, attention=AttentionConfig("performer", {})), ok,
         "attention.name='performer' keeps a decode cache of its own"),
        (cfg, dict(ok, length=16), "past the target's model.max_len=16"),
        (cfg, dict(ok, draft_tokens=0), "draft_tokens=0"),
        (cfg, dict(ok, prompt_len=LEN), "they need 1 to 13"),
        (make_cfg("classifier"), ok, "needs a Transformer LM"),
    ]
    for draft, kw, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            speculative.check(cfg, draft, **kw)
