"""Fast recurrent layers (LSTM, GRU) and recurrent dropout variants.

    from hpnlp import rnn
    layer = rnn.RNNLayer(kind="gru", hidden=256, bidirectional=True, variational_dropout=0.2)
    out_BLM, final = layer.apply(params, x_BLE, lengths_B, deterministic=False,
                                 rngs={"dropout": key})

See `hpnlp.rnn.cells` for the speed tricks, `hpnlp.rnn.dropout` for the dropout variants
and `python -m hpnlp.bench rnn` for the comparison with `flax.linen.RNN`.
"""

from hpnlp.rnn.cells import (StepInputs, flip_within_length, gru_step, lstm_step,  # noqa: F401
                             run_layer)
from hpnlp.rnn.dropout import (Dropout, RecurrentDropout, VariationalDropout,  # noqa: F401
                               WeightDrop, Zoneout, zoneout_mix)
from hpnlp.rnn.layers import (COMBINES, KINDS, RNNLayer, StackedRNN, from_flax_gru,  # noqa: F401
                              from_flax_lstm)
