"""Training: state, pure step, loop, checkpoints, metrics."""

from hpnlp.train.state import TrainState, make_optimizer  # noqa: F401
from hpnlp.train.step import make_eval_step, make_train_step  # noqa: F401

_LOOP = ("Interrupted", "NonFiniteLoss", "Trainer", "run")


def __getattr__(name):
    # The loop (and Orbax, ~0.4 s to import) loads on first use, so a process that only
    # builds steps, such as a benchmark worker, does not pay for checkpointing.
    if name in _LOOP:
        from hpnlp.train import loop
        return getattr(loop, name)
    raise AttributeError(f"module 'hpnlp.train' has no attribute {name!r}")
