"""Incremental decoding for the causal LM: greedy or sampled, one `lax.scan`.

Each step feeds one token per row through the model in decode mode, which reads and
extends the attention variant's cache (an exact key/value cache by default), so a step
costs O(T) instead of re-running the prefix. Prompts may differ in length: while
`t < prompt_len[b]` row b is fed its prompt token (prefill), then its own samples.

Sampling draws from `sampling_logits`: the next-token distribution at a temperature, cut
to its `top_k` most probable tokens, to the smallest set reaching `top_p` of the mass
(nucleus sampling), and to the tokens at least `min_p` times as probable as the top one.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import attention as attention_lib
from hpnlp.config import Config


def check_temperature(temperature, greedy: bool, flags: bool = False, *, batch=None) -> None:
    """A ValueError where sampling (not `greedy`) is asked at a temperature that is not a
    finite number above 0 (a traced one is the caller's to check). NumPy and concrete JAX
    scalars count too: `jnp.float32(0)` sampled silently from NaN logits. An array gives one
    temperature per row, each checked, and with `batch` (the rows) its shape too: [B] or [B, 1]
    (`_row_shape`). `flags`: named as the command line's."""
    if isinstance(temperature, jax.core.Tracer):
        if batch is not None and not greedy and np.ndim(temperature):
            _row_shape("temperature", np.shape(temperature), (batch,))
        return
    if not _is_number(temperature):  # review r7: "0.8" passed float() here, then failed in the
        # trace with a TypeError that named no argument
        name = "--temperature " if flags else "temperature="
        raise ValueError(f"{name}{temperature!r}: it must be a number (e.g. 0.8), not a "
                         f"{type(temperature).__name__}")
    if greedy:  # a bug hunt: generate(..., temperature=0.8) decoded greedily, unsaid (greedy is
        # the default); top_k, top_p and min_p were refused so already
        if not flags and _is_set(temperature, 1.0):
            raise ValueError(f"temperature={temperature!r} shapes sampling, which greedy "
                             "decoding does not do (the argmax would ignore it); pass "
                             "greedy=False to sample, or leave temperature at 1.0")
        return
    if batch is not None and np.ndim(temperature):
        _row_shape("temperature", np.shape(temperature), (batch,))
    # float32's smallest normal: below it the temperature flushed to 0 on the CPU and every
    # token sampled was 0 (a bug hunt, session 90: 1e-38 emitted NULs where 1e-30 was greedy)
    tiny = float(np.finfo(np.float32).tiny)
    t = np.asarray(temperature, np.float64)
    if not np.all((tiny <= t) & (t < np.inf)):
        name, greedily = (("--temperature ", "--greedy for the argmax") if flags
                          else ("temperature=", "decode greedily"))
        shown = t.tolist() if t.ndim else temperature
        raise ValueError(f"{name}{shown}: sampling needs a finite temperature of at least "
                         f"{tiny:.3g} (float32's smallest normal); give one (e.g. 0.8), or "
                         f"{greedily}")


def _is_number(value) -> bool:
    """A real number: Python's or NumPy's, or an array of integers or floats; not a bool,
    a str or None (review r7: "0.9", read from a JSON file say, passed `float()` in the checks
    and failed inside the trace)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, (np.ndarray, jax.Array)) and (
        jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating))


def _is_set(value, off) -> bool:
    """Whether a sampling option is on: a traced or array value always counts as on."""
    return (isinstance(value, jax.core.Tracer) or bool(np.ndim(value))
            or float(value) != off)


def check_sampling(top_k, top_p, min_p, greedy: bool, vocab_size=None, *,
                   flags: bool = False, known_ids=None, batch=None) -> None:
    """A ValueError, one line naming the option and the fix, where `top_k` is not an int
    >= 0 (or exceeds `vocab_size`, or `known_ids`: the ids the tokenizer decodes), `top_p`
    is not a number in (0, 1], `min_p` not one in [0, 1), or any of them is set with `greedy`
    (the argmax would ignore it). An array of `top_p` or `min_p` gives one value per row, each
    checked, and with `batch` (the rows) its shape too: [B] or [B, 1] (`_row_shape`). Traced
    values are the caller's to check (their shapes are checked). `flags`: name them as the
    CLI's flags (`--top-k 5`)."""
    def name(opt, value):
        return f"--{opt.replace('_', '-')} {value}" if flags else f"{opt}={value!r}"

    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise ValueError(f"{name('top_k', top_k)}: it counts tokens, so it must be an int (a "
                         "static one under jit); 0 keeps every token")
    if top_k < 0:
        raise ValueError(f"{name('top_k', top_k)}: it must be >= 0 (0 keeps every token)")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"{name('top_k', top_k)} is larger than the vocabulary "
                         f"(model.vocab_size={vocab_size}); lower it, or 0 to keep every token")
    if known_ids is not None and top_k > known_ids:
        known = (f"the run's tokenizer's {known_ids} token ids" if flags else
                 f"known_ids={known_ids}, the token ids the tokenizer decodes")
        of = "" if vocab_size is None else f" (of model.vocab_size={vocab_size})"
        raise ValueError(f"{name('top_k', top_k)} is larger than {known}{of}; lower it, or 0 to "
                         "keep every token")
    for opt, value, ok, allowed in (
            ("top_p", top_p, lambda v: (0 < v) & (v <= 1),
             "in (0, 1] (1 keeps every token; e.g. 0.9)"),
            ("min_p", min_p, lambda v: (0 <= v) & (v < 1),
             "in [0, 1) (0 keeps every token; e.g. 0.05)")):
        if isinstance(value, jax.core.Tracer):
            continue
        # an array gives one value per row, each checked (review r6: its values and shape
        # were left to the caller, and a [B] one failed deep in the trace)
        if not _is_number(value) or not np.all(ok(np.asarray(value, np.float64))):
            array = _is_number(value) and np.ndim(value)
            raise ValueError(f"{name(opt, np.asarray(value).tolist() if array else value)}: "
                             f"{'each value' if array else 'it'} must be a number {allowed}")
    if greedy:
        for opt, value, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0), ("min_p", min_p, 0.0)):
            if not isinstance(value, jax.core.Tracer) and _is_set(value, off):
                fix = ("drop one of the two" if flags else
                       f"pass greedy=False to sample, or leave {opt} at {off}")
                raise ValueError(f"{name(opt, value)} shapes sampling, which "
                                 f"{'--greedy' if flags else 'greedy decoding'} does not do "
                                 f"(the argmax would ignore it); {fix}")
    elif batch is not None:  # a traced array's shape too: known before the trace
        for opt, value in (("top_p", top_p), ("min_p", min_p)):
            if np.ndim(value):
                _row_shape(opt, np.shape(value), (batch,))


