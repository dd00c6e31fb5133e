"""hpnlp.compress: formats, STE, calibration, packing, QAT through the config, PTQ end to end."""

import dataclasses
import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp.compress import calibrate, formats, packing, ptq
from hpnlp.compress.qlinear import Factored, QWeight, pack_weight, parse_spec
from hpnlp.config import ConfigError, QuantConfig, default_configdict, from_configdict, validate

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "pow2"])
def test_quantize_dequantize_error_within_half_a_step(fmt):
    x = jnp.asarray(RNG.standard_normal((13, 6)), jnp.float32)
    f = formats.get(fmt)
    codes, scale = f.encode(x, (0,))
    err = jnp.abs(f.decode(codes, scale) - x)
    if fmt in ("int8", "int4"):
        assert float(jnp.max(err / scale)) <= 0.5 + 1e-5  # half a step of the uniform grid
        assert int(jnp.max(jnp.abs(codes))) <= f.qmax
    elif fmt == "fp8":  # e4m3: 3 mantissa bits, half an ulp relative (normal range)
        rel = err / jnp.maximum(jnp.abs(x), 1e-3)
        assert float(jnp.max(jnp.where(jnp.abs(x / scale) > 2 ** -6, rel, 0.0))) <= 2 ** -4 + 1e-6
    else:  # powers of two: geometric rounding is within a factor sqrt(2) of the value
        x_hat = f.decode(codes, scale)
        big = jnp.abs(x) > scale * 2.0 ** (-f.kmax)
        ratio = jnp.where(big, jnp.abs(x_hat) / jnp.abs(x), 1.0)
        assert float(jnp.max(ratio)) <= 2 ** 0.5 + 1e-5 and float(jnp.min(ratio)) >= 2 ** -0.5 - 1e-5
        u = jnp.abs(x_hat) / scale  # every nonzero value a power of two
        np.testing.assert_allclose(u, jnp.where(codes != 0, 2.0 ** jnp.round(jnp.log2(u)), 0.0),
                                   rtol=1e-6)


def test_pow2_zeroes_below_the_log_domain_midpoint_under_the_smallest_level():
    """pow2 rounds k in the log domain, so a value turns 0 below 2^-0.5 (~0.71) of the
    smallest level, not below half of it, as the module doc said (a bug hunt (session 103):
    the words changed, not the rule QAT runs were trained by)."""
    low = 2.0 ** -formats.get("pow2").kmax  # the smallest level, under a range of 1
    u = np.float32([1.0, 0.6, 0.7, 0.72, 0.75, -0.75])
    got = jax.jit(formats.quantize_dequantize, static_argnums=(1, 2))(
        jnp.asarray(u * np.float32([1.0] + [low] * 5)), "pow2", (0,))
    np.testing.assert_array_equal(got, np.float32([1.0, 0.0, 0.0, low, low, -low]))


def test_int4_groups_have_their_own_scales():
    x = jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32).at[:4].multiply(100.0)
    codes, scale = formats.get("int4").encode(x, (0,), group=4)
    assert scale.shape == (2, 1, 3)
    np.testing.assert_allclose(scale[:, 0], formats.absmax(x, (0,), 4)[:, 0] / 7, rtol=1e-6)
    with pytest.raises(ValueError, match="does not divide"):
        formats.get("int4").encode(x, (0,), group=3)


def test_binary_and_ternary_scales_are_the_papers():
    w = jnp.asarray(RNG.standard_normal((32, 4)), jnp.float32)
    codes, a = formats.get("binary").encode(w, (0,))
    np.testing.assert_allclose(a[0], jnp.mean(jnp.abs(w), axis=0), rtol=1e-6)  # XNOR-Net alpha
    assert set(np.unique(codes)) <= {-1, 1}
    codes, s = formats.get("ternary").encode(w, (0,))
    t = 0.7 * jnp.mean(jnp.abs(w), axis=0, keepdims=True)
    np.testing.assert_array_equal(codes != 0, jnp.abs(w) > t)
    keep = jnp.abs(w) > t
    np.testing.assert_allclose(s[0], jnp.sum(jnp.abs(w) * keep, 0) / jnp.sum(keep, 0), rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "binary", "ternary"])
def test_ste_identity_inside_range_zero_outside(fmt):
    x = jnp.asarray([-3.0, -0.5, 0.2, 0.9, 2.5])
    rng = jnp.asarray(1.0)
    g = jax.grad(lambda v: jnp.sum(formats.fake_quant(v, fmt, (0,), rng=rng) * jnp.arange(5.0)))(x)
    inside = jnp.abs(x) <= 1.0
    want = jnp.where(inside, jnp.arange(5.0), 0.0) if formats.get(fmt).uses_range else jnp.arange(5.0)
    np.testing.assert_array_equal(g, want)
    # absmax ranges clip nothing: the gradient is the identity everywhere
    g = jax.grad(lambda v: jnp.sum(formats.fake_quant(v, fmt, (0,))))(x)
    np.testing.assert_array_equal(g, jnp.ones(5))


@pytest.mark.parametrize("k", [1, 7, 8, 13])
def test_packed_int4_and_binary_round_trip(k):
    q = RNG.integers(-8, 8, (k, 5)).astype(np.int8)
    assert packing.pack_int4(q).shape == ((k + 1) // 2, 5)
    np.testing.assert_array_equal(packing.unpack_int4(packing.pack_int4(q), k), q)
    np.testing.assert_array_equal(np.asarray(packing.unpack_int4(packing.pack_int4(jnp.asarray(q)), k)), q)
    s = RNG.standard_normal((3, k))
    b = packing.pack_bits(s, axis=1)
    assert b.shape == (3, (k + 7) // 8)
    np.testing.assert_array_equal(packing.unpack_bits(b, k, axis=1), np.where(s > 0, 1, -1))


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 4), ("binary", 0), ("ternary", 0),
                                       ("pow2", 0), ("fp8", 0)])
def test_packed_weight_decodes_to_the_fake_quantized_weight(fmt, group):
    from hpnlp.compress.qlinear import quant_weight
    w = jnp.asarray(RNG.standard_normal((12, 2, 3)), jnp.float32)  # contraction first, N = 6
    q = QuantConfig(weights=fmt, group_size=group)
    packed = pack_weight(w, q, 1)
    np.testing.assert_allclose(packed.dequantize(), quant_weight(w, 1, q), rtol=1e-6, atol=1e-7)
    bits = {"int4": 4, "binary": 1}.get(fmt, 8)
    assert packed.codes.size * packed.codes.dtype.itemsize == -(-12 * bits // 8) * 6


def test_calibration_methods():
    x = jnp.asarray(np.concatenate([RNG.standard_normal(4000), [60.0]]), jnp.float32)
    amax = calibrate.choose_range(x, "int8", (0,), "absmax")
    pct = calibrate.choose_range(x, "int8", (0,), "percentile", percentile=99.9)
    mse = calibrate.choose_range(x, "int4", (0,), "mse")
    assert float(amax[0]) == 60.0 and float(pct[0]) < 5.0 and float(mse[0]) < 60.0
    # deterministic: the same data gives the same range
    assert float(calibrate.choose_range(x, "int4", (0,), "mse")[0]) == float(mse[0])
    with pytest.raises(ValueError, match="unknown calibration"):
        calibrate.choose_range(x, "int8", (0,), "kl")
    # a review (session 114): these were taken (an axis past ndim wrapped onto another, any
    # method averaged) or failed inside a reshape naming nothing
    w = jnp.ones((8, 4))
    for call, match in (
            (lambda: calibrate.choose_range(x, "int8", (0,), "percentile", percentile=150),
             r"percentile=150: give a percentage in \(0, 100\]"),
            (lambda: calibrate.combine(w, "kl"), "unknown calibration method 'kl'"),
            (lambda: formats.fake_quant(w, "int8", axes=(-3,)),
             r"axes \(-3,\) are not axes of a 2-D array"),
            (lambda: formats.fake_quant(w, "int8", axes=(0, -2)), r"name an axis twice"),
            (lambda: formats.fake_quant(w, "int4", axes=(0,), group=-4),
             r"group size -4: give a whole number >= 0"),
            (lambda: formats.fake_quant(w, "int4", axes=(0,), group=4.0),
             r"group size 4\.0: give a whole number >= 0")):
        with pytest.raises(ValueError, match=match):
            call()


def test_zero_ranges_nan_and_bfloat16_found_in_review():
    """A range of 0 (a calibrated or all-zero channel) quantizes to 0, where it had passed
    values through rounded to whole numbers; binary's all-zero column decodes to 0, not -1s;
    a mostly-zero column's percentile range falls back to its absmax (it clipped the
    nonzeros to 0); NaN passes a static range as it passes a dynamic one; bfloat16 weights'
    fake quantization is the quantized value itself; a product run twice a batch (a dual
    encoder's trunk) records the wider of its calls' ranges, not the last; a channel of
    tiny nonzeros (<= TINY) decodes to 0 in every format (a review, r7: ternary's scale fell
    back to 1, decoding 1e-31s to 1s)."""
    x = jnp.asarray([[0.3], [0.7], [2.6], [-40.2], [300.0]], jnp.float32)
    w = RNG.standard_normal((8, 3)).astype(np.float32)
    w[:, 1] = 0.0
    sparse = np.zeros((64, 1), np.float32)
    sparse[[3, 40], 0] = [0.9, -2.6]
    nan = jnp.asarray([[0.3, np.nan, 5.7, -2.2]], jnp.float32)
    wb = jnp.asarray(RNG.standard_normal((32, 4)), jnp.bfloat16)

    @jax.jit  # one compile for all of it, not one per eager op
    def run(x, w, sparse, nan, wb):
        zero = jnp.zeros((1, 1))
        tiny = jnp.full((8, 1), 1e-31, jnp.float32)
        return {"zero_range": {f: formats.quantize_dequantize(x, f, (0,), rng=zero)
                               for f in ("int8", "int4", "fp8", "pow2")},
                "tiny": {f: formats.quantize_dequantize(tiny, f, (0,)) for f in formats.FORMATS},
                "zero_column": {f: formats.fake_quant(w, f, (0,))[:, 1]
                                for f in ("binary", "ternary", "int8")},
                "percentile": calibrate.choose_range(sparse, "int8", (0,), "percentile",
                                                     percentile=95),
                "nan": formats.fake_quant(nan, "int8", (1,), rng=jnp.asarray([[4.0]])),
                "bf16": {f: (formats.fake_quant(wb, f, (0,)).astype(jnp.float32),
                             formats.quantize_dequantize(wb, f, (0,)).astype(jnp.float32))
                         for f in ("binary", "ternary", "int8")}}
    got = jax.tree.map(np.asarray, run(x, jnp.asarray(w), jnp.asarray(sparse), nan, wb))
    for fmt, v in {**got["zero_range"], **got["zero_column"]}.items():
        np.testing.assert_array_equal(v, 0.0, err_msg=fmt)
    for fmt, v in got["tiny"].items():
        assert np.all(np.abs(v) <= 1e-30), (fmt, v)
    assert float(got["percentile"][0, 0]) == pytest.approx(2.6)
    assert np.isnan(got["nan"][0, 1]) and np.isfinite(np.delete(got["nan"], 1)).all()
    for fmt, (fq, qdq) in got["bf16"].items():
        np.testing.assert_array_equal(fq, qdq, err_msg=fmt)
    import flax.linen as nn

    from hpnlp.compress import qlinear

    class Product(nn.Module):
        @nn.compact
        def __call__(self, x):
            return qlinear.quant_act(self, "x", x, (1,), QuantConfig(activations="int8",
                                                                     act_scale="static"))

    class Twice(nn.Module):  # one product (a shared trunk's) run on two inputs
        @nn.compact
        def __call__(self, a, b):
            p = Product()
            return p(a), p(b)
    calib = jax.jit(lambda a, b: Twice().apply({}, a, b, mutable=["calib"])[1]["calib"])
    a, b = jnp.full((2, 3), 5.0), jnp.full((2, 3), 2.0)
    for first, second in ((a, b), (b, a)):
        assert float(calib(first, second)["Product_0"]["x"]) == 5.0


def test_non_finite_values_decode_to_nan_and_fake_quant_is_quantize_dequantize():
    """A bug hunt (session 99). A NaN or an inf in the values one scale covers decodes them
    all to NaN in every format, as in float (a NaN had scale 0 and codes 0: silently 0, and
    an int8 KV cache's attention finite where the float cache's is NaN; an inf zeroed a
    ternary row), also at [141, 70], where XLA:CPU's max drops a NaN. fake_quant's forward
    is quantize_dequantize exactly, in float32 too (x + sg(x_hat - x) gave a binary column
    three magnitudes), with the gradient still the identity."""
    from hpnlp.attention.cache_cpu import cached_attention, quantize_kv
    bad = np.ones((141, 70), np.float32)
    bad[1, 5], bad[3, 0], bad[5, 69] = np.nan, np.inf, -np.inf  # rows 1, 3, 5 turn NaN
    w = jnp.asarray(np.random.default_rng(4).standard_normal((64, 6)), jnp.float32)
    rng = 0.5 * formats.absmax(w, (0,))  # a calibrated range that clips
    kv = jnp.asarray(RNG.standard_normal((2, 1, 4, 1, 3)), jnp.float32)  # k, v [1, 4, 1, 3]
    kv = kv.at[0, 0, 1, 0, 0].set(np.nan)  # a NaN in key position 1
    q = jnp.ones((1, 1, 2, 3), jnp.float32)
    cot = jnp.arange(6.0)[None]

    @jax.jit
    def run(bad, w, kv):
        qdq = {f: formats.quantize_dequantize(bad, f, (1,)) for f in formats.FORMATS}
        fq = {f"{f} {jnp.dtype(dt).name} range={r is not None}": (
            formats.fake_quant(w.astype(dt), f, (0,), rng=r),
            formats.quantize_dequantize(w.astype(dt), f, (0,), rng=r))
            for f in formats.FORMATS for dt in (jnp.float32, jnp.bfloat16) for r in (None, rng)}
        grad = {f: jax.grad(lambda v: jnp.sum(formats.fake_quant(v, f, (0,)) * cot))(w)
                for f in formats.FORMATS}
        (ck, sk), (cv, sv) = quantize_kv(kv[0]), quantize_kv(kv[1])
        att = [cached_attention(q, ck, cv, 3, scales=(sk, sv), impl=i) for i in ("auto", "xla")]
        return qdq, fq, grad, (ck[0, 1, 0], sk[0, 1, 0]), att

    qdq, fq, grad, (codes, scale), att = run(bad, w, kv)
    nan_rows = np.isin(np.arange(141), [1, 3, 5])[:, None]
    for fmt, y in qdq.items():
        np.testing.assert_array_equal(np.isnan(y), np.broadcast_to(nan_rows, y.shape), fmt)
    for key, (a, b) in fq.items():
        np.testing.assert_array_equal(a, b, err_msg=key)
        assert a.dtype == b.dtype, key
    for fmt, g in grad.items():
        np.testing.assert_array_equal(g, np.broadcast_to(cot, g.shape), fmt)
    assert np.isnan(scale) and (np.asarray(codes) == 0).all()
    for y in att:
        assert np.isnan(y).all()


def test_spec_order_rule():
    assert parse_spec("ble,ekhd->blkhd") == ((-1,), (0,))
    assert parse_spec("blhd,hde->ble") == ((-2, -1), (0, 1))
    with pytest.raises(ValueError, match="x_free"):
        parse_spec("bhd,ehd->be")  # contraction not leading in w



@pytest.mark.parametrize("spec,x_shape,w_shape,bias,dtype,pet", [
    ("...k,kn->...n", (3, 5, 7), (7, 11), True, jnp.float32, None),  # Dense
    ("ble,ekhd->blkhd", (2, 5, 6), (6, 3, 2, 4), False, jnp.float32, None),  # qkv
    ("blhd,hde->ble", (2, 5, 3, 4), (3, 4, 9), False, jnp.float32, None),  # out
    ("...k,kn->...n", (13, 7), (7, 5), True, jnp.bfloat16, jnp.float32),
])
def test_float_product_and_its_gradients_equal_autodiff_of_the_einsum(spec, x_shape, w_shape,
                                                                      bias, dtype, pet):
    """qeinsum's float product differentiates itself (float_product: dW = x^T g and
    db = 1^T g as products): values and all three gradients as autodiff of the einsum."""
    from hpnlp.compress.qlinear import float_product
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], x_shape, dtype)
    w = jax.random.normal(k[1], w_shape, dtype)
    b = jax.random.normal(k[2], (w_shape[-1],), dtype) if bias else None
    n = len(parse_spec(spec)[0])
    cot = jax.random.normal(k[3], jnp.einsum(spec, x, w).shape, jnp.float32)

    def ref(x, w, b):
        y = jnp.einsum(spec, x, w, preferred_element_type=pet)
        return y if b is None else y + b.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))

    def loss(f):
        return lambda x, w, b: jnp.sum(f(x, w, b).astype(jnp.float32) * cot)
    mine = lambda x, w, b: float_product(x, w, b, n, pet)  # noqa: E731
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    y, y_ref = mine(x, w, b), ref(x, w, b)
    assert y.dtype == y_ref.dtype
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=tol, atol=tol)
    args = (0, 1, 2) if bias else (0, 1)
    got = jax.grad(loss(mine), args)(x, w, b)
    want = jax.grad(loss(ref), args)(x, w, b)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_allclose(np.float32(g), np.float32(r), rtol=tol, atol=tol * 10)

