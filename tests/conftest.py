"""Test settings: CPU only, strict rank promotion (catches silent broadcasting bugs)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer tests (still CPU); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "accelerator: needs a GPU/TPU; skipped on CPU")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "cpu":
        skip = pytest.mark.skip(reason="needs an accelerator")
        for item in items:
            if "accelerator" in item.keywords:
                item.add_marker(skip)

from absl import logging as absl_logging  # noqa: E402

absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
