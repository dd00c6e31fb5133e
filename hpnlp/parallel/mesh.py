"""Mesh from the config, and logical axis names -> mesh axes.

Model code names its axes logically (`embed`, `heads`, `mlp`, `vocab`, `kv`, `layers` for
parameters; `batch`, `length`, `activation_*` for activations). `cfg.mesh.rules`
(default `hpnlp.config.DEFAULT_RULES`) maps them onto the mesh axes `data`, `fsdp`,
`tensor`, `sequence`, `pipeline`, `expert`: batch over data x fsdp, parameters' `embed`
dim over fsdp (ZeRO-3 style: gathered per layer by GSPMD), heads / MLP / vocab over
tensor (Megatron style), activations' length over sequence (ring attention), stacked
layers over pipeline. With every axis of size 1 this is plain single-device code.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hpnlp.config import DEFAULT_RULES as _DEFAULT_RULE_MAP, MESH_AXES, MeshConfig

AXES = MESH_AXES
DEFAULT_RULES = MeshConfig().rule_tuples()
assert dict(DEFAULT_RULES).keys() == _DEFAULT_RULE_MAP.keys()


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in AXES)
    if int(np.prod(shape)) != len(devices) or 0 in shape:  # else a reshape error naming no axis
        given = {a: getattr(mesh_cfg, a) for a in AXES if getattr(mesh_cfg, a) != 1}
        fixed = int(np.prod([v for v in given.values() if v != -1]))
        need = f"a multiple of {fixed}" if -1 in given.values() else str(fixed)
        raise ValueError(f"mesh {given} needs {need} devices and there are {len(devices)} "
                         f"({devices[0].platform}); set mesh sizes that "
                         f"multiply to {len(devices)} (one axis -1 fills the rest), or start JAX "
                         "with more devices")
    # Auto axes: GSPMD propagates shardings and logical constraints are hints, not asserts.
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def state_shardings(abstract_tree, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a (boxed, abstract) pytree from its logical partition specs."""
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Leading (batch) dimension split over the mesh axes the `batch` rule names."""
    axes = dict(rules).get("batch")
    return NamedSharding(mesh, P(axes))