def _cfg(arch="transformer", **quant):
    cd = default_configdict()
    cd.data.task = "byte_lm"
    cd.model.kind = "lm"
    cd.model.arch = arch
    for k, v in quant.items():
        setattr(cd.quant, k, v)
    return from_configdict(cd)


@pytest.mark.parametrize("quant,field", [
    ({"weights": "int3"}, "quant.weights"),
    ({"weights": "int8", "activations": "binary"}, "quant.activations"),
    ({"weights": "int4", "group_size": 48}, "quant.group_size"),
    ({"weights": "int8", "group_size": 32}, "quant.group_size"),
    ({"weights": "int8", "layers": "qkv,ffn"}, "quant.layers"),
    ({"weights": "int8", "calibration": "kl"}, "quant.calibration"),
    ({"weights": "int8", "arch": "transformer_xl"}, "quant.weights"),
])
def test_bad_quant_config_names_the_field(quant, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        validate(_cfg(**quant), num_devices=1)


def test_int4_groups_must_divide_only_the_contractions_quantized():
    """A review: quant.group_size was checked against model.width, model.mlp_dim and the
    heads for every arch and quant.layers, so an LSTM (no MLP, no heads) was refused on
    model.mlp_dim, a Transformer whose MLP stays float on it too. Each quantized product's
    contraction is still checked, by name."""
    def cfg(model, kind="lm", task="byte_lm", **quant):
        cd = default_configdict()
        cd.data.task, cd.model.kind = task, kind
        cd.model.update(model)
        cd.quant.update(weights="int4", **quant)
        return from_configdict(cd)

    lstm, heads = dict(arch="lstm", width=96), dict(width=96, num_heads=2, mlp_dim=100)
    dual = dict(width=12, num_heads=2, mlp_dim=64)
    for model, kind, task, quant in (
            (lstm, "lm", "byte_lm", dict(group_size=48)),  # input, recurrent, output: 96
            (dict(arch="gru", width=90), "lm", "byte_lm", dict(group_size=30)),  # no heads (4 x 22)
            (heads, "lm", "byte_lm", dict(group_size=48, layers="qkv,out")),  # mlp_dim float
            (dual, "dual_encoder", "doc_match", dict(group_size=16, layers="head"))):  # 48, 64
        validate(cfg(model, kind, task, **quant), num_devices=1)
    for model, kind, task, quant, want in (
            (lstm, "lm", "byte_lm", dict(group_size=64), "model.width=96"),
            (lstm, "lm", "byte_lm", dict(group_size=64, layers="recurrent"), "model.width=96"),
            (heads, "lm", "byte_lm", dict(group_size=48, layers="qkv,mlp"), "model.mlp_dim=100"),
            (dict(heads, head_dim=40), "lm", "byte_lm", dict(group_size=48, layers="out"),
             r"model.num_heads \* head size=80"),
            (dict(dual, mlp_dim=40), "dual_encoder", "doc_match",
             dict(group_size=16, layers="head"), "model.mlp_dim=40"),
            (dict(dual, width=10), "dual_encoder", "doc_match", dict(group_size=16, layers="head"),
             r"the dual encoder head's input 4 \* model.width=40")):
        with pytest.raises(ConfigError, match=r"`quant.group_size` = \d+ .*must divide " + want):
            validate(cfg(model, kind, task, **quant), num_devices=1)


def test_quantizing_an_output_layer_of_its_own_tables_is_refused():
    """Found in review: quant.layers naming 'output' was ignored for these (float evals)."""
    cd = default_configdict()
    cd.data.task, cd.model.kind = "word_lm", "lm"  # frequency-sorted ids, as adaptive needs
    cd.quant.update(weights="int8", layers="qkv,output")
    for name in ("adaptive", "hierarchical", "binary_code"):
        cd.output.name = name
        with pytest.raises(ConfigError, match=rf"`quant.layers`.*{name!r} keeps its own tables"):
            validate(from_configdict(cd), num_devices=1)
    cd.quant.layers = "all"  # whichever products the model has: its tables stay float
    validate(from_configdict(cd), num_devices=1)


def test_output_arrays_the_token_counts_shape_are_left_out_of_a_folder_s_check():
    """Review (session 99): the adaptive softmax's default cutoffs come from the task's token
    counts, which ptq.load's model (its folder's config alone) does not have: a quantized
    word-level run's output tables were refused as damaged."""
    cd = default_configdict()
    cd.data.task, cd.model.kind, cd.output.name = "word_lm", "lm", "adaptive"
    assert ptq.counts_shaped(from_configdict(cd)) == "params/output/"
    cd.output.options = {"cutoffs": (20, 200)}
    assert ptq.counts_shaped(from_configdict(cd)) == ""
    got = {"params/a": (2, 3), "params/output/table/tail0_out": (8, 5)}
    want = {"params/a": (2, 3), "params/output/table/tail0_out": (9, 5),
            "params/output/table/tail1_out": (3, 5)}
    ptq.check_shapes("q.npz", "quant.json", got, want, free="params/output/")
    with pytest.raises(FileNotFoundError, match=r"q.npz has no array params/output/table/tail1"):
        ptq.check_shapes("q.npz", "quant.json", got, want)
    with pytest.raises(FileNotFoundError, match=r"holds params/a of shape \[2, 4\]"):
        ptq.check_shapes("q.npz", "quant.json", {**got, "params/a": (2, 4)}, want,
                         free="params/output/")


def test_class_based_classes_are_left_out_and_the_other_tree_layers_checked():
    """A bug hunt (session 100): class_based bins its classes by the task's counts (29 on the
    byte task, where Zipf over the ids gives 16), so `quantize` refused every class_based
    run's own folder as damaged. hierarchical and binary_code shapes follow V alone."""
    from hpnlp import softmax
    V, E = 40, 8
    counts = softmax.Frequencies.of(np.r_[np.arange(20.0, 0.0, -1.0), np.zeros(V - 20)], V)
    h, t = jnp.zeros((2, 3, E)), jnp.zeros((2, 3), jnp.int32)

    def shapes(name, counts):  # {npz key: shape} of the layer as the model's `output`
        import flax.linen as nn
        layer = softmax.get(name)(vocab_size=V, counts=counts)
        tree = jax.eval_shape(lambda: nn.unbox(layer.init(jax.random.key(0), h, t,
                                                          method="loss")))
        entries = ptq._entries({"output": tree["params"]}, {})[0]
        return {k: v.shape for k, v in entries.items()}
    cd = default_configdict()
    cd.data.task, cd.model.kind = "byte_lm", "lm"
    for name in ("class_based", "hierarchical", "binary_code"):
        cd.output.name = name
        free = ptq.counts_shaped(from_configdict(cd))
        got, want = shapes(name, counts), shapes(name, None)  # the task's, the folder's
        assert (got != want) == (name == "class_based") and free == (
            "params/output/classes/" if name == "class_based" else "")
        ptq.check_shapes("q.npz", "quant.json", got, want, free=free)


def test_weights_beyond_float16_s_range_are_named_before_the_export():
    """Review (session 99): `quantize --weights float16` cast a weight above 65504 to inf,
    and its own reload refused the folder as damaged ("quantize the run again")."""
    params = {"a": jnp.ones((2, 2)), "b": {"w": jnp.asarray([1.0, 7e4])},
              "i": jnp.arange(3)}
    assert ptq.beyond_range(params, jnp.float16) == ["['b']['w']"]
    assert ptq.beyond_range(params, jnp.bfloat16) == []


def test_float32_params_counts_four_bytes_a_parameter_whatever_the_stored_dtype():
    """A review: `float32_params` (quantize's and sparsify's summaries, and the ratio against
    it) was the bytes as stored, half of float32's for a model.param_dtype='bfloat16' run."""
    from hpnlp.compress.qlinear import float_bytes
    tree = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": {"w": np.ones(5, np.float16)},
            "c": jnp.ones((4,), jnp.float32)}
    assert float_bytes(tree) == 4 * (6 + 5 + 4)


