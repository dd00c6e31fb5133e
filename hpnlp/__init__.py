"""hpnlp: fast neural NLP in JAX/Flax (see README.md)."""

__version__ = "0.1.0"