def _row_shape(opt: str, shape, lead) -> tuple:
    """The shape an array option `opt` of `shape` takes against values [*lead, V]: one value
    per row, aligned with the leading axes from the left and padded with 1s, so [B] and [B, 1]
    both give row b its own (a 1 broadcasts). Review r6: a [B] top_p, broadcast from the right
    as NumPy does, met the vocabulary axis: a TypeError deep in the bisection, or, where
    B == V, token j cut or divided by row j's value, unsaid. A ValueError naming `opt` for any
    other shape."""
    shape, lead = tuple(shape), tuple(lead)
    full = shape + (1,) * (len(lead) + 1 - len(shape))
    if (len(full) != len(lead) + 1 or full[-1] != 1
            or any(n not in (1, m) for n, m in zip(full, lead))):
        raise ValueError(f"{opt}: an array must give one value per row, shape {lead} or "
                         f"{lead + (1,)} (or be a number); got shape {shape}")
    return full


def _order_keys(x_BV):
    """uint32 keys [B, V] in the order of the float32 values (-0 taken as +0), so that a
    threshold can be found by bisection over them."""
    bits_BV = jax.lax.bitcast_convert_type(jnp.where(x_BV == 0, 0, x_BV).astype(jnp.float32),
                                           jnp.uint32)
    return jnp.where(bits_BV >> 31 == 1, ~bits_BV, bits_BV | jnp.uint32(1 << 31))


def _nucleus(x_BV, keep_BV, top_p):
    """Of the tokens `keep_BV` (None: all), those in the smallest set of most probable
    whose probability (renormalized over `keep_BV`) reaches top_p: the tokens at or above
    the largest value v with mass(x >= v) >= top_p, found by bisection over the values'
    bits: 32 masked sums of the row (0.8 ms at 16 x 8000 on one CPU core, where sorting the
    rows took 18)."""
    neg_inf = jnp.array(-jnp.inf, x_BV.dtype)
    in_BV = x_BV if keep_BV is None else jnp.where(keep_BV, x_BV, neg_inf)
    w_BV = jax.nn.softmax(in_BV.astype(jnp.float32), axis=-1)
    key_BV = _order_keys(in_BV)
    if keep_BV is not None:
        key_BV = jnp.where(keep_BV, key_BV, 0)  # below every kept one, even -inf's key

    def halve(_, lo_hi):
        lo_B1, hi_B1 = lo_hi
        mid_B1 = lo_B1 + (hi_B1 - lo_B1 + 1) // 2
        ok_B1 = jnp.sum(jnp.where(key_BV >= mid_B1, w_BV, 0), axis=-1, keepdims=True) >= top_p
        return jnp.where(ok_B1, mid_B1, lo_B1), jnp.where(ok_B1, hi_B1, mid_B1 - 1)

    # lo: every kept token (all the mass), hi: the most probable alone
    lo_B1 = jnp.min(jnp.where(in_BV > neg_inf, key_BV, key_BV.max()), axis=-1, keepdims=True)
    lo_B1, _ = jax.lax.fori_loop(0, 32, halve, (lo_B1, jnp.max(key_BV, axis=-1, keepdims=True)))
    # a traced top_p of 1 keeps every token, whatever the rounding of the sums
    out_BV = (key_BV >= lo_B1) | (jnp.asarray(top_p) >= 1)
    return out_BV if keep_BV is None else keep_BV & out_BV


def sampling_logits(logp_BV, *, temperature=1.0, top_k: int = 0, top_p=1.0, min_p=0.0):
    """The logits [B, V] of the distribution to sample the next token from, given the
    model's log-probs [B, V] (B: any leading axes): `(logp - max logp) / temperature`, with
    the tokens the options remove at -inf (softmax renormalizes what is left). The shift
    leaves the distribution as it is and the most probable token's logit at 0 at any
    temperature (a review, session 103: unshifted, logp / T overflowed to -inf for every
    token at a tiny T once the most probable had p below about 2%, and token 0 was drawn).
    Applied in Hugging Face's order, each to the tempered distribution the previous one left
    (renormalized):

    - `top_k` (0: off): the k most probable tokens;
    - `top_p` (1.0: off): nucleus sampling (Holtzman et al. 2020), the smallest set of most
      probable tokens whose probability reaches top_p; the most probable always stays;
    - `min_p` (0.0: off): the tokens at least min_p times as probable as the most probable
      (a ratio, so it does not matter which of the others came first).

    Ties: a token as probable as the last one kept is kept too (every cut is a threshold on
    the value), so tied tokens at the k-th value can keep more than k, and which tokens stay
    never depends on their ids. `top_k` is static (`lax.top_k`); `top_p` and `min_p` may be
    traced. No sort: a top-k, a bisection for top_p (`_nucleus`) and a max, about 1 ms in
    all at 16 x 8000 on one CPU core.

    `temperature`, `top_p` and `min_p` are each a number, or an array of one value per row,
    aligned with the leading axes from the left ([B] or [B, 1] for [B, V]; [B] or [B, K] for
    [B, K, V]), the same as calling row by row; another shape is a ValueError (`_row_shape`).

        >>> sampling_logits(jnp.log(jnp.array([[.5, .3, .15, .05]])), top_p=0.75)
        Array([[ 0.        , -0.51082563,        -inf,        -inf]], dtype=float32)
    """
    # an array per row as [B, 1] (review r6: a [B] one was applied along the vocabulary)
    lead = logp_BV.shape[:-1]
    temperature, top_p, min_p = (
        v if not jnp.ndim(v) else jnp.reshape(v, _row_shape(opt, jnp.shape(v), lead))
        for opt, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)))
    top_B1 = jnp.max(logp_BV, axis=-1, keepdims=True)
    x_BV = (logp_BV - jnp.where(jnp.isfinite(top_B1), top_B1, 0)) / temperature
    V = x_BV.shape[-1]
    if top_k > V:
        raise ValueError(f"top_k={top_k} is larger than the vocabulary (the log-probs' last "
                         f"axis, {V}); lower it, or 0 to keep every token")
    keep_BV = None
    if 0 < top_k < V:
        # the k-th value as the top k's min: XLA:CPU turned a top_k whose last value alone
        # is read into a whole sort (15 ms instead of 0.3 at 16 x 8000)
        keep_BV = x_BV >= jnp.min(jax.lax.top_k(x_BV, top_k)[0], axis=-1, keepdims=True)
    if _is_set(top_p, 1.0):
        keep_BV = _nucleus(x_BV, keep_BV, top_p)
    if _is_set(min_p, 0.0):
        # p >= min_p * p_max, in logs; log(0) = -inf keeps every token
        floor_B1 = (jnp.max(x_BV, axis=-1, keepdims=True)
                    + jnp.log(jnp.asarray(min_p, jnp.float32)).astype(x_BV.dtype))
        keep_BV = x_BV >= floor_B1 if keep_BV is None else keep_BV & (x_BV >= floor_B1)
    return x_BV if keep_BV is None else jnp.where(keep_BV, x_BV, jnp.array(-jnp.inf, x_BV.dtype))