def test_unknown_quant_field_and_config_round_trip():
    cd = default_configdict()
    cd.quant.weights = "int4"
    cd.quant.group_size = 32
    cfg = from_configdict(cd)
    assert cfg.quant == cfg.model.quant and cfg.quant.group_size == 32
    from hpnlp.config import to_json
    assert from_configdict(to_json(cfg)) == cfg
    with pytest.raises(ConfigError, match="quant.bits"):
        from_configdict({"quant": {"bits": 4}})


def _train(workdir, arch="transformer", steps=12, lowrank=None, init_from="", moe=None,
           attention=None, redraw_every=None, **quant):
    from hpnlp.train import run
    cd = default_configdict()
    if attention:  # attention.name and its options
        cd.attention.name = attention["name"]
        cd.attention.options = attention.get("options", {})
    if moe:  # model.moe's fields
        cd.model.moe.update(moe)
    if lowrank:  # model.lowrank's fields; train.init_from the run it factorizes
        cd.model.lowrank.update(lowrank)
        cd.train.init_from = init_from
    cd.data.task, cd.data.seq_len = "byte_lm", 32
    cd.data.batching = "pad" if attention else "pack"  # (performer: no packed rows)
    cd.model.update(kind="lm", arch=arch, width=32, depth=1, num_heads=2, mlp_dim=64, max_len=32,
                    dropout=0.0)
    cd.output.tie_embeddings = True
    cd.train.update(steps=steps, batch_size=8, warmup_steps=2, lr=3e-3, log_every=4, eval_every=0,
                    eval_batches=2, checkpoint_every=0, progress=False)
    if redraw_every is not None:
        cd.train.feature_redraw_every = redraw_every
    for k, v in quant.items():
        setattr(cd.quant, k, v)
    return run(cd, workdir)


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_qat_trains_with_float_shadow_weights(tmp_path):
    """QAT: the loss falls; the checkpoint holds float weights (the shadow) that are not
    themselves on the quantized grid; the summary's metric is the quantized model's."""
    summary = _train(str(tmp_path / "qat"), weights="int4", group_size=16, activations="int8")
    lines = [json.loads(x) for x in open(tmp_path / "qat" / "metrics.jsonl")]
    losses = [x["loss"] for x in lines if not x.get("eval")]
    assert losses[-1] < losses[0]
    assert np.isfinite(summary["eval"]["loss"])
    from hpnlp.train.checkpoint import Checkpointer
    cfg = ptq.load_run_config(str(tmp_path / "qat"))
    assert cfg.quant.weights == "int4"
    ck = Checkpointer(str(tmp_path / "qat"), cfg, keep=2)
    state = ck.manager.restore(ck.latest_step())["state"]
    ck.close()
    w = np.asarray(state["params"]["trunk"]["block_0"]["mlp_in"]["kernel"])
    assert w.dtype == np.float32 and len(np.unique(w)) > 16 * w.shape[1]
    # export at the end: the run's own quant settings, packed; config.json left as it was
    before = open(tmp_path / "qat" / "config.json").read()
    s = ptq.quantize(str(tmp_path / "qat"), str(tmp_path / "packed"), eval_batches=1, repeats=1)
    assert s["format"]["weights"] == "int4" and s["reload_identical"]
    assert open(tmp_path / "qat" / "config.json").read() == before
    cfg_q, params, _ = ptq.load(str(tmp_path / "packed"))
    kernel = params["trunk"]["block_0"]["mlp_in"]["kernel"]
    assert kernel.fmt == "int4" and kernel.codes.shape == (16, 64)  # K = 32 two per byte
    # --eval_batches counts the two evals alone (a review, session 118: it was written into
    # quant.json's config)
    assert cfg_q.train.eval_batches == cfg.train.eval_batches != 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("ptq") / "run")
    _train(workdir)
    return workdir


@pytest.mark.slow  # 9.8 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_ptq_end_to_end_and_reload(trained, tmp_path):
    out = str(tmp_path / "w8a8")
    q = QuantConfig(weights="int8", activations="int8", act_scale="static", calibration="percentile")
    s = ptq.quantize(trained, out, q, calib_batches=2, eval_batches=2, repeats=1)
    # a tiny model: float position table, norms and biases keep the ratio under 4
    assert s["reload_identical"] and s["size_bytes"]["ratio"] > 2.0
    assert abs(s["eval"]["loss_rel_increase"]) < 0.05
    cfg, params, quant_vars = ptq.load(out)
    assert isinstance(params["trunk"]["block_0"]["attention"]["qkv"], QWeight)
    assert quant_vars["trunk"]["block_0"]["attention"]["qkv"].shape == ()
    # calibration is deterministic: a second run writes the same ranges and codes
    s2 = ptq.quantize(trained, str(tmp_path / "again"), q, calib_batches=2, eval_batches=2, repeats=1)
    a, b = np.load(os.path.join(out, "quantized.npz")), np.load(str(tmp_path / "again" / "quantized.npz"))
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
    assert s2["eval"]["quantized"] == s["eval"]["quantized"]
    # a quantized checkpoint loaded as a different model is refused by name
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, width=64))
    with pytest.raises(ConfigError, match="model.width"):
        ptq.load(out, other)


def _packed_folder(out, lowrank=None):
    """A quantized folder of a tiny LM (int4 weights, static int8 activations; model.lowrank's
    fields) packed by hand at the shapes `ptq.model_entries` traces: nothing trains or
    compiles. Its arrays."""
    import flax.traverse_util as traverse
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=16)
    cd.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, max_len=16)
    cd.quant.update(weights="int4", activations="int8", act_scale="static")
    cd.model.lowrank.update(lowrank or {})
    cfg = validate(from_configdict(cd))
    flat = {}
    entries, factored, lead = ptq.model_entries(cfg)
    for key, leaf in entries.items():
        if isinstance(leaf, QWeight):
            leaf = leaf.replace(codes=np.zeros(leaf.codes.shape, leaf.codes.dtype),
                                scale=np.ones(leaf.scale.shape, np.float32))
        else:
            leaf = np.abs(RNG.standard_normal(leaf.shape)).astype(leaf.dtype)
        flat[tuple(key.split("/"))] = leaf
    for key in factored:
        path = tuple(key.split("/"))
        flat[path] = Factored(flat.pop(path + ("u",)), flat.pop(path + ("v",)), lead.get(key, 0))
    tree = traverse.unflatten_dict(flat)
    ptq.save(out, cfg, tree["params"], tree["quant"], {})
    return dict(np.load(os.path.join(out, "quantized.npz")))


def _damaged_copies(tmp_path, good, load, error):
    """`damaged(name, change, match)`: a copy of the folder `good`, changed by `change(out)`,
    refused by `load(out)` with an `error` matching `match`; `rewrite(npz, **arrays)` and
    `edit(json, change)` make such changes."""
    def damaged(name, change, match):
        out = str(tmp_path / name)
        shutil.copytree(good, out)
        change(out)
        with pytest.raises(error, match=match):
            load(out)

    def rewrite(npz, **arrays):
        return lambda out: np.savez(os.path.join(out, npz), **arrays)

    def edit(name, change):
        def go(out):
            with open(os.path.join(out, name)) as f:
                manifest = json.load(f)
            change(manifest)
            with open(os.path.join(out, name), "w") as f:
                json.dump(manifest, f)
        return go
    return damaged, rewrite, edit


def test_ptq_load_names_a_damaged_quantized_folder(tmp_path):
    """A bug hunt (session 96): a cut quant.json or quantized.npz, an array taken out of it or
    sliced, was a traceback (or a JAX TypeError deep in the forward); each is one line naming
    the file and saying to quantize again."""
    good = str(tmp_path / "good")
    stored = _packed_folder(good)
    kernel = "params/trunk/block_0/mlp_in/kernel"
    assert ptq.load(good)[1]["trunk"]["block_0"]["mlp_in"]["kernel"].codes.shape == (8, 32)
    damaged, rewrite, _ = _damaged_copies(tmp_path, good, ptq.load, ptq.NoCheckpoint)
    damaged("cut", lambda out: os.truncate(os.path.join(out, "quantized.npz"), 100),
            r"quantized.npz cannot be read \(BadZipFile.*quantize the run again")
    damaged("json", lambda out: os.truncate(os.path.join(out, "quant.json"), 50),
            r"quant.json cannot be read \(.*quantize the run again")
    less = {k: v for k, v in stored.items() if k != kernel + "/codes"}
    damaged("missing", rewrite("quantized.npz", **less),
            rf"quantized.npz has no array {kernel}/codes")
    sliced = {**stored, kernel + "/codes": stored[kernel + "/codes"][:, :3]}
    damaged("sliced", rewrite("quantized.npz", **sliced), r"codes as uint8 \[8, 3\], where its "
            r"int4 weight of shape \[16, 32\] stores uint8 \[\.\.\., 8, 32\]")
    cast = {**stored, kernel + "/scale": stored[kernel + "/scale"].astype(np.int8)}
    damaged("dtype", rewrite("quantized.npz", **cast), rf"{kernel}/scale as int8 \[1, 32\]")


