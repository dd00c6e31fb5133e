"""The optimizer (hpnlp/train/state.py): which parameters weight decay reaches, and where the
learning-rate schedule's ends fall.

Init only, no training: each model's boxed parameters come from `jax.eval_shape`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import TrainConfig, default_configdict, from_configdict, validate
from hpnlp.train.loop import dummy_batch
from hpnlp.train.state import decay_mask, make_optimizer

# The matrices and tables of the models below: weight decay reaches these and nothing else.
MATRICES = {"embedding", "kernel", "qkv", "out", "pos_embedding", "wi", "wo", "router",
            "input_kernel", "recurrent_kernel", "rel", "w1", "w2"}


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
    elif variant == "transformer_xl":  # global biases u, v [H, D]
        cd.model.arch = variant
        cd.data.batching = "stream"
    elif variant == "synthesizer":  # the dense MLP's per-head biases b1 [H, F], b2 [H, M]
        cd.attention.update(name=variant, options={"mode": "dense", "max_len": 8})
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


@pytest.mark.parametrize("variant", ["plain", "stacked", "moe", "lstm", "gru",
                                     "transformer_xl", "synthesizer"])
def test_weight_decay_reaches_matrices_and_tables_only(variant):
    """Not biases, norms, gains, an RNN's initial states (a bug hunt, session 101: the rank
    rule decayed the LSTM's forget bias [1, 4, H], its gains, MoE biases [experts, F], and
    every stacked norm [depth, D]; Transformer-XL's u, v [H, D] and the synthesizer's b1,
    b2 [H, F] were still decayed after), in a mask over the parameters as they train
    (unboxed), drawn from the boxed ones (`make_optimizer` gives it to optax's init and
    update: the next tests)."""
    boxed = _boxed(variant)
    want = {path: path[-1] in MATRICES for path in _flat(boxed)}
    assert set(want.values()) == {True, False}
    mask = decay_mask(boxed)
    assert _flat(mask) == want
    assert jax.tree.structure(mask) == jax.tree.structure(nn.unbox(boxed))


def test_stacked_blocks_decay_what_unstacked_ones_do():
    """Each unstacked block against the stacked ones (review, session 101: block_0 and
    block_1 merged into one key, the last kept, hid a difference between blocks)."""
    def without(flat, block):  # the tree with `block` as the one block, its key dropped
        others = lambda path: any(k.startswith("block") and k != block for k in path)  # noqa
        return {tuple(k for k in path if k != block): m for path, m in flat.items()
                if not others(path)}
    plain, stacked = (_flat(decay_mask(_boxed(v))) for v in ("plain", "stacked"))
    blocks = {k for path in plain for k in path if k.startswith("block_")}
    assert blocks == {"block_0", "block_1"}
    for block in sorted(blocks):
        assert without(plain, block) == without(stacked, "blocks"), block


def test_the_mask_is_each_optimizer_s_own_drawn_from_the_boxed_names():
    """A bug hunt (session 101): the update's mask looked the init's axis names up in a
    registry by path and shape, so an update the process's init had not seen (or had seen
    with other names) fell back to the rank rule. Here no model's init runs, and two trees
    share a path and shape: [layers, D] is a stacked vector, [embed, mlp] a matrix."""
    sds = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    t = TrainConfig(lr=1.0, weight_decay=0.5, warmup_steps=0, clip_norm=0.0)
    params = {"w": jnp.ones((2, 4))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    for names, decayed in ((("layers", "embed"), False), (("embed", "mlp"), True)):
        tx = make_optimizer(t, params={"w": nn.LogicallyPartitioned(sds, names)})
        state = jax.tree.map(jnp.zeros_like, jax.eval_shape(tx.init, params))
        moved = np.any(tx.update(zeros, state, params)[0]["w"] != 0)
        assert moved == decayed, names


def test_weight_decay_under_the_ensemble_vmap():
    """The optimizer's update, vmapped over members as the ensemble trains: with no gradient
    (Adam's step 0), decay alone moves exactly the matrices."""
    boxed = _boxed("moe")  # the mask is over each member's tree
    tx = make_optimizer(TrainConfig(lr=1.0, weight_decay=0.5, warmup_steps=0, clip_norm=0.0),
                        params=boxed)
    state = jax.eval_shape(tx.init, boxed)
    params = jax.tree.map(lambda b: jnp.ones((2,) + b.value.shape, b.value.dtype), boxed,
                          is_leaf=_is_box)
    opt = jax.tree.map(lambda s: jnp.zeros((2,) + s.shape, s.dtype), nn.unbox(state))
    update = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p)[0]))
    moved = _flat(update(jax.tree.map(jnp.zeros_like, params), opt, params))
    want = {path: path[-1] in MATRICES for path in moved}
    assert {path: bool(np.any(u != 0)) for path, u in moved.items()} == want


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_schedule_s_ends_by_optimizer_count(schedule):
    """What train.end_lr_frac's comment says (a review, r12: it said "final lr"): step s
    applies the rate at count s - 1, so a warmup's first step applies 0, the peak comes at
    count warmup_steps, and the decay reaches lr * end_lr_frac at count train.steps, one past
    the last step's. Recorded runs trained so: kept, not shifted."""
    from hpnlp.train.state import learning_rate_schedule
    frac = 0.1 if schedule != "constant" else TrainConfig.end_lr_frac  # (constant: unread)
    f = learning_rate_schedule(TrainConfig(steps=10, warmup_steps=3, lr=1.0, end_lr_frac=frac,
                                           schedule=schedule))
    assert float(f(0)) == 0.0 and float(f(3)) == 1.0
    if schedule == "constant":
        assert float(f(9)) == float(f(10)) == 1.0
    else:  # the last step (count 9) applies more than the end
        np.testing.assert_allclose(float(f(10)), 0.1, rtol=1e-6)
        assert float(f(9)) > 0.1 + 1e-3
    # two steps, warmup 1: the rates applied are 0 and lr, the end comes after them
    two = learning_rate_schedule(TrainConfig(steps=2, warmup_steps=1, lr=1.0, end_lr_frac=frac,
                                             schedule=schedule))
    assert [float(two(c)) for c in (0, 1)] == [0.0, 1.0]


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


