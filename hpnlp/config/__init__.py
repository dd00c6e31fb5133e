"""Experiment configs: an `ml_collections.ConfigDict` becomes frozen dataclasses here, once.

Every experiment file in `experiments/` returns a ConfigDict with the groups below
(`model`, `attention`, `output`, `train`, `data`, `mesh`). `from_configdict` turns it into
a `Config` (`fields.py`: every group and field) and `validate` checks it against the task
and the devices *before* anything is compiled (`checks.py`), so a bad field fails in a
second with a message that names the field, the bad value and what is allowed.

Eval variants are `dataclasses.replace(cfg.model, dropout=0.0)`; nothing mutates a config.
"""

from hpnlp.config.checks import check_moe_fields, validate
from hpnlp.config.fields import (DEFAULT_RULES, DTYPES, ENCODER_LOSSES, LOWRANK_LAYERS,
                                 MEMORY_PREDICTIONS, MESH_AXES, MOE_ROUTERS, QUANT_LAYERS,
                                 REMAT_NAMES, AttentionConfig, Config, ConfigError, DataConfig,
                                 DistillConfig, EncoderConfig, LowRankConfig, MemoryConfig,
                                 MeshConfig, ModelConfig, MoEConfig, OutputConfig, PruneConfig,
                                 QuantConfig, RNNConfig, TrainConfig, config_error,
                                 default_configdict, experiment_args, from_configdict,
                                 layers_name, to_json, with_absolute_paths)

__all__ = [
    "AttentionConfig", "Config", "ConfigError", "DataConfig", "DistillConfig", "EncoderConfig",
    "LowRankConfig", "MemoryConfig", "MeshConfig", "ModelConfig", "MoEConfig", "OutputConfig",
    "PruneConfig", "QuantConfig", "RNNConfig", "TrainConfig",
    "DEFAULT_RULES", "DTYPES", "ENCODER_LOSSES", "LOWRANK_LAYERS", "MEMORY_PREDICTIONS",
    "MESH_AXES", "MOE_ROUTERS", "QUANT_LAYERS", "REMAT_NAMES",
    "check_moe_fields", "config_error", "default_configdict", "experiment_args",
    "from_configdict", "layers_name", "to_json", "validate", "with_absolute_paths",
]
