"""Registry of output layers (see `hpnlp.softmax`)."""

from __future__ import annotations

import jax.numpy as jnp

from hpnlp.registry import Registry

_REGISTRY = Registry("output layer")
register = _REGISTRY.register
names = _REGISTRY.names
get = _REGISTRY.get


def check_targets(targets) -> None:
    """Static check: targets must be integer ids (values are checked by the data layer)."""
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
