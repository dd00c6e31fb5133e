"""hpnlp: fast neural NLP in JAX/Flax (see README.md).

    import hpnlp
    hpnlp.attention.names()      # attention variants, by registry name
    hpnlp.softmax.names()        # output layers over large vocabularies
    hpnlp.data.task_names()      # embedded tasks
    hpnlp.train.run(config, workdir)
"""

__version__ = "0.1.0"

from hpnlp import xla_workarounds as _xla_workarounds  # noqa: E402

_xla_workarounds.apply()  # before JAX reads XLA_FLAGS (docs/xla_defects.md)

from hpnlp import attention, config, data, models, softmax, train  # noqa: F401,E402
