"""`xla`: `jax.nn.dot_product_attention`, JAX's own fused attention call.

Padding travels as per-row lengths (`query_seq_lengths` / `key_value_seq_lengths`), the
only mask form the call takes without a dense [L, L] matrix. So this variant assumes
right padding (one segment per row) and refuses packed batches at config time. On a GPU
the same call can take `implementation="cudnn"`, in bfloat16 or float16 at head dims that
are multiples of 8 up to 128 (256 on Hopper), jax's limits, which `cannot_run_here` checks.

Exact in float32. In bfloat16 the call takes its softmax in float32 but rounds the
probabilities to bfloat16 before their product with the values (jax's reference path,
`probs.astype(key.dtype)`), where `dense` keeps the probabilities and that product in float32
and rounds once at the end: one more rounding of every probability, about 2^-9 relative (a
review, session 108). Kept: this variant is JAX's call as JAX makes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.config import config_error


@register("xla")
class XlaAttention(Attention):
    """`jax.nn.dot_product_attention` (XLA's fused softmax attention) behind the hpnlp interface."""

    heads_independent = True

    implementation: str | None = None  # None: let JAX choose; "xla" or "cudnn" to force
    supports_segments = False

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        """`implementation`: None, "xla", or "cudnn" (a README walk: another name failed after
        the data was built, naming no field; cudnn off a GPU: `cannot_run_here`)."""
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        impl = options.get("implementation")
        if impl not in (None, "xla", "cudnn"):
            raise config_error(f"{field}.implementation", impl, "choose 'xla', 'cudnn' (a GPU) "
                               "or leave it unset (None: JAX chooses)")

    @classmethod
    def cannot_run_here(cls, options, *, head_dim, num_devices, dtype):
        """(option, portable value, why, fix) where `options` ask for cuDNN and it cannot run
        here: JAX runs on no GPU, or the compute `dtype` or `head_dim` is one cuDNN's attention
        refuses; else None. `validate` refuses it for a run it trains (with the devices), and a
        run read here computes the same function by XLA's implementation (a bug hunt, session
        100: a GPU run's config was refused by every reader). A review (r14): float32, the
        default model.dtype, passed validate on a GPU and failed at the model's first trace
        (jax's `check_layout`), naming no config field."""
        if options.get("implementation") != "cudnn":
            return None
        unset = "choose 'xla' or leave it unset"
        if jax.default_backend() != "gpu":
            return ("implementation", "xla", f"cuDNN runs on a GPU, and JAX runs on the "
                    f"{jax.default_backend()}", unset)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return ("implementation", "xla", f"cuDNN's attention takes bfloat16 or float16, "
                    f"and model.dtype={jnp.dtype(dtype).name!r} computes in "
                    f"{jnp.dtype(dtype).name}", f"set model.dtype='bfloat16', or {unset}")
        from hpnlp.attention.flash_gpu import compute_capability
        capability = compute_capability()
        if capability is None:  # a review (session 115): a ROCm GPU was taken, and JAX's
            # cuDNN path failed at the first trace ("cuDNN is not detected")
            return ("implementation", "xla", "cuDNN runs on an NVIDIA GPU, and this GPU has "
                    "no CUDA compute capability", unset)
        widest = 256 if capability >= (9, 0) else 128  # Hopper: 256 (jax)
        if head_dim % 8 or head_dim > widest:
            return ("implementation", "xla", f"cuDNN's attention on this GPU takes head dims "
                    f"that are multiples of 8 up to {widest}, and the model's is {head_dim}",
                    f"set model.head_dim (or model.width / model.num_heads) to one, or {unset}")
        return None

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        if v.shape[-1] != k.shape[-1]:  # JAX's own error names neither the variant nor a fix
            raise ValueError(f"attention variant 'xla' (jax.nn.dot_product_attention) needs v's "
                             f"head dim equal to k's: k{k.shape} v{v.shape}; use 'dense' or "
                             "'chunked' for a separate value head dim")
        lengths = None if mask is None else jnp.sum(mask != 0, axis=-1).astype(jnp.int32)
        dtype = q.dtype
        if dtype == jnp.float16 and jax.default_backend() == "cpu":
            # float16 asks XLA for float16 x float16 -> float32 products, which XLA:CPU does
            # not have (jitted: "precision 'F16_F16_F32' is not supported"); float32 copies
            # hold every float16 exactly, and the output is cast back
            q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation=self.implementation).astype(dtype)
        if lengths is not None:
            # Padding queries: the reference gives zeros; XLA gives an average. Match it.
            valid = (jnp.arange(q.shape[1])[None, :] < lengths[:, None])[:, :, None, None]
            out = jnp.where(valid, out, 0)
        return out
