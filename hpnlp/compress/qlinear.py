"""Quantized products: where every model's matrix products meet the `quant.*` config.

    y_BLKHD = qeinsum(self, "qkv", "ble,ekhd->blkhd", x_BLE, w_E3HD, m.quant, kind="qkv", dtype=dt)

A model module calls `qeinsum` instead of `jnp.einsum` for each product `quant.layers`
can name (config.QUANT_LAYERS). What it computes depends on the config and on what the
weight is:

- quantization off for this kind: the plain einsum;
- a float weight (training, QAT, or a float checkpoint evaluated under PTQ settings): the
  weight is fake-quantized per output channel (contraction axes share a scale; int4:
  groups along the contraction) and the activations per token (`dynamic`) or by the
  product's calibrated range (`static`, the `quant` variable collection), both with the
  straight-through estimator (`formats.fake_quant`), then the float einsum;
- a `QWeight` (a packed quantized checkpoint, `hpnlp.compress.ptq`): the same values,
  decoded from the packed integers in XLA;
- a `Served` weight (`ptq.serve` made it from a QWeight at load time): an integer kernel
  (`hpnlp.compress.kernels`) computes the product, quantizing the activations itself the
  way `q` says (`kernel_for`);
- a `Sparse` weight (a pruned weight's nonzeros, `python -m hpnlp.compress sparsify`): the
  sparse kernel (`hpnlp.compress.spmm`) computes the float product.

In calibration (the `calib` collection mutable) a product records its input's range for
this batch (`calibrate.choose_range`, per tensor) over its real tokens (`calibration_mask`:
the trunk's blocks and the RNN layers name them) and leaves activations in float.

Specs must read "x_free + contraction, w_contraction + w_free -> x_free + w_free" in that
order (every product in hpnlp does): a weight is then a [K, N] matrix after moving its
contraction axes to the front, which is how it is quantized and packed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from hpnlp.compress import calibrate, formats, packing
from hpnlp.config import QuantConfig


def parse_spec(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(x contraction axes, w contraction axes) of "x,w->out"; checks the order rule."""
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    lead = ""
    if xs.startswith("..."):  # "...k,kn->...n"
        xs, out, lead = xs[3:], out[3:], "..."
    contract = [c for c in xs if c in ws and c not in out]
    x_free = [c for c in xs if c not in contract]
    w_free = [c for c in ws if c not in contract]
    w_axes = tuple(ws.index(c) for c in contract)
    ok = (out == "".join(x_free + w_free) and xs.endswith("".join(contract))
          and ws.startswith("".join(contract)) and lead in ("", "..."))
    if not ok:
        raise ValueError(f"quantized product {spec!r}: hpnlp's products read "
                         "'x_free contraction, contraction w_free -> x_free w_free'")
    x_axes = tuple(range(-len(contract), 0))
    return x_axes, w_axes