def check_call(length, rng, **counts) -> None:
    """A ValueError where `length` (or another count of tokens in `counts`) is not an int,
    or `rng` is not one JAX random key (a seed given as an int, say, or a uint32 array of
    another shape than a raw key's): both failed inside JAX."""
    for name, n in dict(length=length, **counts).items():
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ValueError(f"{name}={n!r}: it counts tokens, so it must be an int")
    if rng is None:
        return
    dtype = getattr(rng, "dtype", None)
    if dtype is None or not (jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32):
        raise ValueError(f"rng={rng!r} is not a JAX random key; pass one, e.g. "
                         "rng=jax.random.key(0)")
    # one key: a typed one of shape (), or a raw one of the default implementation's data shape
    # (threefry's (2,)). A review (session 107): jnp.uint32(7) passed, and sampling failed in
    # the trace on "invalid PRNG key data", naming no argument (greedy ignored it, unsaid)
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    one = () if typed else jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    if np.shape(rng) != one:
        kind = "key array" if typed else "uint32 array"
        raise ValueError(f"rng: a {kind} of shape {np.shape(rng)} is not a JAX random key (one "
                         f"key has shape {one}{'' if typed else ' as raw uint32 data'}); pass "
                         "one, e.g. rng=jax.random.key(0)")


def check_features_key(cfg: Config, features_key) -> None:
    """A ValueError where the attention variant's decoding draws its random features from
    the run's `features` stream (Performer with redraw) and no `features_key` is given: the
    model would decode with a draw it never trained with (its seed's), and sample another
    function silently (a review, r12: the quickstart notebook's sample of a Performer run).
    LSH decodes by full attention over its cache, reading no features: no key needed."""
    if features_key is None and attention_lib.draws_features(
            cfg.attention.name, cfg.attention.options, decoding=True):
        raise ValueError(f"attention.name={cfg.attention.name!r} draws its random features from "
                         "the run's features stream, so decoding needs the draw it trained with: "
                         "pass features_key=state.features_key(cfg.train.feature_redraw_every)")


def check_known_ids(known_ids) -> None:
    """A ValueError where `known_ids` is neither None nor an int >= 1."""
    if known_ids is not None and (isinstance(known_ids, bool) or not isinstance(
            known_ids, (int, np.integer)) or known_ids < 1):
        raise ValueError(f"known_ids={known_ids!r}: it counts the token ids the tokenizer "
                         "decodes (those from it on are never emitted), so it must be an int >= "
                         "1, or None for every id")


def mask_unknown(logp_BV, known_ids):
    """`logp_BV` [..., V] with the ids from `known_ids` on at -inf: no decoding picks or draws
    them, and the options of `sampling_logits` act on the rest (a processing step like
    top-k, so speculative decoding, masking p and q alike, still follows the target's processed
    distribution). None: every id. A review (r7): a word LM on a file of 3,000 distinct words
    with data.word_vocab_size=8000 (or a model.vocab_size above the task's) sampled from its
    never-trained rows, and the CLI's decode of the output failed on them."""
    if known_ids is None or known_ids >= logp_BV.shape[-1]:
        return logp_BV
    return logp_BV.at[..., known_ids:].set(-jnp.inf)


# what each frequency-based output layer builds from the train counts (`models.build`'s
# `token_counts`), for `check_token_counts`'s message; a layer with a `counts` field not named
# here (a newly registered one) is taken to build something from them too
_BUILT_FROM_COUNTS = {"hierarchical": "its Huffman tree", "class_based": "its frequency classes",
                      "binary_code": "its ids' codewords (by frequency rank)",
                      "adaptive": "its default cutoffs (output.options.cutoffs unset)"}


def check_token_counts(cfg: Config, token_counts, arg: str = "token_counts",
                       role: str = "") -> None:
    """A ValueError where `token_counts` is None and `cfg`'s output layer builds a table that
    decoding reads from the train counts: a Huffman tree, frequency classes, codewords by frequency
    rank, an adaptive softmax's default cutoffs. Training builds it from the task's counts;
    without them `build` takes a Zipf stand-in over the ids, so each id read another's path,
    class or code (wrong log-probs, unsaid) or the parameters' shapes differed (a flax error
    naming no argument): a review (session 107). The sampled objectives (sampled, nce,
    negative_sampling) read the counts only to draw their training negatives and to set their
    initial bias, which the trained parameters replace: not refused. `arg`: the argument's
    name; `role`: the model's, as the message's prefix (speculative decoding's draft)."""
    if token_counts is not None or cfg.model.kind != "lm":
        return
    import dataclasses

    from hpnlp import softmax as softmax_lib
    from hpnlp.softmax.sampled import SampledObjective
    name = cfg.output.name
    cls = softmax_lib.get(name)
    if ("counts" not in {f.name for f in dataclasses.fields(cls)}
            or issubclass(cls, SampledObjective)
            or (name == "adaptive" and cfg.output.options.get("cutoffs") is not None)):
        return
    built = _BUILT_FROM_COUNTS.get(name, "its tables")
    raise ValueError(f"{role}output.name={name!r} builds {built} from the train counts the run "
                     f"trained with, and decoding must build the same: pass {arg}="
                     "trainer.task.token_counts (trainer: the run's hpnlp.train.Trainer(cfg, "
                     "workdir, read_only=True))")