def test_ptq_load_checks_its_arrays_against_the_model_and_refuses_non_finite_values(tmp_path):
    """A bug hunt (session 99): a plain array of another shape or taken out, or the model
    edited in quant.json (width, num_heads), failed in flax (ScopeParamShapeError, "query and
    key disagree") naming neither file; a NaN or an infinity (a weight, a packed weight's
    scale, a calibrated range) was served, generate printing NUL bytes. Each is one line
    naming the file, against the shapes of the model its config describes (traced)."""
    good = str(tmp_path / "good")
    stored = _packed_folder(good)
    damaged, rewrite, edit = _damaged_copies(tmp_path, good, ptq.load, ptq.NoCheckpoint)
    norm = "params/trunk/final_norm/scale"
    again = r"; it is not a file `quantize` wrote: quantize the run again"
    damaged("shape", rewrite("quantized.npz", **{**stored, norm: np.ones(8, np.float32)}),
            rf"quantized.npz holds {norm} of shape \[8\], where the model of the config in "
            rf"\S+quant.json has \[16\]{again}")
    less = {k: v for k, v in stored.items() if k != "params/trunk/pos_embedding"}
    damaged("gone", rewrite("quantized.npz", **less), r"quantized.npz has no array "
            r"params/trunk/pos_embedding, which the model of the config in \S+quant.json has")
    damaged("more", rewrite("quantized.npz", **stored, **{"params/trunk/x": np.ones(2)}),
            r"holds an array params/trunk/x, which the model .* has no place for")
    damaged("width", edit("quant.json", lambda m: m["config"]["model"].update(width=32)),
            r"quantized.npz holds params/\S+ of shape \[.*\], where the model of the config in "
            r"\S+quant.json has \[.*32.*\]")
    damaged("heads", edit("quant.json", lambda m: m["config"]["model"].update(num_heads=4)),
            r"quant.json gives params/trunk/block_0/attention/\w+ the layout int4 \[.*\] "
            r"\(k_dims \d\), where the model of its config packs it as int4 \[.*4.*\]")
    # a config that validate refuses (a review, session 115: failed in the model's trace,
    # naming no file)
    damaged("format", edit("quant.json", lambda m: m["config"]["model"]["quant"].update(
        weights="int3")), r"quant.json holds a config this hpnlp refuses \(.*int3.*\); it is "
        r"not a file `quantize` wrote")
    nan = "a NaN or an infinity"
    for name, key in (("nan", norm), ("inf_scale", "params/trunk/block_0/mlp_in/kernel/scale"),
                      ("nan_range", "quant/trunk/block_0/mlp_in/kernel")):
        bad = stored[key].copy()
        bad.flat[0] = np.nan if "nan" in name else np.inf
        damaged(name, rewrite("quantized.npz", **{**stored, key: bad}),
                rf"quantized.npz holds non-finite values \({nan}\) in {key}{again}")
    # model.lowrank's factors: quant.json's list of them (each read as a Factored of two)
    _packed_folder(str(tmp_path / "lowrank"), lowrank=dict(rank=4, layers="mlp"))
    assert isinstance(ptq.load(str(tmp_path / "lowrank"))[1]["trunk"]["block_0"]["mlp_in"]
                      ["kernel"], Factored)
    damaged, _, edit = _damaged_copies(tmp_path, str(tmp_path / "lowrank"), ptq.load,
                                       ptq.NoCheckpoint)
    damaged("unlisted", edit("quant.json", lambda m: m["factored"].pop(0)),
            r"quant.json does not list params/trunk/block_0/\w+/kernel as factorized, which the "
            r"model of its config factorizes")


def test_a_student_that_lost_its_teacher_config_names_the_file(tmp_path):
    """A bug hunt (session 96): a distilled run with saved checkpoints, its teacher moved and
    WORKDIR/teacher_config.json gone, was told "no run in workdir TEACHER: train one there
    first"; the missing copy is named. (Nothing builds: the check comes first.)"""
    from hpnlp.compress.distill import TEACHER_CONFIG, TeacherCarry
    cd = default_configdict()
    cd.data.task = "byte_lm"
    cd.train.distill.teacher = str(tmp_path / "teach")  # moved away
    student = tmp_path / "stud"
    (student / "checkpoints" / "8").mkdir(parents=True)
    with pytest.raises(ptq.NoCheckpoint, match=rf"stud/{TEACHER_CONFIG} is missing: .*\(no run "
                       rf"in {tmp_path / 'teach'}\); restore .*{TEACHER_CONFIG}, or the teacher"):
        TeacherCarry(from_configdict(cd), workdir=str(student))
    with pytest.raises(ptq.NoCheckpoint, match="no run in workdir .*train one there first"):
        TeacherCarry(from_configdict(cd), workdir=str(tmp_path / "new"))  # nothing saved yet


# 11.1 s in the suite on the 2-core Zen 3 (2026-12-01 evening): CI's slow part runs it
@pytest.mark.slow
def test_ptq_keeps_the_runs_int8_kv_cache(trained, tmp_path):
    """A run with quant.kv_cache='int8': the quantized model decodes (and its float baseline
    evaluates) through that cache too, so the loss change is the weights' alone."""
    run = str(tmp_path / "run")
    shutil.copytree(trained, run)
    with open(os.path.join(run, "config.json")) as f:
        saved = json.load(f)
    saved["config"]["model"]["quant"]["kv_cache"] = "int8"
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(saved, f)
    out = str(tmp_path / "int8")
    s = ptq.quantize(run, out, QuantConfig(weights="int8"), eval_batches=1, repeats=1)
    assert ptq.load(out)[0].model.quant.kv_cache == "int8"
    assert s["reload_identical"]


def test_ptq_refuses_non_finite_weights_before_writing(trained, tmp_path, monkeypatch):
    # the formats code NaN as 0: the quantized model hid what the float one showed
    from hpnlp.train import carry
    real = carry.model_params

    def with_nan(params):
        p = real(params)
        return jax.tree_util.tree_map_with_path(
            lambda k, v: v.at[0].set(jnp.nan) if "mlp_in" in jax.tree_util.keystr(k) else v, p)
    monkeypatch.setattr(carry, "model_params", with_nan)
    with pytest.raises(ValueError, match=r"holds non-finite weights \(.*mlp_in.*\); quantize a run"):
        ptq.quantize(trained, str(tmp_path / "out"), QuantConfig(weights="int8"), repeats=1)
    assert not os.path.exists(tmp_path / "out")


# 4.2 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_ptq_of_an_lstm_packs_its_input_and_recurrent_products(tmp_path, capsys):
    """An LSTM LM's input projection (int8 weights, its inputs int8 per token) and
    recurrent matrix (int8 weights; the state h stays float) are packed, and the packed
    checkpoint reloads to the outputs it was evaluated with."""
    workdir = str(tmp_path / "lstm")
    _train(workdir, arch="lstm", steps=3)
    out = str(tmp_path / "q")
    s = ptq.quantize(workdir, out, QuantConfig(weights="int8", activations="int8",
                                               layers="input,recurrent"),
                     calib_batches=1, eval_batches=1, repeats=1)
    assert s["reload_identical"] and abs(s["eval"]["loss_rel_increase"]) < 0.05
    _, params, _ = ptq.load(out)
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QWeight))[0]
    packed = {str(path[-1].key): leaf for path, leaf in leaves if isinstance(leaf, QWeight)}
    assert set(packed) == {"input_kernel", "recurrent_kernel"}
    assert all(w.fmt == "int8" and w.codes.dtype == np.int8 for w in packed.values())
    # a rerun into the same --out stopped part-way keeps the earlier call's files, all of
    # them (a bug hunt, session 94: its new model sat beside the old summary.json)
    before = {f: open(os.path.join(out, f), "rb").read() for f in ptq.OUT_FILES}

    def stopped(*args, **kw):
        raise KeyboardInterrupt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ptq, "load", stopped)
        with pytest.raises(KeyboardInterrupt):
            ptq.quantize(workdir, out, QuantConfig(weights="int4"), eval_batches=1, repeats=1)
    assert sorted(os.listdir(out)) == sorted(ptq.OUT_FILES)
    assert {f: open(os.path.join(out, f), "rb").read() for f in ptq.OUT_FILES} == before
    assert f"holds this command's earlier output of {workdir}; the new one replaces it" in \
        capsys.readouterr().err
    # the output of another run is not replaced (a bug hunt, session 95: it was, unsaid)
    shutil.copytree(workdir, workdir + "_copy")
    with pytest.raises(ValueError, match=rf"--out {re.escape(out)} holds this command's output "
                       rf"of another run \({re.escape(workdir)}\); give a new folder"):
        ptq.quantize(workdir + "_copy", out, QuantConfig(weights="int4"), eval_batches=1)
    import importlib  # refused as the LSTM run itself is (a bug hunt, session 94)
    generate = importlib.import_module("hpnlp.models.generate")  # the module, not the function
    assert generate.main(["--workdir", out, "--prompt", "And"]) == 2
    assert (f"{out}: a quantized model.kind='lm', model.arch='lstm' model; generate decodes "
            "Transformer LMs") in capsys.readouterr().err
    half = tmp_path / "npz_alone"  # (a bug hunt, session 98: "no run in workdir ...: train one")
    half.mkdir()
    shutil.copy(os.path.join(out, "quantized.npz"), half)
    assert generate.main(["--workdir", str(half), "--prompt", "And"]) == 2
    assert (f"no quantized checkpoint in {half} (quant.json missing): make one with python -m "
            "hpnlp.compress quantize") in capsys.readouterr().err
    from hpnlp.train.checkpoint import NoCheckpoint, load_run_config
    with pytest.raises(NoCheckpoint, match=f"{half} holds a compressed copy \\(quantized.npz, "
                       "written by python -m hpnlp.compress quantize --out\\), not a run"):
        load_run_config(str(half))  # what the other tools read (review, session 98)


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_ptq_binary_packs_eight_per_byte_and_bf16_switch(trained, tmp_path):
    s = ptq.quantize(trained, str(tmp_path / "bin"), QuantConfig(weights="binary", layers="qkv,out,mlp"),
                     calib_batches=1, eval_batches=1, repeats=1)
    assert s["reload_identical"]
    _, params, _ = ptq.load(str(tmp_path / "bin"))
    qkv = params["trunk"]["block_0"]["attention"]["qkv"]
    assert qkv.codes.dtype == np.uint8 and qkv.codes.shape == (32 // 8, 3 * 32)
    assert not isinstance(params["embed"]["embedding"], QWeight)  # "output" not in layers
    s = ptq.quantize(trained, str(tmp_path / "bf16"), float_dtype="bfloat16", eval_batches=1,
                     repeats=1)
    assert s["size_bytes"]["ratio"] > 1.5 and abs(s["eval"]["loss_rel_increase"]) < 0.02


def test_cli_errors_are_one_line(trained, tmp_path, capsys):
    from hpnlp.compress.__main__ import main
    assert main(["quantize", "--workdir", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"), "--weights",
                 "int4", "--group_size", "48"]) == 1
    err = capsys.readouterr().err.strip()  # the flags named as given (a bug hunt, session 95)
    assert "`--group_size` = 48 is not allowed" in err and "\n" not in err
    assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"), "--weights",
                 "int5"]) == 1
    assert "`--weights`" in capsys.readouterr().err
    assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o")]) == 1
    assert "trained without quantization" in capsys.readouterr().err
    # found by a bug hunt: a format of none, and --layers that names no product of the
    # model, wrote a "quantized" folder of float weights
    assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"), "--weights",
                 "none"]) == 1
    assert "quantizes nothing" in capsys.readouterr().err
    from hpnlp.train import Trainer
    with pytest.MonkeyPatch.context() as m:  # refused before the float model's evaluation
        m.setattr(Trainer, "evaluate", lambda self, state: 1 / 0)
        assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"),
                     "--weights", "int8", "--layers", "head"]) == 1
    err = capsys.readouterr().err
    assert "`--layers` = 'head' is not allowed: names no product of this lm" in err
    # nor a QAT run's fix in its config.json, which this run is not (a review, session 115)
    assert "config.json" not in err and err.rstrip().endswith("(or 'all')")
    # a model with no products: nothing to quantize, said before its restore (a review,
    # session 115: told "--weights none", which this command refuses)
    from hpnlp.config import to_json
    bag = default_configdict()
    bag.model.update(kind="bi_encoder", arch="bag")
    bag.data.task = "verse_pairs"
    os.makedirs(tmp_path / "bag" / "checkpoints" / "1")
    with open(tmp_path / "bag" / "config.json", "w") as f:
        json.dump({"config": to_json(validate(from_configdict(bag)))}, f)
    assert main(["quantize", "--workdir", str(tmp_path / "bag"), "--out", str(tmp_path / "o"),
                 "--weights", "int8"]) == 1
    assert "has no matrix products to quantize (its bag of embeddings is a lookup); serve it " \
        "in float" in capsys.readouterr().err
    from hpnlp.compress.__main__ import as_flags  # a path holding a field's name is kept
    # a QAT run's config.json clause is this command's run's no more (a review, session 115)
    assert as_flags("add 'input' to quant.layers, or set quant.activations='none' (a run saved "
                    "with it trained with float activations: set that in its config.json)") == (
        "add 'input' to --layers, or set --activations none")
    assert as_flags("no run in sweep/quant.layers=mlp; use quant.act_scale='dynamic' (or leave "
                    "'mlp' out of quant.layers)") == ("no run in sweep/quant.layers=mlp; use "
                                                     "--act_scale dynamic (or leave 'mlp' out of "
                                                     "--layers)")
    assert not os.path.exists(tmp_path / "o")  # (a bug hunt, session 94: made empty)
    # a run's config without a checkpoint (never saved one): refused, nothing written
    os.makedirs(tmp_path / "unsaved")
    shutil.copy(os.path.join(trained, "config.json"), tmp_path / "unsaved")
    assert main(["quantize", "--workdir", str(tmp_path / "unsaved"), "--out",
                 str(tmp_path / "o"), "--weights", "int8"]) == 1
    err = capsys.readouterr().err.strip()
    assert "has no checkpoint" in err and "train (or resume)" in err and "\n" not in err
    assert not os.path.exists(tmp_path / "o" / "quantized.npz")
    # A key-value memory classifier: its memory lives in the train state, not in the file.
    shutil.copytree(trained, tmp_path / "mem")
    run_json = json.load(open(tmp_path / "mem" / "config.json"))
    run_json["config"]["model"]["memory"]["size"] = 16
    json.dump(run_json, open(tmp_path / "mem" / "config.json", "w"))
    assert main(["quantize", "--workdir", str(tmp_path / "mem"), "--out", str(tmp_path / "o"),
                 "--weights", "int8"]) == 1
    assert "`model.memory.size`" in capsys.readouterr().err
    # found by the crash hunt: nothing of a run written over (its summary.json was replaced),
    # settings a format ignores named, and a damaged config.json named
    before = open(os.path.join(trained, "summary.json")).read()
    for out, match in ((trained, "is the run it reads; give a new folder"),
                       (os.path.join(trained, "checkpoints", "9"), "inside the run's own folders"),
                       (str(tmp_path / "mem"), "holds a training run (checkpoints, config.json"),
                       (os.path.join(trained, "summary.json"), "is a file, not a folder")):
        assert main(["quantize", "--workdir", trained, "--out", out, "--weights", "int8"]) == 1
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err
    assert open(os.path.join(trained, "summary.json")).read() == before
    assert not os.path.exists(os.path.join(trained, "quant.json"))
    assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"), "--weights",
                 "bfloat16", "--activations", "int8"]) == 1
    assert "--activations set integer formats, and --weights bfloat16 takes none" in \
        capsys.readouterr().err
    for text, match in (("{", "is not valid JSON"), ("{}", 'has no "config" entry')):
        with open(tmp_path / "mem" / "config.json", "w") as f:
            f.write(text)
        assert main(["quantize", "--workdir", str(tmp_path / "mem"), "--out",
                     str(tmp_path / "o"), "--weights", "int8"]) == 1
        err = capsys.readouterr().err.strip()
        assert match in err and "config.json" in err and "\n" not in err, err


