"""Mesh from the config, and logical axis names -> mesh axes.

Model code names its axes logically (`embed`, `heads`, `mlp`, `vocab`, `kv`, `layers` for
parameters; `batch`, `length`, `activation_*` for activations). `cfg.mesh.rules`
(default `hpnlp.config.DEFAULT_RULES`) maps them onto the mesh axes `data`, `fsdp`,
`tensor`, `sequence`, `pipeline`, `expert`: batch over data x fsdp x expert, parameters'
`embed` dim over fsdp (ZeRO-3 style: gathered per layer by GSPMD), heads / MLP / vocab over
tensor (Megatron style), activations' length over sequence (ring attention), stacked
layers over pipeline, MoE experts over expert. With every axis of size 1 this is plain
single-device code.
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
    from hpnlp import xla_workarounds
    xla_workarounds.guard_cache()  # devices asked for after `import hpnlp` (review, s117)
    devices = jax.devices() if devices is None else devices
    sizes = mesh_cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in AXES)
    if int(np.prod(shape)) != len(devices) or 0 in shape:  # else a reshape error naming no axis
        given = {a: getattr(mesh_cfg, a) for a in AXES if getattr(mesh_cfg, a) != 1} or {
            "data": 1}  # all ones reads as data 1, not {} (review r3)
        fixed = int(np.prod([v for v in given.values() if v != -1]))
        need = f"a multiple of {fixed}" if -1 in given.values() else str(fixed)
        raise ValueError(f"mesh {given} needs {need} devices and there are {len(devices)} "
                         f"({devices[0].platform}); set mesh sizes that "
                         f"multiply to {len(devices)} (one axis -1 fills the rest), or start JAX "
                         "with more devices")
    # Auto axes: GSPMD propagates shardings and logical constraints are hints, not asserts.
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def state_shardings(abstract_tree, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a (boxed, abstract) pytree from its logical partition specs. A
    dimension the mesh axes of its rule do not divide is replicated instead: `validate`
    checks the model's own sizes (heads, MLP, vocabulary...) and names the field, but not
    the sizes a layer derives from the data when it is built (an adaptive softmax's head
    and clusters, cut at token frequencies), which would fail in `device_put`."""
    specs = nn.get_partition_spec(abstract_tree)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    return jax.tree.map(_dividing, shardings, unboxed(abstract_tree),
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def unboxed(tree):
    """`tree` without its logical-axis boxes (and without the sharding constraints that
    `nn.unbox` adds)."""
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if boxed(x) else x, tree,
                        is_leaf=boxed)


def _dividing(sharding: NamedSharding, leaf) -> NamedSharding:
    """`sharding` without the mesh axes of any dimension of `leaf` they do not divide."""
    shape = getattr(leaf, "shape", ())
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    changed = False
    for i, axes in enumerate(spec[:len(shape)]):
        if axes is None:
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if shape[i] % int(np.prod([sharding.mesh.shape[a] for a in names])):
            spec[i], changed = None, True
    return NamedSharding(sharding.mesh, P(*spec[:len(shape)])) if changed else sharding


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Leading (batch) dimension split over the mesh axes the `batch` rule names."""
    axes = dict(rules).get("batch")
    return NamedSharding(mesh, P(axes))