def check_decodes(cfg: Config) -> None:
    """A ValueError, naming the field, where `cfg`'s model cannot decode a token at a time:
    not a causal Transformer LM, random features drawn at decode time
    (`attention.draws_features`) by reversible blocks or per pipeline stage (mesh.pipeline
    other than 1), or experts that choose their tokens (`expert_choice` ranks a whole group's)."""
    if cfg.model.kind != "lm":
        raise ValueError(f"decoding needs a causal LM (model.kind='lm'); this config is a "
                         f"model.kind={cfg.model.kind!r} one")
    if cfg.model.arch != "transformer":  # found in review: a traceback, deep in the init
        raise ValueError(f"decoding needs a Transformer LM's key/value cache "
                         f"(model.arch='transformer'); this config is a model.arch="
                         f"{cfg.model.arch!r} one")
    from hpnlp import attention as attention_lib
    if cfg.model.reversible and attention_lib.draws_features(
            cfg.attention.name, cfg.attention.options, decoding=True):
        # found in review: decoding runs the blocks bound, which draw other features per
        # layer (make_rng) than the functional pass that trained and evaluates the model (its
        # per-block keys). Only a draw at decode time differs (review r4: the class flag also
        # refused LSH, which decodes by full attention, drawing nothing, and Performer with
        # redraw=False, whose one draw is its seed's in both passes)
        raise ValueError(f"decoding a model.reversible=True model with attention.name="
                         f"{cfg.attention.name!r} (features redrawn: attention.options.redraw="
                         "True) would draw other random features than its training did; decode "
                         "a model.reversible=False run of it, or one trained with "
                         "attention.options.redraw=False")
    if cfg.mesh.pipeline != 1 and attention_lib.draws_features(  # -1: every device
            cfg.attention.name, cfg.attention.options, decoding=True):
        # found in review: the pipeline stages fold each layer's index into the features key,
        # the unpipelined scan that decodes splits it, so the layers' draws differ
        # (parallel/pipeline.py); the redraw=False draw (the seed's) is the same in both
        raise ValueError(f"decoding a mesh.pipeline={cfg.mesh.pipeline} run with attention.name="
                         f"{cfg.attention.name!r} would draw other random features per layer "
                         "than its pipelined training did (decoding runs the layers unpipelined); "
                         "decode a run trained with mesh.pipeline=1 or attention.options.redraw="
                         "False")
    # a review (session 114): a config not validated with an int8 cache and a variant that
    # keeps a cache of its own cast its float keys into int8 (sliding_window) or crashed
    # mid-scan (clustered); validate's own check
    from hpnlp.config.checks import _check_kv_cache
    _check_kv_cache(cfg)
    if cfg.model.moe.num_experts and cfg.model.moe.router == "expert_choice":
        # a README walk: a traceback from the layer's own check, inside the decode's trace
        raise ValueError("decoding a model.moe.router='expert_choice' model: each expert ranks "
                         "a whole group's tokens, which one decoded token at a time does not "
                         "have; decode a run with a token-choice router ('switch' or 'top_k')")


def check_prompt(cfg: Config, prompt_BP, prompt_len_B=None) -> None:
    """A ValueError, naming what is wrong, where `cfg` cannot decode (`check_decodes`) or the
    prompt is not [batch, length] integer token ids; the ids (and `prompt_len_B`) are checked
    against the vocabulary (and the prompt's length) where they are concrete, not traced."""
    check_decodes(cfg)
    shape, dtype = jnp.shape(prompt_BP), getattr(prompt_BP, "dtype", None)
    if len(shape) != 2 or shape[1] < 1 or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"the prompt must be a [batch, length >= 1] array of integer token ids; "
                         f"got shape {shape}, dtype {dtype} (e.g. jnp.asarray([ids], jnp.int32))")
    if not isinstance(prompt_BP, jax.core.Tracer) and prompt_BP.size:
        ids = np.asarray(prompt_BP)  # on the host: jnp would stage it into an enclosing trace
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.model.vocab_size:
            raise ValueError(f"the prompt holds token ids {lo}..{hi}, outside the vocabulary "
                             f"0..{cfg.model.vocab_size - 1} (model.vocab_size); encode it with "
                             "the run's own tokenizer")
    if prompt_len_B is not None and not isinstance(prompt_len_B, jax.core.Tracer):
        lens = np.asarray(prompt_len_B)
        if (lens.shape != (shape[0],) or not np.issubdtype(lens.dtype, np.integer)
                or int(lens.min()) < 1 or int(lens.max()) > shape[1]):
            raise ValueError(f"prompt_len_B must give each of the {shape[0]} rows a length in "
                             f"1..{shape[1]} (the prompt's width), as integers; got "
                             f"{lens.tolist()}")


