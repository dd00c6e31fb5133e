"""Device meshes and logical-axis rules: the same model code on one CPU, a GPU or a pod."""

from hpnlp.parallel.mesh import DEFAULT_RULES, batch_sharding, make_mesh, state_shardings  # noqa: F401