@flax.struct.dataclass
class QWeight:
    """A packed quantized weight in a parameter tree (see packing.py for layouts).

    codes: int8 [K, N] (int8, ternary, pow2), uint8 [ceil(K/2), N] (int4), uint8
    [ceil(K/8), N] (binary), float8_e4m3fn [K, N] (fp8); scale: float32 [G, N] with G
    = K / group (1 without groups). The float weight had `shape`, its first `k_dims` axes
    the contraction (K = their product)."""

    codes: jax.Array
    scale: jax.Array
    fmt: str = flax.struct.field(pytree_node=False)
    shape: tuple = flax.struct.field(pytree_node=False)
    k_dims: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def k(self) -> int:
        return math.prod(self.shape[:self.k_dims])

    def codes_KxN(self):
        """Unpacked integer (or fp8) codes [K, N]."""
        if self.fmt == "int4":
            return packing.unpack_int4(self.codes, self.k)
        if self.fmt == "binary":
            return packing.unpack_bits(self.codes, self.k)
        return self.codes

    def dequantize(self, dtype=jnp.float32):
        c_KN = self.codes_KxN()
        K, N = c_KN.shape
        G = self.scale.shape[0]
        f = formats.get(self.fmt)
        w = f.decode(c_KN.reshape(G, K // G, N), self.scale[:, None, :]).reshape(K, N)
        return w.reshape(self.shape).astype(dtype)


@flax.struct.dataclass
class Factored:
    """A product weight as two factors (hpnlp.compress.lowrank): W = U V with U
    [*contraction shape, r] and V [r, *free shape], the weight's contraction axes first (as
    every qeinsum weight is stored). `qeinsum` computes x U, then (x U) V. `lead` > 0: that
    many leading axes are a batch of weights, each factorized on its own (an MoE layer's
    experts: W [X, K, N] as U [X, K, r], V [X, r, N]; hpnlp.moe.dispatch multiplies them).
    Quantized experts' factors packed (QWeight) or served are stored contraction first like
    every packed weight, U [K, X, r] and V [r, X, N] (hpnlp.moe.layer.expert_factors decodes
    them to the float layout), so `shape` and `dense` hold for float factors only."""

    u: jax.Array
    v: jax.Array
    lead: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def rank(self) -> int:
        return self.u.shape[-1]

    @property
    def shape(self) -> tuple:
        return tuple(self.u.shape[:-1]) + tuple(self.v.shape[self.lead + 1:])

    def dense(self):
        """U V as the weight it replaces."""
        r, b = self.rank, self.u.shape[:self.lead]
        u = self.u.reshape(b + (-1, r))
        return (u @ self.v.reshape(b + (r, -1))).reshape(self.shape)

    def astype(self, dtype) -> "Factored":
        return self.replace(u=self.u.astype(dtype), v=self.v.astype(dtype))


def param(module: nn.Module, name: str, *args):
    """`module.param(name, *args)`, or the packed QWeight (or the low-rank Factored weight)
    a checkpoint holds there (flax's own check would compare their shapes with the float
    weight's)."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, (QWeight, Served, Factored, Sparse)):
            return value
    return module.param(name, *args)


def _mutable(module: nn.Module, collection: str) -> bool:
    """Whether an apply asked for `collection` (init makes every collection mutable)."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


@flax.struct.dataclass
class Product:
    """What the `products` collection says of a product weight at its parameter's path:
    its kind (a QUANT_LAYERS name) and its contraction axes as the parameter is stored."""

    kind: str = flax.struct.field(pytree_node=False)
    contraction: tuple = flax.struct.field(pytree_node=False)
    # leading axes that index a batch of weights, each its own product (an MoE layer's
    # experts: 1); model.lowrank factorizes each weight of the batch on its own
    lead: int = flax.struct.field(pytree_node=False, default=0)


def note_product(module: nn.Module, name: str, kind: str, contraction: tuple[int, ...],
                 lead: int = 0) -> None:
    """Record parameter `name` of `module` as a product weight (when an apply asked for the
    `products` collection): how hpnlp.compress's pruning and factorization find every
    product weight of any model without a table of parameter names."""
    if _mutable(module, "products"):
        module.put_variable("products", name, Product(kind, tuple(contraction), lead))


def products(model, params, batch, method: str = "evaluate") -> dict:
    """{parameter path (tuple): Product} of every product weight `model` uses on `batch`
    (shapes only: nothing is computed)."""
    import flax.traverse_util as traverse
    key = jax.random.key(0)  # dropout and random features take keys; only shapes come back
    got = jax.eval_shape(lambda p: model.apply({"params": p}, batch, method=method,
                                               rngs={"dropout": key, "features": key},
                                               mutable=["products"])[1], params)
    flat = traverse.flatten_dict(got.get("products", {}), is_leaf=lambda _, x: isinstance(x, Product))
    return dict(flat)


@flax.struct.dataclass
class Served:
    """A packed weight prepared for one of `hpnlp.compress.kernels`' products (its panel
    layout belongs to this build: made at load time by `serve`, never saved)."""

    w: object  # kernels.Int8Weight | BinaryWeight | Int4Weight
    fmt: str = flax.struct.field(pytree_node=False)
    shape: tuple = flax.struct.field(pytree_node=False)
    k_dims: int = flax.struct.field(pytree_node=False, default=1)
    packed: object = None  # the QWeight it was prepared from (its arrays, not a copy)
    # an MoE layer's experts (hpnlp.moe.layer.serve_experts): X kernel weights stacked on a
    # leading axis of `w`'s arrays, one product per expert; 0 for one weight
    experts: int = flax.struct.field(pytree_node=False, default=0)

    def dequantize(self, dtype=jnp.float32):
        """The float weight [K, N] (a tied embedding's lookups read its rows)."""
        return self.packed.dequantize(dtype)


def kernel_for(q: QuantConfig, fmt: str) -> str | None:
    """The integer kernel that computes a product exactly as `q` defines it, if any:
    int8 weights with per-token int8 activations, binary weights with binary activations
    (XNOR-Net), int4 weights with float activations."""
    if fmt == "int8" and q.activations == "int8" and q.act_scale == "dynamic":
        return "int8"
    if fmt == "binary" and q.activations == "binary":
        return "binary"
    if fmt == "int4" and q.activations == "none":
        return "int4"
    return None


def prepare(qw: QWeight, q: QuantConfig) -> "Served | QWeight":
    """A QWeight as its kernel's prepared weight (`kernel_for`), or unchanged."""
    from hpnlp.compress import kernels
    which = kernel_for(q, qw.fmt)
    if which is None or not kernels.available():
        return qw
    N = math.prod(qw.shape[qw.k_dims:])
    if which == "int8":
        w = kernels.prepare_int8_weight(qw.codes, qw.scale.reshape(N))
    elif which == "binary":
        w = kernels.prepare_binary_weight(qw.codes, qw.scale.reshape(N), k=qw.k)
    else:
        w = kernels.prepare_int4_weight(qw.codes, qw.scale, k=qw.k)
    return Served(w=w, fmt=qw.fmt, shape=qw.shape, k_dims=qw.k_dims, packed=qw)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What a layer applies to its product: + bias, then `activation` (None, or "gelu":
    flax's nn.gelu, the tanh form). `save_as` names the pre-activation for remat policies
    (`checkpoint_name`); `remat` recomputes the activation in the backward pass. The int8
    kernel applies it in the product's own pass over its output (`kernels.int8_linear`);
    every other product applies it after, in XLA."""

    activation: str | None = None
    save_as: str | None = None
    remat: bool = False

    def apply(self, y, bias=None):
        if bias is not None:
            y = y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
        if self.activation is None:
            return y
        if self.save_as:
            y = checkpoint_name(y, self.save_as)
        from hpnlp.compress.kernels import ACTIVATIONS
        act = ACTIVATIONS[self.activation][1]
        return (jax.checkpoint(act) if self.remat else act)(y)


def serve_weight(module: nn.Module, name: str, w, q: QuantConfig) -> None:
    """In `ptq.serve`'s pass (the `qserve` collection mutable): a QWeight `name` of `module`
    as its kernel's prepared weight (`prepare`), put at the parameter's path."""
    if isinstance(w, QWeight) and _mutable(module, "qserve"):
        module.put_variable("qserve", name, prepare(w, q))


def served_product(x, w: Served, n_contract: int, dtype, bias=None,
                   epilogue: Epilogue = Epilogue()):
    """x's last `n_contract` axes against a Served weight, by its integer kernel, then +
    bias and the epilogue's activation (int8: in the kernel's pass)."""
    from hpnlp.compress import kernels
    lead, K = x.shape[:x.ndim - n_contract], math.prod(x.shape[x.ndim - n_contract:])
    x_MK = x.reshape(-1, K).astype(jnp.float32)
    out_shape = lead + w.shape[w.k_dims:]
    if w.fmt == "int8" and n_contract == 1 and len(w.shape) - w.k_dims == 1:
        # the kernel's epilogue: bias and activation in the product's pass (inference only:
        # no pre-activation to save)
        y_MN = kernels.int8_linear(x_MK, w.w, activation=epilogue.activation,
                                   bias=None if bias is None else bias.astype(jnp.float32))
        return y_MN.reshape(out_shape).astype(dtype)
    fn = {"int8": kernels.int8_linear, "binary": kernels.binary_linear,
          "int4": kernels.int4_linear}[w.fmt]
    return epilogue.apply(fn(x_MK, w.w).reshape(out_shape).astype(dtype), bias)


@flax.struct.dataclass
class Sparse:
    """A pruned product weight by its nonzeros (`hpnlp.compress.sparsify` makes it):
    `hpnlp.compress.spmm`'s CSC arrays of the weight as [K, N] (its contraction axes, the
    first `k_dims` of `shape`, flattened into K), which `qeinsum` multiplies by the sparse
    kernel (its XLA twin, the dense product, where the kernel cannot run)."""

    w: object  # spmm.SparseWeight
    shape: tuple = flax.struct.field(pytree_node=False)
    k_dims: int = flax.struct.field(pytree_node=False, default=1)

    def dense(self):
        return self.w.dense().reshape(self.shape)


def sparse_product(x, w: Sparse, n_contract: int, dtype, bias=None,
                   epilogue: Epilogue = Epilogue()):
    """x's last `n_contract` axes against a Sparse weight by the sparse kernel, in float32,
    then + bias and the epilogue's activation."""
    from hpnlp.compress import spmm
    lead, K = x.shape[:x.ndim - n_contract], math.prod(x.shape[x.ndim - n_contract:])
    y_MN = spmm.sparse_matmul(x.reshape(-1, K).astype(jnp.float32), w.w)
    return epilogue.apply(y_MN.reshape(lead + w.shape[w.k_dims:]).astype(dtype), bias)


def _weight_KxN(w, k_dims: int):
    return w.reshape(math.prod(w.shape[:k_dims]), -1)


def pack_weight(w, q: QuantConfig, k_dims: int) -> QWeight:
    """A float weight (contraction axes first) -> its packed QWeight under `q`."""
    w_KN = _weight_KxN(jnp.asarray(w, jnp.float32), k_dims)
    f = formats.get(q.weights)
    rng = calibrate.choose_range(w_KN, q.weights, (0,), q.calibration, percentile=q.percentile,
                                 group=q.group_size)
    codes, scale = f.encode(w_KN, (0,), group=q.group_size, rng=rng if f.uses_range else None)
    K, N = w_KN.shape
    codes = codes.reshape(K, N)
    scale = scale.reshape(-1, N)
    if q.weights == "int4":
        codes = packing.pack_int4(codes)
    elif q.weights == "binary":
        codes = packing.pack_bits(codes)
    return QWeight(codes=codes, scale=scale.astype(jnp.float32), fmt=q.weights,
                   shape=tuple(w.shape), k_dims=k_dims)


def quant_weight(w, k_dims: int, q: QuantConfig, module: nn.Module | None = None,
                 name: str | None = None):
    """Fake-quantized float weight (contraction axes first), or a QWeight decoded.

    `module`/`name`: the parameter's owner and name. In export (the `qexport` collection
    mutable) the packed QWeight is put there, at the parameter's own path, which is how
    `hpnlp.compress.ptq` learns which parameters are product weights and how they lie."""
    if isinstance(w, (QWeight, Served)):
        return w.dequantize()
    if q.weights == "none":
        return w
    if module is not None and _mutable(module, "qexport"):
        module.put_variable("qexport", name, pack_weight(w, q, k_dims))
    w_KN = _weight_KxN(w, k_dims)
    rng = None
    if formats.get(q.weights).uses_range and q.calibration != "absmax":
        rng = jax.lax.stop_gradient(calibrate.choose_range(
            w_KN, q.weights, (0,), q.calibration, percentile=q.percentile, group=q.group_size))
    return formats.fake_quant(w_KN, q.weights, (0,), group=q.group_size, rng=rng).reshape(w.shape)


def quant_rows(rows_XE, q: QuantConfig) -> jax.Array:
    """Rows [..., E] gathered from a [V, E] table whose product contracts E, fake-quantized
    as `quant_weight(table.T, 1, q).T` quantizes them within the whole table: each row (a
    column of the [E, V] weight) has its own scale, range and groups, so its values and
    straight-through gradients do not depend on the other rows (bit for bit on one device;
    under a mesh a row's sums may add in another order once gathered, a last-bit
    difference in binary's and ternary's means and mse's errors). A sampled objective's R
    rows, or a tied embedding's looked-up ones, cost R rows' quantization rather than V's
    (session 113: the whole table was fake-quantized every step to gather R << V rows).
    Where it applies: `quantizes_rows`."""
    flat_EX = rows_XE.reshape(-1, rows_XE.shape[-1]).T
    return quant_weight(flat_EX, 1, q).T.reshape(rows_XE.shape)


def quantizes_rows(table_VE, quantized: bool, num_rows: int, module: nn.Module) -> bool:
    """Whether `num_rows` rows read from `module`'s [V, E] table (`quantized`: under QAT)
    are fake-quantized after the gather (`quant_rows`) rather than with the whole table:
    fewer rows than V, a float table (not packed or factored), and not in an export, where
    `quant_weight` packs the whole table (the `qexport` collection mutable)."""
    return (quantized and not isinstance(table_VE, (QWeight, Served, Factored))
            and num_rows < table_VE.shape[0] and not _mutable(module, "qexport"))


# The real tokens [B, L] (bool) of the products called inside `calibration_mask`, or None.
# A context, not an argument: every product a block calls (qkv, out, the MLP's, a factorized
# product's two) reads the mask of the block's own rows without a `valid` argument threaded
# through each layer between them.
_CALIB_VALID = contextvars.ContextVar("hpnlp_calib_valid", default=None)


@contextlib.contextmanager
def calibration_mask(module: nn.Module, valid_BL):
    """In calibration (the `calib` collection mutable; elsewhere nothing), the products
    called inside record their ranges over the tokens where `valid_BL` [B, L] (bool: the
    segment ids > 0, or a row's length) only: padding is left out, so a batch's ranges do
    not depend on how much of it is padding (a review, r7: padding rows stretched absmax
    and moved the percentile). Their inputs must lead with [B, L] (or [B * L])."""
    if valid_BL is None or not _mutable(module, "calib"):
        yield
        return
    token = _CALIB_VALID.set(jnp.asarray(valid_BL, bool))
    try:
        yield
    finally:
        _CALIB_VALID.reset(token)


def _calib_valid(module: nn.Module, name: str, x):
    """`calibration_mask`'s mask shaped to broadcast against product input `x` (x's leading
    axes [B, L], or [B * L] flattened: a factorized product's), or None outside one."""
    valid = _CALIB_VALID.get()
    if valid is None:
        return None
    if tuple(x.shape[:valid.ndim]) == tuple(valid.shape):
        return valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim))
    if x.ndim and x.shape[0] == valid.size:
        return valid.reshape((-1,) + (1,) * (x.ndim - 1))
    raise ValueError(f"calibrating product {'/'.join(module.path)}/{name}: its input of shape "
                     f"{tuple(x.shape)} does not lead with the real-token mask's "
                     f"{tuple(valid.shape)}; call it outside `qlinear.calibration_mask`, or "
                     "give the mask of its own rows")


