"""Registry of output layers (see `hpnlp.softmax`)."""

from __future__ import annotations

_REGISTRY: dict[str, type] = {}


def register(name: str):
    def wrap(cls):
        if name in _REGISTRY:
            raise ValueError(f"output layer {name!r} is registered twice")
        cls.registry_name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown output layer {name!r}; choose one of {names()}") from None


def check_targets(targets, vocab_size: int) -> None:
    """Static check: targets must be integer ids (values are checked by the data layer)."""
    import jax.numpy as jnp
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