def generate(cfg: Config, params, prompt_BP, prompt_len_B=None, *, length: int, rng=None,
             temperature: float = 1.0, greedy: bool = True, top_k: int = 0, top_p=1.0,
             min_p=0.0, features_key=None, token_counts=None, quant_vars=None,
             known_ids: int | None = None):
    """Returns tokens [B, length]: the prompt followed by generated tokens.

    `length` <= model.max_len (the cache's positions). With learned positions
    (model.pos_emb='learned') training reached only those below data.seq_len, and the
    table's rows past them keep their init: keep `length` <= data.seq_len
    (`trained_length`, the CLI's default) for positions the model learned.

    Sampled (`greedy=False`), each token is drawn from `sampling_logits` of the model's
    next-token log-probs: `temperature`, then `top_k` (0: off), `top_p` (1.0: off) and
    `min_p` (0.0: off); they are refused with `greedy` (the default), which would ignore
    them (it ignores `rng`). `temperature`, `top_p` and `min_p` may be arrays of one value per
    row, [B] or [B, 1].

    `known_ids`: the token ids the tokenizer decodes, where the model has more rows (a
    model.vocab_size above the task's, or a word file with fewer words than
    data.word_vocab_size): ids from it on are never emitted, greedy or sampled
    (`mask_unknown`). None: every id of the model.

    `prompt_len_B` None: every row's prompt is the whole of `prompt_BP`, and where the
    attention variant keeps the exact key/value cache (`Attention.exact_cache`) all but its
    last token go through the model in one call (prefill) instead of one a step.

    `features_key`: the random-feature draw the model was trained with, for variants
    that use the `features` stream (Performer); pass
    `state.features_key(cfg.train.feature_redraw_every)` (its last train step's draw).
    `token_counts`: the train counts the model was built with (`Trainer.task.token_counts`),
    which output layers that build tables from them need (`check_token_counts`: hierarchical,
    class_based, binary_code, adaptive without cutoffs; not model.embed_grad_scale='corpus',
    whose table scales only gradients). `quant_vars`: a quantized model's
    calibrated activation ranges (`compress.ptq.load`'s third value).
    """
    from hpnlp.models import build

    check_prompt(cfg, prompt_BP, prompt_len_B)
    check_features_key(cfg, features_key)
    B, P = prompt_BP.shape
    check_temperature(temperature, greedy, batch=B)
    check_known_ids(known_ids)
    check_sampling(top_k, top_p, min_p, greedy, cfg.model.vocab_size, known_ids=known_ids,
                   batch=B)
    check_call(length, rng)
    if length > cfg.model.max_len:
        raise ValueError(f"generate(length={length}) exceeds model.max_len={cfg.model.max_len}")
    if P > length:
        raise ValueError(f"prompt length {P} exceeds generate(length={length})")
    check_token_counts(cfg, token_counts)
    model = build(cfg, deterministic=True, decode=True, token_counts=token_counts)
    # jitted: an eager init runs the model op by op, compiling every primitive separately
    cache = jax.jit(lambda tok: model.init(jax.random.key(0), tok, method="decode_step")["cache"])(
        jnp.zeros((B, 1), jnp.int32))
    prompt_BL = jnp.zeros((B, length), jnp.int32).at[:, :P].set(prompt_BP)
    rng = jax.random.key(0) if rng is None else rng
    rngs = {} if features_key is None else {"features": features_key}
    extra = {"quant": quant_vars} if quant_vars else {}
    start = 0
    if prompt_len_B is not None:
        prompt_len_B = jnp.asarray(prompt_len_B)  # a list of lengths, say
    else:
        prompt_len_B = jnp.full((B,), P, jnp.int32)
        if P > 1 and attention_lib.get(cfg.attention.name).exact_cache():
            cache = model.apply({"params": params, "cache": cache, **extra}, prompt_BP[:, :-1],
                                method="prefill", mutable=["cache"], rngs=rngs)[1]["cache"]
            start = P - 1

    def step(carry, t):
        cache, prev_B = carry
        tok_B = jnp.where(t < prompt_len_B, prompt_BL[:, t], prev_B)
        logp_BV, upd = model.apply({"params": params, "cache": cache, **extra}, tok_B[:, None],
                                   method="decode_step", mutable=["cache"], rngs=rngs)
        logp_BV = mask_unknown(logp_BV, known_ids)
        if greedy:
            nxt_B = jnp.argmax(logp_BV, axis=-1)
        else:  # position t's own draw: the same tokens with and without the prefill
            logits_BV = sampling_logits(logp_BV, temperature=temperature, top_k=top_k,
                                        top_p=top_p, min_p=min_p)
            nxt_B = jax.random.categorical(jax.random.fold_in(rng, t), logits_BV, axis=-1)
        return (upd["cache"], nxt_B.astype(jnp.int32)), tok_B

    _, toks_LB = jax.lax.scan(step, (cache, jnp.zeros((B,), jnp.int32)), jnp.arange(start, length))
    return jnp.concatenate([prompt_BL[:, :start], toks_LB.T], axis=1)


def trained_length(cfg: Config) -> int | None:
    """The positions `cfg`'s training reached where its model reads a learned table of them
    (model.pos_emb='learned'): data.seq_len, its rows' length (packed segments restart at
    0). The table's rows from there to model.max_len took no gradient and keep their init
    (review r4: the CLI decoded up to max_len by default, into them, unsaid). None for
    sinusoidal and rope positions: computed from the position, they read no table."""
    if cfg.model.pos_emb != "learned":
        return None
    return min(cfg.data.seq_len, cfg.model.max_len)


def word_prompt_notes(task, prompts, ids=None) -> list[str]:
    """A word-level LM reads its prompts lowercased, and words outside its vocabulary as
    <unk>: said, not done silently (a README walk's prompt came back lowercased, one word as
    <unk>, without a word why). Nothing for other tokenizers, which read any text. `ids`:
    the prompts as `task.encode` gave them, where the caller has them already."""
    unk = task.meta.get("unk_id")
    if unk is None:
        return []
    from hpnlp.data.text_tasks import word_tokens
    notes = []
    if any(p != p.lower() for p in prompts):
        notes.append("this run's vocabulary is lowercase words, so the prompts are read "
                     "lowercased")
    ids = [task.encode(p) for p in prompts] if ids is None else ids
    missing = sorted({w for p, x in zip(prompts, ids) for w, i in zip(word_tokens(p), x)
                      if i == unk})
    if missing:
        shown = ", ".join(map(repr, missing[:10])) + (", ..." if len(missing) > 10 else "")
        notes.append(f"{len(missing)} prompt word{'s are' if len(missing) > 1 else ' is'} not "
                     f"among the run's {len(task.meta['words'])} words and read as "
                     f"{task.meta['words'][unk]}: {shown}")
    return notes