def quant_act(module: nn.Module, name: str, x, x_axes: tuple[int, ...], q: QuantConfig):
    """Activations under `q`: fake-quantized per token (`dynamic`) or by the product's
    calibrated range (`static`); recorded, not quantized, in calibration (over the real
    tokens `calibration_mask` names, where it does)."""
    if q.activations == "none":
        return x
    if _mutable(module, "calib"):
        r = calibrate.choose_range(jax.lax.stop_gradient(x), q.activations, tuple(range(x.ndim)),
                                   q.calibration, percentile=q.percentile,
                                   valid=_calib_valid(module, name, x)).reshape(())
        # a product that runs more than once a batch (a dual encoder's trunk: both texts)
        # keeps the widest of its calls' ranges (found in review: the last call's alone)
        var = module.variable("calib", name, lambda: jnp.zeros((), jnp.float32))
        var.value = jnp.maximum(var.value, r)
        return x
    if q.act_scale == "static" and formats.get(q.activations).uses_range:
        if module.is_initializing():
            return x
        if not module.has_variable("quant", name):
            raise ValueError(
                f"quant.act_scale='static' but product {'/'.join(module.path)}/{name} has no "
                "calibrated range: quantize with `python -m hpnlp.compress quantize` (it "
                "calibrates), or use quant.act_scale='dynamic'")
        r = module.get_variable("quant", name)
        return formats.fake_quant(x, q.activations, tuple(range(x.ndim)), rng=r)
    return formats.fake_quant(x, q.activations, x_axes)