def test_generate_names_the_draft_tokens_that_leave_the_prompt_no_room(trained, capsys):
    """A bug hunt (session 102): with --draft and no --length, a prompt past the bound
    --draft-tokens sets was told "(--length 2)" and to shorten it; --draft-tokens 0 was
    refused as "draft_tokens=0". Each a line naming --draft-tokens, before any decoding.
    Review (session 102): --draft-tokens past max_len was "draft_tokens=32" too, 0 without
    --draft was first told to add --draft, and "shorten it" of several prompts named none."""
    import importlib
    generate = importlib.import_module("hpnlp.models.generate")  # the module, not the function
    base = ["--workdir", trained, "--prompt", "And", "--greedy", "--draft", trained]
    for extra, want in (
            (["--draft-tokens", "31"], "error: --draft-tokens 31 leaves room for prompts of at "
             "most 1 tokens (the smaller model.max_len=32, less --draft-tokens - 1, is 2 tokens "
             "in all); these have [3]; lower --draft-tokens (to 29 or fewer for these prompts), "
             "or shorten the prompts longer than 1 tokens"),
            (["--draft-tokens", "0"], "error: --draft-tokens 0: a round drafts at least one "
             "token; give 1 or more (default 4)"),
            (["--draft-tokens", "32"], "error: --draft-tokens 32 must be below the smaller "
             "model.max_len=32 of --workdir and --draft (a round writes its drafts past the "
             "prompt into both caches); give 1 to 31, fewer for longer prompts"),
            (["--prompt", "x" * 40], "error: --draft-tokens 4 (the default) leaves room for "
             "prompts of at most 28 tokens (the smaller model.max_len=32, less --draft-tokens "
             "- 1, is 29 tokens in all); these have [3, 40]; shorten the prompts longer than 28 "
             "tokens (with --draft-tokens 1 a prompt may have up to 31 tokens)")):
        assert generate.main(base + extra) == 2
        assert capsys.readouterr().err.strip() == want
    assert generate.main(base[:-2] + ["--draft-tokens", "0"]) == 2  # no --draft: the count
    assert capsys.readouterr().err.strip() == ("error: --draft-tokens 0: a round drafts at "
                                               "least one token; give 1 or more (default 4)")


def _qat_run_config(workdir, **quant):
    """A run's config.json and an (empty) checkpoint folder: enough for the CLI's checks."""
    from hpnlp.config import to_json
    cd = default_configdict()
    cd.quant.update(**quant)
    os.makedirs(os.path.join(workdir, "checkpoints", "1"))
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"config": to_json(from_configdict(cd))}, f)


