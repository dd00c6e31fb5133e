"""Mesh from the config, and logical axis names -> mesh axes.

Model code names its axes logically (`embed`, `heads`, `mlp`, `vocab`, `kv` for
parameters; `batch`, `length`, `activation_*` for activations). `DEFAULT_RULES` maps them
onto the mesh axes `data`, `fsdp`, `tensor`: batch over data x fsdp, parameters' `embed`
dim over fsdp (ZeRO-3 style: gathered per layer by GSPMD), heads / MLP / vocab over
tensor (Megatron style). With every axis of size 1 this is plain single-device code.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hpnlp.config import MeshConfig

AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
)


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in AXES)
    # Auto axes: GSPMD propagates shardings and logical constraints are hints, not asserts.
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def state_shardings(abstract_tree, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a (boxed, abstract) pytree from its logical partition specs."""
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp; the rest replicated."""
    return NamedSharding(mesh, P(("data", "fsdp")))