def test_clipping_and_grad_norm_leave_clustered_attentions_kmeans_step_out():
    """A review (session 109; tools/grad_norm_parts.py): `clustered` attention's centroids
    receive a k-means step through their backward, 95-100% of the global gradient norm, so
    clipping scaled every other gradient by 1/8 to 1/21 (the byte LM) or 7.3e-4 (the LRA
    ListOps classifier), and grad_norm logged the k-means term. Clipping now reads and
    scales the other leaves only, with optax's own state (saved runs' optimizer states read
    as before)."""
    import optax

    from hpnlp.train.state import clip_by_global_norm, clipped_part
    t = TrainConfig(lr=1.0, warmup_steps=0, steps=10, weight_decay=0.0, clip_norm=1.0)
    params = {"attn": {"centroids": jnp.zeros((2, 3)), "kernel": jnp.zeros((3, 3))}}
    state = make_optimizer(t, params).init(params)
    assert state[0] == optax.clip_by_global_norm(1.0).init(params)  # optax's EmptyState
    clip = clip_by_global_norm(1.0)
    grads = {"attn": {"centroids": jnp.full((2, 3), 100.0), "kernel": jnp.full((3, 3), 0.1)}}
    out, _ = clip.update(grads, clip.init(params))  # the rest's norm 0.3: no clip
    np.testing.assert_array_equal(out["attn"]["kernel"], grads["attn"]["kernel"])
    np.testing.assert_array_equal(out["attn"]["centroids"], grads["attn"]["centroids"])
    big = {"attn": {"centroids": grads["attn"]["centroids"], "kernel": jnp.full((3, 3), 2.0)}}
    out, _ = clip.update(big, clip.init(params))
    np.testing.assert_allclose(optax.tree.norm(out["attn"]["kernel"]), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(out["attn"]["centroids"], big["attn"]["centroids"])
    assert float(optax.tree.norm(clipped_part(grads))) == pytest.approx(0.3, rel=1e-6)


def test_the_steps_grad_norm_and_clip_leave_the_centroids_out():
    """The train step's logged grad_norm is the norm clipping reads (session 109, d3: no test
    pinned it): a toy with a `centroids` parameter of gradient 300 and a `kernel` of
    gradient 0.4 logs 0.4, and the kernel's step is not scaled down by the centroids'."""
    import flax.linen as nn
    import optax

    from hpnlp.train.state import clip_by_global_norm, init_state
    from hpnlp.train.step import make_train_step

    class Toy(nn.Module):
        @nn.compact
        def __call__(self, batch):
            c = self.param("centroids", nn.initializers.zeros, ())
            w = self.param("kernel", nn.initializers.zeros, ())
            return {"loss": jnp.sum(batch["x"]) * (300.0 * c + 0.4 * w),
                    "weight": jnp.float32(batch["x"].size)}

    t = TrainConfig(lr=1.0, warmup_steps=0, steps=2, weight_decay=0.0, clip_norm=1.0)
    batch = {"x": jnp.ones((2, 3), jnp.float32)}
    tx = optax.chain(clip_by_global_norm(1.0), optax.sgd(1.0))
    state = init_state(Toy(), tx, jax.random.key(0), batch)
    state, m = jax.jit(make_train_step(Toy(), tx, t))(state, batch)
    assert float(m["grad_norm"]) == pytest.approx(0.4, rel=1e-6)
    np.testing.assert_allclose(state.params["kernel"], -0.4, rtol=1e-6)  # unclipped
    np.testing.assert_allclose(state.params["centroids"], -300.0, rtol=1e-6)