def qeinsum(module: nn.Module, name: str, spec: str, x, w, q: QuantConfig, *, kind: str,
            dtype, preferred_element_type=None, bias=None, epilogue: Epilogue = Epilogue()):
    """`jnp.einsum(spec, x, w)` in `dtype` with `q`'s quantization of `kind` products (module
    doc), then + `bias` (over the last axis) and the `epilogue`'s activation where given."""
    note_product(module, name, kind, parse_spec(spec)[1])
    if isinstance(w, Factored):  # model.lowrank: two products through the rank
        return _factored_product(module, name, len(parse_spec(spec)[0]), x, w, q, kind=kind,
                                 dtype=dtype, preferred_element_type=preferred_element_type,
                                 bias=bias, epilogue=epilogue)
    if isinstance(w, Served):  # an integer kernel computes the whole product
        return served_product(x, w, len(parse_spec(spec)[0]), dtype, bias, epilogue)
    if isinstance(w, Sparse):  # a pruned weight's nonzeros: the sparse kernel
        return sparse_product(x, w, len(parse_spec(spec)[0]), dtype, bias, epilogue)
    if not q.applies(kind) and not isinstance(w, QWeight):  # a float product
        return epilogue.apply(float_product(
            x.astype(dtype), w.astype(dtype), None if bias is None else bias.astype(dtype),
            len(parse_spec(spec)[0]), preferred_element_type))
    return epilogue.apply(_product(module, name, spec, x, w, q, kind=kind, dtype=dtype,
                                   preferred_element_type=preferred_element_type), bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def float_product(x, w, bias, n_contract: int, preferred_element_type=None):
    """x's last `n_contract` axes against w's first ones (qeinsum's spec order), + `bias`
    over the last axis (None: none), differentiated by three products of its own.

    Autodiff gives the same values, but on XLA:CPU its weight gradient comes out as
    dW^T = g^T x, which XLA computes by writing g^T (a copy of the layer's whole output
    gradient) and transposes back, and its bias gradient as a reduction that XLA:CPU
    splits into a slow reduce-window tree. Here dW = x^T g is one product in the weight's
    own layout and db = 1^T g one more (a matrix-vector product): the default byte LM's
    training step 162 -> 142 ms on a 2-core Xeon (`python tools/float_product_ab.py`;
    `tests/test_compress.py` checks values and gradients against autodiff of the einsum)."""
    return _float_product_fwd(x, w, bias, n_contract, preferred_element_type)[0]


def _dot(a, b, a_axes, b_axes, preferred_element_type=None):
    return jax.lax.dot_general(a, b, ((tuple(a_axes), tuple(b_axes)), ((), ())),
                               preferred_element_type=preferred_element_type)


def _float_product_fwd(x, w, bias, n_contract, preferred_element_type):
    y = _dot(x, w, range(x.ndim - n_contract, x.ndim), range(n_contract), preferred_element_type)
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y, (x, w, bias)


def _float_product_bwd(n_contract, preferred_element_type, res, g):
    del preferred_element_type
    x, w, bias = res
    free = w.ndim - n_contract
    dx = _dot(g, w, range(g.ndim - free, g.ndim), range(n_contract, w.ndim))
    # the leading axes as one, so each of these contracts a single axis (XLA:CPU otherwise
    # transposes an operand to gather several)
    m = math.prod(x.shape[:x.ndim - n_contract])
    g_M = g.reshape((m,) + g.shape[g.ndim - free:])
    dw = _dot(x.reshape((m,) + x.shape[x.ndim - n_contract:]), g_M.astype(x.dtype), [0], [0])
    db = None if bias is None else _dot(jnp.ones((g_M.size // g.shape[-1],), g.dtype),
                                        g_M.reshape(-1, g.shape[-1]), [0], [0])
    return (dx.astype(x.dtype), dw.astype(w.dtype),
            None if bias is None else db.astype(bias.dtype))


float_product.defvjp(_float_product_fwd, _float_product_bwd)


def _product(module: nn.Module, name: str, spec: str, x, w, q: QuantConfig, *, kind: str,
             dtype, preferred_element_type=None):
    """qeinsum's product for a quantized or packed weight."""
    serve_weight(module, name, w, q)
    x_axes, w_axes = parse_spec(spec)
    if q.applies(kind):
        x = quant_act(module, name, x, x_axes, q)
    w = quant_weight(w, len(w_axes), q, module, name)
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                      preferred_element_type=preferred_element_type)


RANK_INPUT = "_rank"  # a factorized product's second input, x U: its name + this


def _factored_product(module: nn.Module, name: str, n_contract: int, x, w: Factored,
                      q: QuantConfig, *, kind: str, dtype, preferred_element_type=None,
                      bias=None, epilogue: Epilogue = Epilogue()):
    """qeinsum of a `Factored` weight (model.lowrank): x U, then (x U) V, then + bias and the
    epilogue. Under `q`'s quantization of `kind` each factor is a product of its own: U and
    V quantized per output channel like any product weight (U [K, r] per rank column, V [r,
    N] per output), x and x U quantized as product inputs (per token, or by their own
    calibrated ranges: `name` and `name + RANK_INPUT`). In export (`qexport`) both factors
    are packed, a Factored of two QWeights at the weight's path; in `ptq.serve`'s pass each
    packed factor an integer kernel computes is prepared for it (`prepare`)."""
    lead = x.shape[:x.ndim - n_contract]
    quantized = q.applies(kind)
    if _mutable(module, "qserve") and any(isinstance(f, QWeight) for f in (w.u, w.v)):
        module.put_variable("qserve", name, Factored(
            *(prepare(f, q) if isinstance(f, QWeight) else f for f in (w.u, w.v))))
    t = x.reshape(-1, math.prod(x.shape[len(lead):]))
    packed = []
    for factor, k_dims, act_name in ((w.u, n_contract, name), (w.v, 1, name + RANK_INPUT)):
        last = factor is w.v
        if isinstance(factor, Served):  # its kernel quantizes t itself, as q says
            t = served_product(t, factor, 1, dtype, bias if last else None,
                               epilogue if last else Epilogue())
            continue
        if quantized:
            t = quant_act(module, act_name, t, (-1,), q)
        if isinstance(factor, QWeight):
            f_KN = factor.dequantize()
        elif quantized:
            if q.weights != "none" and _mutable(module, "qexport"):
                packed.append(pack_weight(factor, q, k_dims))
            f_KN = quant_weight(factor, k_dims, q)
        else:
            f_KN = factor
        t = float_product(t.astype(dtype), _weight_KxN(f_KN, k_dims).astype(dtype), None, 1,
                          preferred_element_type)
        if last:  # the epilogue on the output's own shape: its bias gradient sums over lead
            t = epilogue.apply(t.reshape(lead + tuple(w.v.shape[1:])), bias)
    if len(packed) == 2:
        module.put_variable("qexport", name, Factored(*packed))
    return t.reshape(lead + tuple(w.v.shape[1:]))


class Dense(nn.Module):
    """`flax.linen.Dense` (same `kernel` [in, out] and `bias` params and initializers) whose
    product is a `qeinsum` of kind `kind`."""

    features: int
    quant: QuantConfig = QuantConfig()
    kind: str = "mlp"
    dtype: object = jnp.float32
    param_dtype: object = jnp.float32
    kernel_init: object = nn.initializers.lecun_normal()
    bias_init: object = nn.initializers.zeros_init()
    epilogue: Epilogue = Epilogue()  # the activation after the bias, if any

    @nn.compact
    def __call__(self, x):
        kernel = param(self, "kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        return qeinsum(self, "kernel", "...k,kn->...n", x, kernel, self.quant, kind=self.kind,
                       dtype=self.dtype, bias=bias.astype(self.dtype), epilogue=self.epilogue)


def float_bytes(tree) -> int:
    """Bytes of a parameter tree in float32, 4 a parameter whatever dtype its arrays are
    stored in: the summaries' `float32_params`, which their ratios compare against (a review:
    a model.param_dtype='bfloat16' run reported half, and its int8 export a ratio of ~2)."""
    return 4 * int(sum(np.prod(np.shape(a), dtype=np.int64) for a in jax.tree.leaves(tree)))
