"""Training: state, pure step, loop, checkpoints, metrics."""

from hpnlp.train.loop import NonFiniteLoss, Trainer, run  # noqa: F401
from hpnlp.train.state import TrainState, make_optimizer  # noqa: F401
from hpnlp.train.step import make_eval_step, make_train_step  # noqa: F401