def main(argv=None) -> int:
    """`python -m hpnlp.models.generate --workdir W --prompt TEXT [--prompt TEXT ...]`: sample
    from the LM trained in W (or quantized into W by `python -m hpnlp.compress quantize`),
    its prompts encoded and its output decoded by the run's own tokenizer (bytes, words, or
    the subword model kept in the run's W/tokenizer)."""
    import argparse
    import dataclasses
    import os
    import sys

    from hpnlp.config import ConfigError, validate

    from hpnlp.models import speculative
    from hpnlp.train.carry import model_params
    from hpnlp.train.checkpoint import (NoCheckpoint, compressed, is_stacked, load_run_config,
                                        run_members)
    from hpnlp.train.loop import Trainer

    p = argparse.ArgumentParser(prog="python -m hpnlp.models.generate", description=main.__doc__)
    p.add_argument("--workdir", required=True, help="a trained LM run, or a quantized one "
                   "(python -m hpnlp.compress quantize --out)")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeatable)")
    p.add_argument("--length", type=int, default=None, help="tokens in all, prompt included "
                   "(default: model.max_len; with --draft, less the drafts a round writes past "
                   "it: model.max_len - draft_tokens + 1; at most data.seq_len where the run's "
                   "positions are learned, model.pos_emb='learned': the positions its training "
                   "reached; a longer --length is noted)")
    p.add_argument("--temperature", type=float, default=None,
                   help="divides the logits before sampling (default 0.8; not with --greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most probable "
                   "tokens only (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: from the "
                   "smallest set of most probable tokens holding this much of the probability, "
                   "e.g. 0.9 (default 1.0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="sample from the tokens at least "
                   "this many times as probable as the most probable one, e.g. 0.05 (default "
                   "0.0: all); --top-k, --top-p and --min-p apply in that order, after "
                   "--temperature, and with --draft to both runs")
    p.add_argument("--greedy", action="store_true", help="argmax instead of sampling")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampling key's seed (>= 0, default 0; not with --greedy); the "
                   "prompts are sampled together "
                   "from it, so a row alone with the same seed draws other tokens (with "
                   "--draft, the next prompt's seed is one more)")
    p.add_argument("--draft", default="", help="a smaller LM run of the same task and "
                   "vocabulary (e.g. a distilled student) for speculative decoding, in fewer "
                   "target calls: with --greedy the target's own tokens; sampled, tokens "
                   "distributed as the target's (other draws than without --draft)")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="tokens the draft proposes per target call (with --draft; default 4)")
    p.add_argument("--kv-cache", choices=("none", "int8"), default=None,
                   help="the key/value cache (quant.kv_cache; default: the run's own): int8 "
                        "codes read at a quarter of float32's bytes (with --draft, both runs')")
    args = p.parse_args(argv)

    def with_kv_cache(cfg, workdir):
        if args.kv_cache is None:
            return cfg
        try:
            # the fields alone: the reader lays the run out for these devices after (review,
            # session 100: checked against them as saved, a GPU run's cuDNN was refused here)
            return validate(dataclasses.replace(cfg, model=dataclasses.replace(
                cfg.model, quant=dataclasses.replace(cfg.model.quant, kv_cache=args.kv_cache))),
                devices=False)
        except ConfigError as e:  # (the trained run's fields are not this command's to
            # change: a review, session 115, found "set quant.kv_cache='none'" its only fix)
            raise ValueError(f"--kv-cache {args.kv_cache} for {workdir}: {e}; for this run, "
                             "decode without --kv-cache (or with --kv-cache none)") from None

    # quantized.npz alone too, whose load names the file missing (a bug hunt, session 98:
    # "no run in workdir: train one there first")
    def quantized(folder):
        return compressed(folder) == "quantize"

    def load(workdir):
        """(config, task, weights()): a trained run, or a quantized one (`python -m
        hpnlp.compress quantize --out`, holding quant.json), whose `weights()` gives
        (params, quant_vars, features_key)."""
        if quantized(workdir):
            return load_quantized(workdir)
        cfg = load_run_config(workdir)
        members = run_members(workdir)
        # a bug hunt: "holds checkpoints of a different model", which it is not; a 1-member
        # ensemble too (review, session 105: past this, the Trainer's mismatch named another tool)
        if is_stacked(members):
            flag = "--draft" if workdir == args.draft else "--workdir"
            raise NoCheckpoint(f"{flag} {workdir}: a seed ensemble of {members} "
                               f"member{'s' if members > 1 else ''}; generate decodes one LM run "
                               "(train a plain one with python -m hpnlp.main)")
        if cfg.model.kind != "lm" or cfg.model.arch != "transformer":
            raise NoCheckpoint(f"{workdir}: a model.kind={cfg.model.kind!r}, model.arch="
                               f"{cfg.model.arch!r} run; generate decodes Transformer LMs "
                               "(model.kind='lm', model.arch='transformer')")
        checked = cfg
        if cfg.mesh.pipeline == -1:  # the stages its checkpoint trained in (a review,
            # session 118: a run that filled one stage was refused as pipelined)
            from hpnlp.compress.distill import checkpoint_pipeline_stages
            if checkpoint_pipeline_stages(workdir) == 1:
                checked = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, pipeline=1))
        check_decodes(checked)  # before any weights load or compile
        cfg = with_kv_cache(cfg, workdir)
        trainer = Trainer(cfg, workdir, read_only=True)
        if trainer.checkpointer.latest_step() is None:
            raise NoCheckpoint(f"{workdir}: no checkpoint to read; train the run first")

        def weights():
            state, _ = trainer.initial_state()
            return (model_params(state.params), None,
                    state.features_key(cfg.train.feature_redraw_every))
        # the config as the reader laid it out here (a bug hunt, session 100: a GPU run's
        # cuDNN attention, which the reader reads by XLA's, was decoded as saved)
        return trainer.cfg, trainer.task, weights

    def load_quantized(out):
        """A quantized folder: its packed weights served by the integer kernels where they
        compute the format (`ptq.serve`), the tokenizer from the run it was made from."""
        import json

        from hpnlp import data as data_lib
        from hpnlp import models
        from hpnlp.compress import ptq
        from hpnlp.data import tokenizers
        from hpnlp.train.loop import dummy_batch

        cfg, packed, quant_vars = ptq.load(out)
        if cfg.model.kind != "lm" or cfg.model.arch != "transformer":  # as a run's (a bug hunt)
            raise NoCheckpoint(f"{out}: a quantized model.kind={cfg.model.kind!r}, model.arch="
                               f"{cfg.model.arch!r} model; generate decodes Transformer LMs "
                               "(model.kind='lm', model.arch='transformer')")
        check_decodes(cfg)
        cfg = with_kv_cache(cfg, out)
        with open(os.path.join(out, "quant.json")) as f:
            kept = json.load(f).get("source", {})
        source = kept.get("workdir")
        model_file = os.path.join(source or "", tokenizers.DIRNAME, tokenizers.MODEL_FILE)
        if (cfg.data.tokenizer in tokenizers.SUBWORD and not cfg.data.prepared
                and not (source and os.path.exists(model_file))):
            # else a subword model would be trained afresh, and might split text otherwise
            where = model_file if source else "(not named in quant.json)"
            raise NoCheckpoint(f"{out}: its text goes through the subword model of the run it "
                               f"was quantized from, {where}, which is not there; restore that "
                               "run's tokenizer folder")
        task = data_lib.make_task(cfg.data, workdir=source if source and os.path.isdir(source)
                                  else None, save_tokenizer=False)
        if source and os.path.isdir(source):  # the text its vocabulary came from, as a run's
            data_lib.check_text_of_run(cfg, task, source)  # (review d1: Trainer's only)
        elif source:  # the run moved: its text's digest as quant.json keeps it (a review,
            # session 118: a word model decoded under a vocabulary of the file as it is now)
            data_lib.check_text_of_run(cfg, task, source, kept=kept.get(data_lib.TEXT_FILE) or {})

        def weights():
            model = models.build(cfg, deterministic=True, token_counts=task.token_counts)
            batch = dummy_batch("lm", 1, cfg.data.seq_len)
            return (ptq.serve(model, packed, batch, quant_vars), quant_vars,
                    ptq.load_features_key(out))  # Performer's, LSH's draw (else None)
        return cfg, task, weights

    try:
        # found by a bug hunt: --temperature with --greedy was taken and ignored
        if args.greedy and args.temperature is not None:
            raise ValueError(f"--temperature {args.temperature} shapes sampling, which --greedy "
                             "does not do (the argmax would ignore it); drop one of the two")
        if args.temperature is None:  # 1.0 for --greedy: generate() refuses another there
            args.temperature = 1.0 if args.greedy else 0.8
        check_temperature(args.temperature, args.greedy, flags=True)
        check_sampling(args.top_k, args.top_p, args.min_p, args.greedy, flags=True)
        if args.draft_tokens is not None and args.draft_tokens < 1:  # a bug hunt (session
            # 102): refused by speculative.check in its API's words, draft_tokens=0 (review:
            # before --draft is asked for, which would not make it allowed)
            raise ValueError(f"--draft-tokens {args.draft_tokens}: a round drafts at least one "
                             "token; give 1 or more (default 4)")
        # found by a bug hunt: --draft-tokens without --draft (even 0) and --length 0 were
        # taken and ignored, the latter as "model.max_len"
        if args.draft_tokens is not None and not args.draft:
            raise ValueError(f"--draft-tokens {args.draft_tokens} is for speculative decoding; "
                             "give --draft RUN too, or drop it")
        drafts_given = args.draft_tokens is not None
        args.draft_tokens = 4 if args.draft_tokens is None else args.draft_tokens
        if args.greedy and args.seed is not None:  # a review (session 117): taken, ignored
            raise ValueError(f"--seed {args.seed} draws the samples, which --greedy does not "
                             "take (the argmax draws nothing); drop one of the two")
        args.seed = 0 if args.seed is None else args.seed
        top = 2**63 - len(args.prompt)  # the keys' seeds, one more per prompt, are C longs
        if not 0 <= args.seed < top:  # a bug hunt (session 90): an OverflowError traceback
            raise ValueError(f"--seed {args.seed}: give a seed from 0 to {top - 1}")
        if args.length is not None and args.length < 2:
            raise ValueError(f"--length {args.length}: it counts the prompt too, so it needs at "
                             "least 2 (one prompt token and one new)")
        cfg, task, weights = load(args.workdir)
        if args.length is not None and args.length > cfg.model.max_len:
            raise ValueError(f"--length {args.length} exceeds the run's model.max_len="
                             f"{cfg.model.max_len}; lower --length")
        most = cfg.model.max_len  # the longest --length allowed
        # by default no further than the learned positions training reached (review r4)
        trained = trained_length(cfg) or most
        length = args.length or min(most, trained)
        # the ids the run's tokenizer decodes: fewer than the model's rows where a word file
        # has fewer words than data.word_vocab_size or model.vocab_size exceeds the task's
        # (review r7: an id past them was sampled, and the decode of the output failed)
        known = len(task.meta["words"]) if "words" in task.meta else task.vocab_size
        check_sampling(args.top_k, args.top_p, args.min_p, args.greedy, cfg.model.vocab_size,
                       flags=True, known_ids=known)
        if args.draft:
            for flag, w in (("--workdir", args.workdir), ("--draft", args.draft)):
                if quantized(w):  # named by its own flag (a
                    # bug hunt, session 95: a quantized --workdir was blamed on --draft)
                    raise ValueError(f"{flag} {w}: a quantized folder; "
                                     "speculative decoding reads trained runs: give "
                                     f"{flag} the run it was quantized from, or decode a "
                                     "quantized --workdir without --draft")
            draft_cfg, draft_task, draft_weights = load(args.draft)
            both_max = min(cfg.model.max_len, draft_cfg.model.max_len)
            if args.draft_tokens >= both_max:  # review (session 102): speculative.check's
                # "draft_tokens=32 must be below ...; lower draft_tokens" named no flag
                raise ValueError(f"--draft-tokens {args.draft_tokens} must be below the smaller "
                                 f"model.max_len={both_max} of --workdir and --draft (a round "
                                 "writes its drafts past the prompt into both caches); give 1 "
                                 f"to {both_max - 1}, fewer for longer prompts")
            # by default as long as both caches hold a round's drafts past it
            most = both_max - args.draft_tokens + 1
            length = args.length or min(most, trained)  # the target's: its tokens are output
            if length > most:  # a review (session 107): speculative.check's "lower length or
                # draft_tokens" named no flag
                fewer = (f" or --draft-tokens (to {both_max - length + 1} or fewer)"
                         if length <= both_max else "")
                raise ValueError(f"--length {length} with --draft-tokens {args.draft_tokens} "
                                 f"writes {length + args.draft_tokens - 1} cache positions, past "
                                 f"the smaller model.max_len={both_max} of --workdir and --draft; "
                                 f"lower --length (to {most} or fewer){fewer}")
            speculative.check(cfg, draft_cfg, length=length, draft_tokens=args.draft_tokens,
                              prompt_len=1)
            if not speculative.same_tokenizer(args.workdir, args.draft):
                raise ValueError(f"--draft {args.draft}: its tokenizer (WORKDIR/tokenizer) "
                                 f"differs from {args.workdir}'s; draft with a run that shares it")
    except (NoCheckpoint, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for t in args.prompt:  # bytes the terminal could not decode arrive as surrogates
            t.encode("utf-8")
    except UnicodeEncodeError:
        print("error: a --prompt is not valid UTF-8 text (check the terminal's encoding)",
              file=sys.stderr)
        return 2
    ids = [task.encode(t) for t in args.prompt]
    for note in word_prompt_notes(task, args.prompt, ids):
        print(f"note: {note}", file=sys.stderr)
    longest = max(len(x) for x in ids)
    capped = args.length is None and length < most  # by trained_length
    if args.draft and args.length is None and longest >= length and not capped:
        # the bound --draft-tokens set, not a --length never given (a bug hunt, session 102:
        # "needs 1 to 1 tokens (--length 2)" for a 3-token prompt and --draft-tokens 127)
        shorten = f"shorten the prompts longer than {length - 1} tokens"  # (review: "it")
        fix = (f"lower --draft-tokens (to {both_max - longest} or fewer for these prompts), or "
               f"{shorten}" if longest < both_max else
               f"{shorten} (with --draft-tokens 1 a prompt may have up to {both_max - 1} tokens)")
        flag = f"--draft-tokens {args.draft_tokens}{'' if drafts_given else ' (the default)'}"
        print(f"error: {flag} leaves room for prompts of at most {length - 1} tokens (the "
              f"smaller model.max_len={both_max}, less --draft-tokens - 1, is {length} tokens "
              f"in all); these have {[len(x) for x in ids]}; {fix}",
              file=sys.stderr)
        return 2
    if longest >= length or min(len(x) for x in ids) == 0:
        # a bug hunt: the bound unexplained; raising --length offered only where it helps (a
        # bug hunt, session 97: a 60-token prompt was told to raise it, up to a max_len of 48)
        bound = (f"the run's model.max_len={cfg.model.max_len}" if not args.draft else
                 f"{most} with --draft: the smaller model.max_len, less --draft-tokens - 1")
        fix = ("" if longest < length else f"; shorten it, or raise --length (up to {bound})"
               if longest < most else f"; shorten it (the longest --length is {bound})")
        why = (", by default the run's data.seq_len: the positions its learned position "
               "table trained" if capped else "")
        print(f"error: every prompt needs 1 to {length - 1} tokens (--length {length}{why}); "
              f"these have {[len(x) for x in ids]}{fix}", file=sys.stderr)
        return 2
    if length > trained:  # said, not refused: a longer text is the user's to ask for
        print(f"note: --length {length} decodes positions {trained}..{length - 1}, which the "
              f"run's training (data.seq_len={trained}) never reached: their rows of its "
              "learned position table (model.pos_emb='learned') are untrained, so the text "
              f"there may degrade; --length {trained} or less keeps to trained positions",
              file=sys.stderr)
    try:  # the checkpoints are read here (a bug hunt: a damaged one gave a 41-line traceback)
        params, quant_vars, features_key = weights()
        if args.draft:
            draft_params = draft_weights()[0]
    except (NoCheckpoint, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.draft:  # prompt by prompt (batch 1, where drafting pays)
        run = jax.jit(lambda p, dp, pr, key: speculative.speculative_generate(
            cfg, p, draft_cfg, dp, pr, length=length, draft_tokens=args.draft_tokens, rng=key,
            temperature=args.temperature, greedy=args.greedy, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, token_counts=task.token_counts,
            draft_token_counts=draft_task.token_counts, known_ids=known))
        for i, x in enumerate(ids):
            tokens_1L, stats = run(params, draft_params, jnp.asarray([x], jnp.int32),
                                   jax.random.key(args.seed + i))
            print(task.decode(np.asarray(tokens_1L)[0]))
            rounds, kept = int(stats["rounds"]), int(np.sum(stats["accepted"]))
            # (a review, session 116: the prompt's own call was not counted among them)
            calls = f"{rounds} target calls after the prompt's" if len(x) > 1 else \
                f"{rounds} target calls"
            print(f"speculative: {length - len(x)} tokens in {calls}; "
                  f"{kept} of {rounds * args.draft_tokens} drafts accepted", file=sys.stderr)
        return 0
    prompt_BP = np.zeros((len(ids), max(len(x) for x in ids)), np.int32)
    for b, x in enumerate(ids):
        prompt_BP[b, :len(x)] = x
    tokens_BL = generate(cfg, params, jnp.asarray(prompt_BP),
                         jnp.asarray([len(x) for x in ids]), length=length,
                         rng=jax.random.key(args.seed), temperature=args.temperature,
                         greedy=args.greedy, top_k=args.top_k, top_p=args.top_p,
                         min_p=args.min_p, features_key=features_key,
                         token_counts=task.token_counts, quant_vars=quant_vars,
                         known_ids=known)
    for row in np.asarray(tokens_BL):
        print(task.decode(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