@pytest.mark.parametrize("flags, match", [
    (["--weights", "int8", "--calib_batches", "4"],
     "--calib_batches calibrates static activation ranges, and --act_scale is dynamic"),
    (["--weights", "int8", "--activations", "int8", "--calib_batches", "4"], "--act_scale static"),
    (["--weights", "bfloat16", "--calib_batches", "4"], "--weights bfloat16 is a float cast"),
    (["--weights", "int8", "--percentile", "99.9"],
     "--percentile is used only with --calibration percentile (given absmax)"),
    (["--weights", "int8", "--calibration", "mse", "--percentile", "99.9"], "(given mse)"),
    (["--weights", "float16", "--percentile", "99.9"], "--percentile set integer formats"),
    (["--weights", "binary", "--calibration", "mse"], "--calibration mse: --weights binary takes"),
    (["--calib_batches", "4"], "has quant.act_scale='dynamic' (its export calibrates nothing)"),
    (["--percentile", "99.9"], "the QAT run's export keeps its own"),
    # a README walk: named as the config field `train.eval_batches`, not the flag
    (["--weights", "int8", "--eval_batches", "-1"], "--eval_batches -1: give a count"),
])
def test_cli_refuses_flags_the_format_ignores(tmp_path, capsys, flags, match):
    """--calib_batches, --percentile and --calibration where nothing would use them: one line
    naming the flag and what makes it apply, before anything is built or written."""
    from hpnlp.compress.__main__ import main
    _qat_run_config(str(tmp_path / "qat"), weights="int8")
    out = str(tmp_path / "o")
    assert main(["quantize", "--workdir", str(tmp_path / "qat"), "--out", out, *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err, err
    assert not os.path.exists(out)


@pytest.mark.parametrize("weights", [[], ["--weights", "int8", "--activations", "int8",
                                          "--act_scale", "static"]])
def test_cli_names_a_calib_batches_below_1_as_its_flag(tmp_path, capsys, weights):
    """Review r1: a QAT export of a run of static activation ranges (no --weights) with
    --calib_batches 0 was refused as the config field `calib_batches`, which no config has;
    the flag by its own name on either path, before the run's checkpoint is read."""
    from hpnlp.compress.__main__ import main
    _qat_run_config(str(tmp_path / "qat"), weights="int8", activations="int8",
                    act_scale="static")
    out = str(tmp_path / "o")
    assert main(["quantize", "--workdir", str(tmp_path / "qat"), "--out", out, *weights,
                 "--calib_batches", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("hpnlp.compress: error: --calib_batches 0: give a count of training "
                   "batches >= 1, or leave it out for 8"), err
    assert not os.path.exists(out)


def test_cli_sparsify_names_its_min_sparsity_flag(tmp_path, capsys):
    """A bug hunt (session 97): --min_sparsity 1.5 was refused as the config field
    `min_sparsity`, which no config has; now as the flag, before the run is read."""
    from hpnlp.compress.__main__ import main
    out = str(tmp_path / "o")
    assert main(["sparsify", "--workdir", str(tmp_path / "none"), "--out", out,
                 "--min_sparsity", "1.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert "error: --min_sparsity 1.5: give the share of zeros in [0, 1)" in err, err
    assert "\n" not in err and not os.path.exists(out)


def test_cli_integer_flags_without_weights_on_a_run_trained_without_quantization(tmp_path,
                                                                                 capsys):
    """A README walk: `--calibration percentil` alone, on a plain run, was answered as if the
    run were QAT ("the QAT run's export keeps its own")."""
    from hpnlp.compress.__main__ import main
    _qat_run_config(str(tmp_path / "plain"))
    assert main(["quantize", "--workdir", str(tmp_path / "plain"), "--out",
                 str(tmp_path / "o"), "--calibration", "percentil"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--calibration set integer formats, and the run in" in err and \
        "trained without quantization (not QAT)" in err and "\n" not in err, err
    assert not os.path.exists(tmp_path / "o")


QAT_MESH_CODE = r"""
import json, sys, tempfile
import jax, numpy as np
from hpnlp.config import default_configdict, from_configdict
from hpnlp.train import Trainer
from hpnlp.train.loop import _global

out = {}
for name, mesh in json.loads(sys.argv[1]).items():
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=64, depth=1, num_heads=4, mlp_dim=128, max_len=32, dropout=0.1)
    cd.quant.update(weights="int4", group_size=16, activations="int8")
    cd.train.update(steps=4, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, progress=False)
    cd.mesh.update(**mesh)
    tr = Trainer(from_configdict(cd), tempfile.mkdtemp())
    state, _ = tr.initial_state()
    losses = []
    with tr._context():
        for _ in range(4):
            state, m = tr.train_step(state, _global(next(tr.train_iter), tr.batch_sharding))
            losses.append(float(m["loss"]) / float(m["weight"]))
    out[name] = {"losses": losses, "qkv": np.asarray(
        state.params["trunk"]["block_0"]["attention"]["qkv"]).ravel()[:64].tolist()}
print("QAT " + json.dumps(out))
"""


@pytest.mark.slow
def test_qat_under_data_and_fsdp_mesh_matches_one_device():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(modes, devices):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        proc = subprocess.run([sys.executable, "-c", QAT_MESH_CODE, json.dumps(modes)], cwd=root,
                              env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.split("QAT ", 1)[1])

    ref = run({"one": {"data": 1}}, 1)["one"]
    got = run({"data": {"data": 4}, "fsdp": {"data": 2, "fsdp": 2}}, 4)
    for name, g in got.items():
        # fake quantization rounds: a summation order that differs in the last bit may move
        # an activation across a rounding boundary, so the tolerance is looser than float32's
        np.testing.assert_allclose(g["losses"], ref["losses"], rtol=2e-4, err_msg=name)
        np.testing.assert_allclose(g["qkv"], ref["qkv"], atol=2e-4, err_msg=name)
        assert g["losses"][-1] < g["losses"][0], name


PIPELINE_STATIC_CODE = r"""
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
from hpnlp import models
from hpnlp.compress import ptq
from hpnlp.config import QuantConfig, default_configdict, from_configdict
from hpnlp.parallel.mesh import make_mesh

cd = default_configdict()
cd.data.update(task="byte_lm", seq_len=16)
cd.model.update(kind="lm", width=16, depth=2, num_heads=2, mlp_dim=32, max_len=16,
                stack_layers=True)
cd.mesh.update(pipeline=2, data=1)
cfg = ptq.with_quant(from_configdict(cd), QuantConfig(weights="int8", activations="int8",
                                                       act_scale="static"))
model = models.build(cfg, deterministic=True)
rng = np.random.default_rng(0)
tokens = jnp.asarray(rng.integers(0, 256, (4, 16)), jnp.int32)
batch = {"inputs": tokens, "targets": tokens, "segment_ids": jnp.ones((4, 16), jnp.int32),
         "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16))}
shapes = jax.eval_shape(model.init, jax.random.key(0), batch)  # random weights: no init compile
params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype),
                      nn.unbox(shapes["params"]))
calib = jax.eval_shape(lambda p: model.apply({"params": p}, batch, method="evaluate",
                                             mutable=["calib"])[1]["calib"], params)
# the blocks' ranges [depth]: a wide one in layer 0, a clipping one in layer 1, so a stage
# that read the other layer's ranges would change the result
quant = jax.tree.map(lambda s: jnp.asarray([3.0, 0.2][:s.shape[0]] if s.shape else 3.0,
                                           jnp.float32), calib)
run = jax.jit(lambda p, q, b: model.apply({"params": p, "quant": q}, b, method="log_probs"))
want = run(params, quant, batch)  # no mesh: nn.scan
with jax.set_mesh(make_mesh(cfg.mesh)), nn.logical_axis_rules(cfg.mesh.rule_tuples()):
    got = run(params, quant, batch)  # gpipe over 2 stages
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
print("PIPELINE STATIC OK")
"""


@pytest.mark.slow  # 15 s on one core (a subprocess on 2 simulated devices, two compiles)
def test_static_ranges_reach_the_blocks_of_a_pipelined_model():
    """A bug hunt (session 103): under mesh.pipeline > 1 the gpipe stages applied each block
    with its params alone, so the `quant` collection (act_scale='static' ranges) never
    reached them, and `python -m hpnlp.compress quantize` of a pipelined run failed in its
    own quantized eval ("has no calibrated range: quantize with ..."). The ranges now ride
    through the stages beside the params, split by layer: the 2-stage pipeline equals the
    stacked scan, with a range per layer that clips in one of them."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    proc = subprocess.run([sys.executable, "-c", PIPELINE_STATIC_CODE], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "PIPELINE STATIC OK" in proc.stdout, proc.stderr[-3000:]


def test_served_int8_layer_with_gelu_epilogue_equals_its_xla_twin():
    """The MLP's first layer under w8a8 served by the int8 kernel, whose epilogue adds the
    bias and applies GELU in the product's pass, equals the same packed weight decoded in
    XLA, with bias and GELU after (one quantization, so no rounding flip compounds)."""
    from hpnlp.compress import kernels, qlinear
    if not kernels.available():
        pytest.skip(str(kernels.unavailable_reason()))
    q = QuantConfig(weights="int8", activations="int8")  # dynamic per token: the kernel's
    layer = qlinear.Dense(80, quant=q, epilogue=qlinear.Epilogue("gelu", save_as="mlp_in"))
    x = 3.0 * jax.random.normal(jax.random.key(0), (3, 19, 40))
    w = jax.random.normal(jax.random.key(1), (40, 80)) * 40 ** -0.5
    bias = jax.random.uniform(jax.random.key(2), (80,), minval=-2.0, maxval=2.0)
    packed = qlinear.pack_weight(w, q, 1)
    served = qlinear.prepare(packed, q)
    assert isinstance(served, qlinear.Served)
    run = lambda k: layer.apply({"params": {"kernel": k, "bias": bias}}, x)  # noqa: E731
    want, got = np.asarray(run(packed)), np.asarray(run(served))
    assert want.min() < -0.1 and want.max() > 2.0  # GELU's curve and its linear tail
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the kernel ran (review r17: auto falls back to the twin, equal values, without panels)
    assert jax.jit(run).lower(served).compile().as_text().count("hpnlp_int8_linear") == 1


@pytest.mark.parametrize("tied", [True, False])
def test_served_output_layer_equals_its_xla_twin(tied):
    """Under w8a8 the output layer's product runs on the int8 kernel too (`ptq.serve`
    prepares the tied embedding or the output table): its logits equal the same packed
    weight decoded in XLA (everything else served alike), and a tied table's input lookups
    read the same rows."""
    from flax import traverse_util

    from hpnlp import models
    from hpnlp.compress import kernels, qlinear
    from hpnlp.train.loop import dummy_batch
    if not kernels.available():
        pytest.skip(str(kernels.unavailable_reason()))
    cd = default_configdict()
    cd.data.task, cd.data.seq_len = "byte_lm", 16
    cd.model.update(kind="lm", width=32, depth=1, num_heads=2, mlp_dim=64, max_len=16)
    cd.output.tie_embeddings = tied
    cd.quant.weights, cd.quant.activations = "int8", "int8"
    cfg = validate(from_configdict(cd), num_devices=1)
    model = models.build(cfg, deterministic=True)
    batch = dummy_batch("lm", 3, 16)
    batch["inputs"] = np.asarray(jax.random.randint(jax.random.key(1), (3, 16), 0, 256), np.int32)
    params = jax.jit(model.init)(jax.random.key(0), batch)["params"]  # one compile, not 200
    params = jax.tree.map(lambda p: p.unbox() if hasattr(p, "unbox") else p, params,
                          is_leaf=lambda p: hasattr(p, "unbox"))
    served = ptq.serve(model, ptq.packed_params(model, params, batch), batch)
    flat = traverse_util.flatten_dict(served, is_leaf=lambda _, x: isinstance(x, qlinear.Served))
    out_path = ("embed", "embedding") if tied else next(p for p in flat if p[-1] == "kernel"
                                                         and "table" in "/".join(p))
    assert isinstance(flat[out_path], qlinear.Served), out_path
    twin = dict(flat)
    twin[out_path] = flat[out_path].packed  # the output product decoded in XLA
    run = jax.jit(lambda p: model.apply({"params": p}, batch, method="log_probs"))
    got, want = np.asarray(run(served)), np.asarray(run(traverse_util.unflatten_dict(twin)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    hlo = run.lower(served).compile().as_text()
    assert hlo.count("hpnlp_int8_linear") == 5  # qkv, out, mlp in and out, and the output


def test_training_with_static_activation_ranges_is_refused_before_building(tmp_path):
    """QAT with quant.act_scale='static' has no calibrated ranges: one line at the start, not
    the first step's trace failing after the data and the model were built."""
    from hpnlp.train import Trainer
    cd = default_configdict()
    cd.data.task = "byte_lm"
    cd.quant.update(weights="int8", activations="int8", act_scale="static")
    with pytest.raises(ConfigError, match=r"`quant.act_scale` .* python -m hpnlp.compress quantize"):
        Trainer(from_configdict(cd), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_static_ranges_no_named_product_calibrates_are_refused_before_the_restore(
        trained, tmp_path, capsys):
    """A review (r5): --act_scale static with --layers output (the output layer reads its
    input quantized per token, never a calibrated range) restored the run and failed in its
    first calibration batch with KeyError: 'calib', a traceback naming no flag. Now one line
    naming the field (the flag in the CLI), before the run is restored."""
    from hpnlp.compress.__main__ import main
    from hpnlp.train import Trainer
    q = QuantConfig(weights="int8", activations="int8", act_scale="static", layers="output")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the run was restored"))
        with pytest.raises(ConfigError, match=r"^config field `quant.act_scale` = 'static' is "
                           r"not allowed: calibrates the input ranges of the qkv, out, mlp "
                           r"products, and quant.layers='output' names none of them"):
            ptq.quantize(trained, str(tmp_path / "o"), q, calib_batches=1, repeats=1)
        assert main(["quantize", "--workdir", trained, "--out", str(tmp_path / "o"),
                     "--weights", "int8", "--activations", "int8", "--act_scale", "static",
                     "--layers", "output"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpnlp.compress: error: `--act_scale` = 'static' is not allowed: ")
    assert "--layers output names none of them" in err and "use --act_scale dynamic" in err, err
    assert "\n" not in err
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_static_ranges_leave_padding_out_so_batching_moves_none(arch):
    """A review (r7): calibration reduced each product's input over every position, padding
    (segment 0) too, so a batch's ranges depended on how much of it was padding (absmax
    stretched by padding rows, the percentile moved by them). Now a batch and the same batch
    padded to twice its length calibrate to the same ranges, bit for bit: a Transformer's
    qkv, out and mlp products (the blocks' `calibration_mask`), an LSTM's input products
    (the layers' lengths; the second layer's input is the first's zeroed padding). The
    percentile, the bench's and the README's method; each method's masked reduction is
    `test_calibration_methods_leave_masked_entries_out`'s."""
    import flax.linen as nn

    from hpnlp import models
    from hpnlp.config import ModelConfig, RNNConfig
    B, L, V = 3, 8, 20
    seg = (np.arange(L)[None] < np.array([[8], [5], [2]])).astype(np.int32)
    toks = np.random.default_rng(0).integers(1, V, (B, L)).astype(np.int32) * seg
    batch = {"inputs": toks, "segment_ids": seg, "label": np.zeros(B, np.int32),
             "weight": np.ones(B, np.float32)}
    padded = {k: np.concatenate([v, np.zeros_like(v)], 1) if v.ndim == 2 else v
              for k, v in batch.items()}
    q = QuantConfig(weights="int8", activations="int8", act_scale="static",
                    calibration="percentile")
    m = ModelConfig(kind="classifier", arch=arch, vocab_size=V, num_classes=2, width=8,
                    depth=1 if arch == "transformer" else 2, num_heads=2, mlp_dim=16,
                    max_len=2 * L, dropout=0.0, quant=q)
    cfg = dataclasses.replace(from_configdict(default_configdict()), model=m,
                              rnn=RNNConfig(impl="scan"))
    model = models.build(cfg, deterministic=True)
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch))["params"]
    rng = np.random.default_rng(1)  # random weights by shape: no init compile
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), shapes)
    want, got = (ptq.calibrate_ranges(model, params, [b], "percentile") for b in (batch, padded))
    leaves = jax.tree_util.tree_leaves_with_path(want)
    # qkv, out, mlp_in, mlp_out (two LSTM layers' inputs), and the head's (pooled) input
    assert len(leaves) == (5 if arch == "transformer" else 3), leaves
    assert all(float(r) > 0 for _, r in leaves), leaves
    jax.tree.map(np.testing.assert_array_equal, want, got)


def test_calibration_methods_leave_masked_entries_out():
    """`choose_range(..., valid=)` by each method: entries left out move nothing (x padded
    with large junk and masked gives x's range, bit for bit), and an all-true mask gives
    what no mask gives, bit for bit (an unpadded batch calibrates as it always did, so
    ranges recorded before keep); NaN among the valid entries stays NaN, and a slice with
    none valid has range 0."""
    x = jnp.asarray(RNG.standard_normal((3, 8, 16)), jnp.float32)
    junk = 50.0 * jnp.asarray(RNG.standard_normal((3, 8, 16)), jnp.float32)
    v = np.arange(16)[None, :, None] < 8  # [1, 2L, 1]: the first L positions of each row
    nan = jnp.asarray([[1.0, np.nan, 3.0, 4.0]], jnp.float32)

    @jax.jit
    def run(x, junk, v, nan):
        out = {}
        for m in calibrate.METHODS:
            rng = functools.partial(calibrate.choose_range, fmt="int8", axes=(0, 1, 2),
                                    method=m)
            out[m] = (rng(x), rng(jnp.concatenate([x, junk], 1), valid=v),
                      rng(x, valid=jnp.ones(x.shape, bool)),
                      calibrate.choose_range(nan, "int8", (0, 1), m,
                                             valid=jnp.asarray([[True, True, True, False]])),
                      calibrate.choose_range(nan, "int8", (1,), m,
                                             valid=jnp.zeros((1, 4), bool)))
        return out
    for m, (plain, padded, all_true, with_nan, none) in run(x, junk, v, nan).items():
        np.testing.assert_array_equal(padded, plain, err_msg=m)
        np.testing.assert_array_equal(all_true, plain, err_msg=m)
        assert np.isnan(with_nan).all() and float(none[0, 0]) == 0.0, (m, with_nan, none)


def test_factorized_products_calibrate_over_the_real_tokens():
    """Both inputs of a factorized product (x, then x U, flattened to [B * L, ...]) leave
    out the positions `calibration_mask` marks as padding; a product whose input does not
    lead with the mask's [B, L] is named, not silently mismatched."""
    import flax.linen as nn

    from hpnlp.compress import lowrank, qlinear
    q = QuantConfig(weights="int8", activations="int8", act_scale="static",
                    calibration="percentile")
    layer = _factored_layer(q)

    class Masked(nn.Module):
        @nn.compact
        def __call__(self, x, w, valid):
            with qlinear.calibration_mask(self, valid):
                return layer.copy(parent=self, name="layer")(x, w)
    w = lowrank.svd_factors(jnp.asarray(RNG.standard_normal((3, 8, 24)), jnp.float32), 2, 6)
    x = jnp.asarray(RNG.standard_normal((2, 4, 3, 8)), jnp.float32)
    junk = 100.0 * jnp.asarray(RNG.standard_normal((2, 4, 3, 8)), jnp.float32)
    valid = np.broadcast_to(np.arange(8) < 4, (2, 8))

    @jax.jit
    def calib(x, valid):
        return Masked().apply({}, x, w, valid, mutable=["calib"])[1]["calib"]["layer"]
    want, got = calib(x, np.ones((2, 4), bool)), calib(jnp.concatenate([x, junk], 1), valid)
    assert set(got) == {"w", "w" + qlinear.RANK_INPUT}
    jax.tree.map(np.testing.assert_array_equal, want, got)
    with pytest.raises(ValueError, match=r"calibrating product layer/w: its input of "
                       r"shape \(16, 24\) does not lead with the real-token mask's \(2, 5\)"):
        Masked().apply({}, jnp.concatenate([x, junk], 1), w, np.ones((2, 5), bool),
                       mutable=["calib"])


# ---------------------------------------------------------------- a factorized model, quantized


def _factored_layer(q, activation=None):
    """A factorized product: the attention output's spec (two contraction axes) or, with
    `activation`, a Dense layer (bias and the epilogue after the second factor)."""
    import flax.linen as nn

    from hpnlp.compress import qlinear

    class Out(nn.Module):
        @nn.compact
        def __call__(self, x, w):
            return qlinear.qeinsum(self, "w", "blhd,hdn->bln", x, w, q, kind="out",
                                   dtype=jnp.float32)
    if activation is None:
        return Out()
    return qlinear.Dense(24, quant=q, epilogue=qlinear.Epilogue(activation))


def test_quantized_factorized_product_is_two_quantized_products():
    """Under quantization a factorized weight U V is two products, each quantized as any
    product is: x and x U per token, U per rank column, V per output. Values and gradients
    (STE) equal that definition written out; the export packs both factors, and the packed
    factors decoded in XLA compute what the fake-quantized ones did."""
    from hpnlp.compress import kernels, lowrank, qlinear
    from hpnlp.compress.qlinear import Factored
    q = QuantConfig(weights="int8", activations="int8")
    x = jnp.asarray(RNG.standard_normal((2, 5, 3, 8)), jnp.float32)
    w = lowrank.svd_factors(jnp.asarray(RNG.standard_normal((3, 8, 24)), jnp.float32), 2, 6)
    layer = _factored_layer(q)

    def definition(x, u, v):
        fq = formats.fake_quant
        t = fq(x.reshape(10, 24), "int8", (-1,)) @ fq(u.reshape(24, 6), "int8", (0,))
        return (fq(t, "int8", (-1,)) @ fq(v, "int8", (0,))).reshape(2, 5, 24)

    def loss(fn):
        return lambda x, u, v: jnp.sum(jnp.sin(fn(x, u, v)))
    ours = lambda x, u, v: layer.apply({}, x, Factored(u, v))  # noqa: E731
    (got, g_got), (want, g_want) = (jax.jit(jax.value_and_grad(loss(f), (0, 1, 2)))(x, w.u, w.v)
                                    for f in (ours, definition))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # not the float product: both factors and both inputs were quantized
    run = jax.jit(lambda w, mutable: layer.apply({}, x, w, mutable=mutable),  # one compile each
                  static_argnames="mutable")
    assert not np.allclose(np.asarray(jax.jit(ours)(x, w.u, w.v)), np.asarray(jax.jit(
        lambda w: _factored_layer(QuantConfig()).apply({}, x, w))(w)), atol=1e-4)
    # export: a Factored of two packed weights at the weight's path, decoding to the same
    y, got = run(w, ("qexport",))
    packed = got["qexport"]["w"]
    assert isinstance(packed, Factored) and isinstance(packed.u, QWeight)
    assert packed.u.shape == (3, 8, 6) and packed.u.k_dims == 2 and packed.v.shape == (6, 24)
    np.testing.assert_allclose(np.asarray(run(packed, False)), np.asarray(y), rtol=1e-6,
                               atol=1e-6)
    # calibration records both inputs' ranges, x's and x U's
    _, cal = run(w, ("calib",))
    assert set(cal["calib"]) == {"w", "w" + qlinear.RANK_INPUT}
    if not kernels.available():
        return
    # served: each factor on the int8 kernel, against the same packed factors decoded in XLA;
    # a Dense layer's bias and GELU go to the second kernel's epilogue
    for act in (None, "gelu"):
        layer = _factored_layer(q, act)
        if act is None:
            xs, base, name = x, w, "w"
            apply = lambda ww, mutable=False: layer.apply({}, xs, ww, mutable=mutable)  # noqa: E731
        else:
            xs, name, bias = x.reshape(2, 5, 24), "kernel", jnp.linspace(-1.0, 1.0, 24)
            base = lowrank.svd_factors(jnp.asarray(RNG.standard_normal((24, 24)), jnp.float32)
                                       / 5, 1, 6)
            apply = lambda ww, mutable=False: layer.apply(  # noqa: E731
                {"params": {"kernel": ww, "bias": bias}}, xs, mutable=mutable)
        apply = jax.jit(apply, static_argnames="mutable")
        packed_w = apply(base, mutable=("qexport",))[1]["qexport"][name]
        want, got = apply(packed_w, mutable=("qserve",))
        served = got["qserve"][name]
        assert isinstance(served.u, qlinear.Served) and isinstance(served.v, qlinear.Served)
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(apply(served)), want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max())
        # one kernel call per factor (review r17: auto's twin gives the same values)
        assert apply.lower(served).compile().as_text().count("hpnlp_int8_linear") == 2, act



@pytest.mark.slow  # over 8 s alone on a Xeon model 207 (2026-11-30)
def test_a_factorized_run_trains_quantized_and_exports_packed_factors(trained, tmp_path):
    """model.lowrank with quant.*: QAT fine-tunes the factors of a trained run; its export
    packs both factors of each weight (U and V int8), reloads to the outputs it was
    evaluated with, and evaluates as the QAT run did; a static export calibrates both
    inputs of each factorized product."""
    from hpnlp.compress.qlinear import RANK_INPUT, Factored
    qat = str(tmp_path / "qat")
    summary = _train(qat, steps=3, lowrank=dict(rank=8), init_from=trained, weights="int8",
                     activations="int8", layers="qkv,out,mlp")
    s = ptq.quantize(qat, str(tmp_path / "packed"), eval_batches=2, repeats=1)
    assert s["reload_identical"]
    assert s["eval"]["quantized"]["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-3)
    cfg, params, _ = ptq.load(str(tmp_path / "packed"))
    assert cfg.model.lowrank.rank == 8
    k = params["trunk"]["block_0"]["attention"]["qkv"]
    assert isinstance(k, Factored) and k.u.fmt == "int8" and k.u.codes.shape == (32, 8)
    assert k.v.shape == (8, 3, 2, 16)
    from hpnlp.compress import kernels
    if kernels.available():  # 4 factorized products, two kernels each
        assert s["forward"]["kernel_products"] == 8
    # a static w8a8 export of the same run: each factorized product's two inputs calibrated
    q = QuantConfig(weights="int8", activations="int8", act_scale="static", layers="qkv,out,mlp")
    s = ptq.quantize(qat, str(tmp_path / "static"), q, calib_batches=1, eval_batches=1, repeats=1)
    ranges = ptq.load(str(tmp_path / "static"))[2]["trunk"]["block_0"]["mlp_in"]
    assert s["reload_identical"] and set(ranges) == {"kernel", "kernel" + RANK_INPUT}
    # cast to bfloat16: the factors stored as they are, in bfloat16
    s = ptq.quantize(qat, str(tmp_path / "bf16"), float_dtype="bfloat16", eval_batches=1,
                     repeats=1)
    k = ptq.load(str(tmp_path / "bf16"))[1]["trunk"]["block_0"]["mlp_out"]["kernel"]
    assert s["reload_identical"] and k.u.dtype == jnp.bfloat16 and k.v.shape == (8, 32)
    # what the two cannot do together, named before anything is built
    base = dict(rank=8)
    for fields, quant, match in (
            (dict(base, layers="all"), {}, r"quant\.layers.*factorized output table"),
            (base, dict(weights="int4", group_size=16), r"quant\.group_size.*ranks \[8\]"),
            (dict(energy=0.9), dict(weights="int4", group_size=8),
             r"quant\.group_size.*model\.lowrank\.energy chooses")):
        cd = default_configdict()
        cd.data.task, cd.train.init_from = "byte_lm", trained
        cd.model.lowrank.update(fields)
        cd.quant.update(dict(dict(weights="int8"), **quant))
        with pytest.raises(ConfigError, match=match):
            validate(from_configdict(cd))


@pytest.mark.slow  # 10.8 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_an_moe_run_quantizes_its_experts(tmp_path):
    """The experts' weights are packed with the rest (per expert and output channel, as
    [K, X, N]) and served on the int8 kernel, each expert's two products counted in the
    summary; the packed file reloads to the outputs it was evaluated with; calibrated
    (static) expert inputs are refused in one line before anything is written."""
    run = str(tmp_path / "moe")
    _train(run, steps=3, moe=dict(num_experts=4, router="top_k", top_k=2))
    s = ptq.quantize(run, str(tmp_path / "w8a8"), QuantConfig(weights="int8", activations="int8"),
                     eval_batches=1, repeats=1)
    assert s["reload_identical"] and abs(s["eval"]["loss_rel_increase"]) < 0.02
    # the quantized eval reports the MoE statistics the float one does (a bug hunt, session
    # 102: it had only loss, accuracy and ppl)
    assert set(s["eval"]["quantized"]) == set(s["eval"]["float32"])
    assert 0.0 <= s["eval"]["quantized"]["moe_dropped_frac"] <= 1.0
    moe = ptq.load(str(tmp_path / "w8a8"))[1]["trunk"]["block_0"]["moe"]
    assert isinstance(moe["wi"], QWeight) and moe["wi"].shape == (32, 4, 64)
    assert moe["router"].dtype == np.float32  # routing stays float
    from hpnlp.compress import kernels
    if kernels.available():  # qkv, out, the tied table's logits, and wi, wo of 4 experts
        assert s["forward"]["kernel_products"] == 3 + 2 * 4
    q = QuantConfig(weights="int8", activations="int8", act_scale="static")
    with pytest.raises(ConfigError, match=r"quant\.act_scale.*model\.moe: the experts read"):
        ptq.quantize(run, str(tmp_path / "static"), q)
    assert not os.path.exists(tmp_path / "static")


# 2.7 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_every_output_layer_trains_on_the_activations_its_log_prob_reads():
    """QAT with int8 activations on the output layer: each objective's loss reads the hidden
    states fake-quantized per token, as `log_prob` (eval, decoding, serving) does. Found in
    review: class_based, the sampled objectives and hard_negative trained on float ones."""
    import hpnlp.softmax as S
    from hpnlp.compress.formats import fake_quant
    V, E = 37, 16
    h = jax.random.normal(jax.random.key(0), (2, 5, E))
    t = jax.random.randint(jax.random.key(1), (2, 5), 0, V)
    acts, weights = (QuantConfig(weights="int8", activations=a, layers="output")
                     for a in ("int8", "none"))
    hq = fake_quant(h, "int8", (-1,))
    # (nce and negative_sampling score as sampled does: SampledObjective._scores)
    for name, kw in [("sampled", dict(num_samples=8)), ("hard_negative", {}), ("class_based", {})]:
        layer, plain = S.get(name)(vocab_size=V, quant=acts, **kw), S.get(name)(vocab_size=V,
                                                                                quant=weights, **kw)

        @jax.jit  # one compile per layer: init, its loss, and the twin it must equal
        def both(h, hq, t):
            p = layer.init(jax.random.key(2), h, t, None, method="loss")
            got = layer.apply(p, h, t, None, method="loss")
            if name == "class_based":  # exact: the loss is -log_prob[target]
                lp = layer.apply(p, h, method="log_prob")
                return got, -jnp.take_along_axis(lp, t[..., None], -1)[..., 0]
            return got, plain.apply(p, hq, t, None, method="loss")  # the float layer fed hq

        got, want = both(h, hq, t)
        np.testing.assert_allclose(got, want, atol=1e-5 if name == "class_based" else 1e-6,
                                   err_msg=name)


def test_a_second_call_writing_into_the_same_out_is_refused(tmp_path):
    """A bug hunt (session 97): two `shrink` calls into one --out at once shared its stage
    (OUT/.unfinished), each clearing the other's; one ended in a traceback, and OUT was left
    with no summary.json. Now OUT is held for the call: the second is refused in one line."""
    import subprocess
    import sys

    from hpnlp.paths import WorkdirBusy, staged
    out = tmp_path / "o"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, time\n"
         f"fcntl.flock(os.open({str(out)!r}, os.O_RDONLY), fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirBusy, match=r"^--out .*: another process is writing into "
                                              r"it \(a call like this one"):
            with staged(str(out)):
                pytest.fail("the block ran")
        assert os.listdir(out) == []  # nothing of this call's
    finally:
        holder.kill()
        holder.wait()
    with staged(str(out)) as stage:  # released: a call goes on
        with open(os.path.join(stage, "summary.json"), "w") as f:
            f.write("{}")
    assert os.listdir(out) == ["summary.json"]
    with pytest.raises(RuntimeError):  # a call that fails leaves no folder it made
        with staged(str(tmp_path / "new")):
            raise RuntimeError
    assert not os.path.exists(tmp_path / "new")


def test_quantized_rows_are_the_quantized_tables_rows_in_values_and_gradients():
    """`qlinear.quant_rows` (session 113): a sampled objective's or a tied lookup's rows,
    gathered and then fake-quantized, equal the rows of the whole table fake-quantized, in
    values and straight-through gradients, for every weight format (absmax) and the
    percentile and MSE ranges (int8, int4 by groups): each row of a [V, E] table has its
    own scale and range. Repeated ids included."""
    from hpnlp.compress.qlinear import quant_rows, quant_weight
    V, E = 13, 16
    w = jax.random.normal(jax.random.key(0), (V, E)).at[3, 5].set(9.0)  # an outlier row
    ids = jnp.array([[3, 0, 3], [12, 7, 3]])
    c = jax.random.normal(jax.random.key(1), ids.shape + (E,))
    configs = [QuantConfig(weights=f, calibration=cal, group_size=8 if f == "int4" else 0,
                           percentile=90.0)
               for f in sorted(formats.FORMATS) for cal in ("absmax", "percentile", "mse")
               if cal == "absmax" or f in ("int8", "int4")]  # (each range is chosen per row)

    @jax.jit  # one compile for every format
    def both(w):
        out = []
        for q in configs:
            def rows_first(w, q=q):
                return quant_rows(jnp.take(w, ids, axis=0), q)

            def table_first(w, q=q):
                return jnp.take(quant_weight(w.T, 1, q).T, ids, axis=0)
            for f in (rows_first, table_first):
                out.append((f(w), jax.grad(lambda w, f=f: jnp.sum(f(w) * c))(w)))
        return out

    got = both(w)
    for i, q in enumerate(configs):
        (rows, g_rows), (table, g_table) = got[2 * i], got[2 * i + 1]
        np.testing.assert_array_equal(rows, table, err_msg=str(q))
        np.testing.assert_array_equal(g_rows, g_table, err_msg=str(q))
    assert len(configs) == 10


def test_qat_sampled_rows_and_tied_lookups_quantize_only_the_rows_they_read():
    """A sampled objective's rows and a tied embedding's lookups under QAT (session 113):
    the same values and gradients as the rows of the whole fake-quantized table, and the
    [E, V] table is no longer quantized to read them (it was, every step, for R << V rows)."""
    import flax.linen as nn

    import hpnlp.softmax as S
    from hpnlp.config import ModelConfig
    from hpnlp.models import transformer as T
    V, E = 37, 16
    q = QuantConfig(weights="int8", layers="output")
    ids = jnp.array([[1, 5, 1, 30], [2, 2, 9, 36]])
    c = jax.random.normal(jax.random.key(1), ids.shape + (E,))
    whole = f"f32[{E},{V}]"  # the table transposed, contraction first, as quant_weight takes it

    class Tied(nn.Module):
        def setup(self):
            self.embed = T.make_embed(ModelConfig(vocab_size=V, width=E, quant=q), tied=True)
            self.out = S.get("sampled")(vocab_size=V, embed=self.embed, num_samples=4, quant=q)

    for layer, rows, table in (
            (S.get("sampled")(vocab_size=V, num_samples=4, quant=q),
             lambda m, ids: m.rows(ids, E)[0], lambda m: m.weights(E)[0]),
            (Tied(), lambda m, ids: m.embed(ids), lambda m: m.embed.table()),
            (Tied(), lambda m, ids: m.out.rows(ids, E)[0], lambda m: m.embed.table())):
        p = nn.unbox(layer.init(jax.random.key(0), ids, method=lambda m, ids: (
            (m.embed(ids), m.out.rows(ids, E)) if isinstance(m, Tied) else m.rows(ids, E))))

        def read(p, layer=layer, rows=rows):
            return layer.apply(p, ids, method=rows)

        def gathered(p, layer=layer, table=table):
            return jnp.take(layer.apply(p, method=table), ids, axis=0)

        @jax.jit
        def both(p):
            return [(f(p), jax.grad(lambda p, f=f: jnp.sum(f(p) * c))(p))
                    for f in (read, gathered)]
        (got, g_got), (want, g_want) = both(p)
        np.testing.assert_array_equal(got, want)
        jax.tree.map(np.testing.assert_array_equal, g_got, g_want)
        assert whole not in str(jax.make_jaxpr(read)(p))
        assert whole in str(jax.make_jaxpr(gathered)(p))


@pytest.mark.slow  # trains, quantizes and decodes a run: CI's slow part runs it
def test_a_performer_run_quantizes_under_the_draw_it_trained_with(tmp_path, capsys):
    """A Performer run's random features come from its train state's key (a new draw every
    train.feature_redraw_every steps). Quantizing one was refused until session 113 (its
    files kept no draw, and the model would have been evaluated and decoded under its
    seed's); now quant.json keeps the last step's draw, the static ranges are calibrated
    and the quantized eval runs under it, and generate decodes under it. A quant.json
    without it, or with a damaged one, is refused, naming the file."""
    import importlib

    from hpnlp import data as data_lib
    from hpnlp import models
    from hpnlp.train import Trainer, carry
    from hpnlp.train.carry import fold_eval
    from hpnlp.train.step import finalize
    run, out = str(tmp_path / "run"), str(tmp_path / "int8")
    _train(run, steps=3, attention={"name": "performer", "options": {"num_features": 16}},
           redraw_every=1)
    q = QuantConfig(weights="int8", activations="int8", act_scale="static")
    s = ptq.quantize(run, out, q, calib_batches=1, eval_batches=1, repeats=1)
    assert s["reload_identical"]
    trainer = Trainer(ptq.load_run_config(run), run, read_only=True)
    state, _ = trainer.initial_state()
    trainer.checkpointer.close()
    float_params = carry.model_params(state.params)
    trained, first = (jax.random.key_data(state.features_key(r)) for r in (1, 0))
    key = ptq.load_features_key(out)
    np.testing.assert_array_equal(jax.random.key_data(key), trained)
    assert not np.array_equal(trained, first)  # the last step's draw, not the first's
    # the summary's quantized loss is the one under that draw (the attention falls back to
    # its seed's without one, silently)
    cfg_q, packed, qv = ptq.load(out)
    task = data_lib.make_task(cfg_q.data)
    batch = next(iter(data_lib.make_iterator(task, cfg_q.data, split="eval", batch_size=8)))
    model = models.build(cfg_q, deterministic=True, token_counts=task.token_counts)
    served = ptq.serve(model, packed, batch, qv)
    # the static ranges were calibrated under it too (found in review: under the seed's)
    calib = [next(iter(data_lib.make_iterator(task, cfg_q.data, split="train", batch_size=8)))]
    for rngs, same in (({"features": key}, True), (None, False)):
        ranges = ptq.calibrate_ranges(model, float_params, calib, "absmax", rngs)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, ranges, qv))) == same

    @jax.jit
    def losses(served, batch, key):
        return [fold_eval(model, {"params": served, "quant": qv}, batch, rngs) for rngs in
                ({"features": key}, None)]
    under_key, seeds = (finalize(jax.device_get(x), lm=True)["loss"]
                        for x in losses(served, batch, key))
    assert under_key == pytest.approx(s["eval"]["quantized"]["loss"], rel=1e-6)
    assert abs(seeds - under_key) > 1e-6
    generate = importlib.import_module("hpnlp.models.generate")
    assert generate.main(["--workdir", out, "--prompt", "And", "--length", "8",
                          "--greedy"]) == 0
    capsys.readouterr()
    manifest = json.load(open(os.path.join(out, "quant.json")))
    for damage, what in ((None, "has no"), ([[1, 2]], "has a damaged (ValueError)"),
                         ([-1, 5], "has a damaged (OverflowError)")):
        if damage is None:
            del manifest[ptq.FEATURES]
        else:
            manifest[ptq.FEATURES] = {"impl": "threefry2x32", "data": damage}
        json.dump(manifest, open(os.path.join(out, "quant.json"), "w"))
        assert generate.main(["--workdir", out, "--prompt", "And", "--length", "8"]) == 2
        err = capsys.readouterr().err.strip()
        assert (f"{out}/quant.json {what} 'features_key', the random-feature draw its "
                "attention.name='performer' model trained with") in err and "\n" not in err


def test_kernel_products_count_each_stacked_layer_and_expert():
    """A review (session 117): under model.stack_layers a served weight's arrays carry the
    scan's [depth] axis, and summary.json's `kernel_products` counted a depth-4 stack's
    weight once. Each layer and each expert counts (no compile: the count reads shapes)."""
    from hpnlp.compress import ptq
    from hpnlp.compress.qlinear import QWeight, Served

    def served(scale_shape, experts=0):
        packed = QWeight(codes=np.zeros((*scale_shape[:-2], 8, scale_shape[-1]), np.int8),
                         scale=np.zeros(scale_shape, np.float32), fmt="int8", shape=(8, 4))
        return Served(w=None, fmt="int8", shape=(8, 4), packed=packed, experts=experts)
    assert ptq.served_products(served((1, 4))) == 1
    assert ptq.served_products(served((4, 1, 4))) == 4  # a stack of 4 layers
    assert ptq.served_products(served((1, 12), experts=3)) == 3  # [K, X*N] experts
    assert ptq.served_products(served((2, 1, 12), experts=3)) == 6
