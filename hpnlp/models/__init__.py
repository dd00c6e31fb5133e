"""Models: a Transformer trunk with registry attention, and task heads on top.

    >>> model = hpnlp.models.build(cfg, deterministic=False)          # doctest: +SKIP
    >>> sums = model.apply({"params": params}, batch, rngs={"dropout": key})  # doctest: +SKIP
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from hpnlp.config import Config, config_error
from hpnlp.models.heads import Classifier, DualEncoder, TransformerLM  # noqa: F401
from hpnlp.models.bi_encoder import BiEncoder  # noqa: F401
from hpnlp.models.generate import generate  # noqa: F401
from hpnlp.models.speculative import speculative_generate  # noqa: F401

# `python -m hpnlp.models.generate` (the CLI) runs that module as __main__ after this package
# imported it for `generate`; runpy warns of the two copies, which here is harmless (the CLI
# uses its own copy throughout), so its warning is not shown on every call
warnings.filterwarnings("ignore", message="'hpnlp.models.generate' found in sys.modules",
                        category=RuntimeWarning)

MODELS = {"lm": TransformerLM, "classifier": Classifier, "dual_encoder": DualEncoder,
          "bi_encoder": BiEncoder}


def build(cfg: Config, *, deterministic: bool, decode: bool = False, token_counts=None,
          forward_only: bool = False):
    """The model for `cfg.model.kind`; `deterministic=True` turns dropout off (eval).

    `token_counts` [V] (the task's train counts per id) feed the frequency-based output
    layers (Huffman trees, frequency classes, unigram samplers; without them those
    assume frequency-sorted ids) and the fixed gradient table of
    `model.embed_grad_scale = "corpus"`, which a `decode` model does without, and one built
    `forward_only` (its gradients never taken: shapes, evaluation, routing).
    """
    cls = MODELS[cfg.model.kind]
    V = cfg.model.vocab_size
    if not isinstance(V, (int, np.integer)) or V <= 0:  # every kind embeds ids: a [V, E] table
        # (a bug hunt, session 102: vocab_size 0, "take it from the task", failed deep in JAX
        # on "a non-empty jnp.take() from an empty axis")
        raise config_error("model.vocab_size", V, "the model's token table needs its size; "
                           "build from the config hpnlp.config.validate returns (it takes the "
                           "size from the task, hpnlp.data.task_info, as Trainer does) or set "
                           "model.vocab_size")
    C = cfg.model.num_classes
    if cfg.model.kind in ("classifier", "dual_encoder") and (
            not isinstance(C, (int, np.integer)) or C < 1):  # (a review, session 116: Dense(0),
        # and an argmax of an empty class axis inside JAX)
        raise config_error("model.num_classes", C, "the classifier's head needs its class "
                           "count; build from the config hpnlp.config.validate returns (it takes "
                           "the count from the task) or set model.num_classes")
    if isinstance(token_counts, np.ndarray) and token_counts.ndim == 1 and len(token_counts) < V:
        # model.vocab_size above the task's: the last ids are never seen (found in review:
        # every LM failed here; validate allows a larger table, e.g. one that splits evenly)
        token_counts = np.pad(token_counts, (0, V - len(token_counts)))
    if cfg.model.arch == "transformer_xl":  # segment recurrence (validate: kind "lm" only)
        from hpnlp.models.transformer_xl import TransformerXLLM as cls
    extra = {}
    if cfg.model.embed_grad_scale == "corpus" and token_counts is not None:
        from hpnlp.models.transformer import RowWeights, corpus_count_weights
        # slots an optimizer step's batch reads (its rows x seq_len x the texts embedded per
        # row; padding included, so for padded batches the expected counts are upper bounds);
        # the whole batch's, not a microbatch's, so train.grad_accum leaves the update as it
        # is (a bug hunt, session 102: grad_accum 4 and 1 gave the same batch different
        # gradients). A pair model embeds 2 texts a row, 3 with mined negatives (review r1:
        # counted as 1, its expected counts were 2-3x too low, no upper bounds)
        per_step = cfg.train.batch_size * cfg.data.seq_len * _texts_per_row(cfg)
        extra["embed_weights"] = RowWeights(corpus_count_weights(token_counts, per_step))
    elif cfg.model.embed_grad_scale == "corpus" and (decode or forward_only):
        # the table scales only the embedding's gradient (scaled_take's VJP; its forward is a
        # plain take), which decoding and evaluation never take: ones stand in (review r4:
        # generate without token_counts failed inside its init's trace, telling the user to
        # pass them to build; the crash hunt, session 112: so did `python -m hpnlp.compress
        # quantize`'s reload check of such a run, which builds its shapes without them)
        from hpnlp.models.transformer import RowWeights
        extra["embed_weights"] = RowWeights(np.ones(V, np.float32))
    if token_counts is not None and cfg.model.kind == "lm":
        # One Frequencies per model, not one per `setup` (which flax reruns on every
        # apply): the output layers' table and sampler caches then hit.
        from hpnlp.softmax import frequencies
        extra["token_counts"] = frequencies(token_counts, cfg.model.vocab_size)
    if decode:
        return cls(cfg, deterministic=True, decode=True, **extra)
    return cls(cfg, deterministic=deterministic, **extra)


def _texts_per_row(cfg: Config) -> int:
    """Texts the model embeds per batch row: a pair's two sides, and a bi-encoder's mined
    negative (hpnlp.retrieval.mining) where it mines; one for the other kinds."""
    if cfg.model.kind == "bi_encoder":
        return 3 if cfg.model.encoder.mine_every else 2
    return 2 if cfg.model.kind == "dual_encoder" else 1


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
