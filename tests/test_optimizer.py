"""The optimizer (hpnlp/train/state.py): which parameters weight decay reaches.

Init only, no training: each model's boxed parameters come from `jax.eval_shape`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import default_configdict, from_configdict, validate
from hpnlp.train.loop import dummy_batch
from hpnlp.train.state import _decay_mask, make_optimizer

# The matrices and tables of the models below: weight decay reaches these and nothing else.
MATRICES = {"embedding", "kernel", "qkv", "out", "pos_embedding", "wi", "wo", "router",
            "input_kernel", "recurrent_kernel"}


def _config(variant):
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=8, batching="pack")
    cd.model.update(kind="lm", width=16, depth=2, num_heads=2, mlp_dim=32, max_len=8)
    cd.output.tie_embeddings = False  # a table and an output kernel with its bias
    if variant == "stacked":
        cd.model.stack_layers = True
    elif variant == "moe":
        cd.model.moe.update(num_experts=4, every=1)
    elif variant in ("lstm", "gru"):  # every RNN parameter there is
        cd.model.arch = variant
        cd.rnn.update(layer_norm=True, learned_init=True)
    return validate(from_configdict(cd))


def _boxed(variant):
    model = models.build(_config(variant), deterministic=True)
    batch = dummy_batch("lm", 1, 8)
    return jax.eval_shape(lambda k: model.init({"params": k, "dropout": k}, batch)["params"],
                          jax.random.key(0))


def _is_box(x):
    return isinstance(x, nn.meta.AxisMetadata)


def _flat(tree):
    return {tuple(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]}


@pytest.mark.parametrize("variant", ["plain", "stacked", "moe", "lstm", "gru"])
def test_weight_decay_reaches_matrices_and_tables_only(variant):
    """Not biases, norms, gains, an RNN's initial states (a bug hunt, session 101: the rank
    rule decayed the LSTM's forget bias [1, 4, H], its gains, MoE biases [experts, F], and
    every stacked norm [depth, D]), at the optimizer's init (boxed parameters) and at its
    update (unboxed: the names kept from the init)."""
    boxed = _boxed(variant)
    want = {path: path[-1] in MATRICES for path in _flat(boxed)}
    assert set(want.values()) == {True, False}
    assert _flat(_decay_mask(boxed)) == want
    unboxed = jax.tree.map(lambda b: b.value, boxed, is_leaf=_is_box)
    assert _flat(_decay_mask(unboxed)) == want


def test_stacked_blocks_decay_what_unstacked_ones_do():
    def by_module(flat):  # block_0/block_1 (unstacked) and blocks (stacked) -> one module
        return {tuple(k for k in path if not k.startswith("block")): m
                for path, m in flat.items()}
    plain, stacked = (by_module(_flat(_decay_mask(_boxed(v)))) for v in ("plain", "stacked"))
    assert plain == stacked


def test_weight_decay_under_the_ensemble_vmap():
    """The optimizer's update, vmapped over members as the ensemble trains: with no gradient
    (Adam's step 0), decay alone moves exactly the matrices."""
    from hpnlp.config import TrainConfig
    boxed = _boxed("moe")
    tx = make_optimizer(TrainConfig(lr=1.0, weight_decay=0.5, warmup_steps=0, clip_norm=0.0))
    state = jax.eval_shape(tx.init, boxed)
    params = jax.tree.map(lambda b: jnp.ones((2,) + b.value.shape, b.value.dtype), boxed,
                          is_leaf=_is_box)
    opt = jax.tree.map(lambda s: jnp.zeros((2,) + s.shape, s.dtype), nn.unbox(state))
    update = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p)[0]))
    moved = _flat(update(jax.tree.map(jnp.zeros_like, params), opt, params))
    want = {path: path[-1] in MATRICES for path in moved}
    assert {path: bool(np.any(u != 0)) for path, u in moved.items()} == want


@pytest.mark.parametrize("loss", ["in_batch", "triplet"])
def test_accumulation_is_refused_where_a_microbatch_would_shrink_the_negatives(loss):
    """A bug hunt (session 101): the bi-encoder's in-batch negatives were each microbatch's,
    batch 16 in 4 scoring each pair against 3 others (loss 45.0 against one batch's 22.7)."""
    from hpnlp.config import ConfigError
    cd = default_configdict()
    cd.data.update(task="verse_pairs", seq_len=16)
    cd.model.update(kind="bi_encoder", width=16, depth=1, num_heads=2, mlp_dim=32, max_len=16)
    cd.model.encoder.loss = loss
    cd.train.update(batch_size=16, grad_accum=4)
    with pytest.raises(ConfigError, match=r"train.grad_accum` = 4 .*in-batch negatives"):
        validate(from_configdict(cd))
    cd.train.grad_accum = 1
    validate(from_configdict(cd))
