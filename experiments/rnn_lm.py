"""Word-level LSTM (or GRU) LM on the shipped KJV corpus, with the classic tricks as switches.

    python -m hpnlp.main --config experiments/rnn_lm.py --workdir /tmp/hpnlp/rnn_lm
    python -m hpnlp.main --config experiments/rnn_lm.py:layer_norm,zoneout --workdir /tmp/hpnlp/rnn_ln_zo
    python -m hpnlp.main --config experiments/rnn_lm.py:gru,local \\
        --workdir /tmp/hpnlp/rnn_smoke  # ~30 s
    python -m hpnlp.bench rnn --quality --out /tmp/hpnlp/rnn_quality  # every trick, same steps

Arguments (comma separated, any combination): `gru` (default LSTM); tricks `layer_norm`,
`variational` (variational dropout of inputs/outputs and of the recurrent state, Gal &
Ghahramani), `recurrent` (recurrent dropout of the cell update, Semeniuta et al.),
`zoneout` (Krueger et al.), `weight_drop` (DropConnect on the recurrent matrix, AWD-LSTM);
`local` shrinks the run to a smoke test.
"""

from hpnlp.config import default_configdict, experiment_args

TRICKS = ("layer_norm", "variational", "recurrent", "zoneout", "weight_drop")


def get_config(arg: str = ""):
    args = experiment_args(arg, file="experiments/rnn_lm.py", allowed=("gru", "local", *TRICKS))
    cfg = default_configdict()
    cfg.name = "rnn_lm" + "".join(f"_{a}" for a in sorted(args - {"local"}))

    cfg.data.task = "word_lm"
    cfg.data.seq_len = 64  # tokens per row (truncated backpropagation length)
    cfg.data.batching = "pack"  # a packed row is read as one stream (see models/recurrent.py)
    cfg.data.word_vocab_size = 8000

    cfg.model.kind = "lm"
    cfg.model.arch = "gru" if "gru" in args else "lstm"
    cfg.model.width = 128  # embedding and hidden size
    cfg.model.depth = 2  # recurrent layers
    cfg.model.dropout = 0.0  # standard dropout of embeddings and between layers
    cfg.model.max_len = 64

    cfg.rnn.combine = "last"
    cfg.rnn.layer_norm = "layer_norm" in args
    if "variational" in args:
        cfg.rnn.variational_dropout = 0.2
        cfg.rnn.state_dropout = 0.1
    if "recurrent" in args:
        cfg.rnn.recurrent_dropout = 0.1
    if "zoneout" in args:
        cfg.rnn.zoneout = 0.1
    if "weight_drop" in args:
        cfg.rnn.weight_drop = 0.2

    cfg.output.name = "full"
    cfg.output.tie_embeddings = True

    cfg.train.steps = 600
    cfg.train.batch_size = 32
    cfg.train.lr = 3e-3
    cfg.train.warmup_steps = 50
    cfg.train.schedule = "cosine"
    cfg.train.clip_norm = 1.0  # the norm and its range are logged each log window
    cfg.train.log_every = 50
    cfg.train.eval_every = 300
    cfg.train.eval_batches = 25
    # 3 checkpoints (200, 400, 600), so `python -m hpnlp.train.ensemble ... --from_checkpoints 3`
    # (README) finds the last 3; at 300 the run kept only 2 and that command was refused.
    cfg.train.checkpoint_every = 200
    cfg.train.keep_checkpoints = 3  # checkpoint ensembles average the last K

    if "local" in args:
        cfg.train.steps = 40
        cfg.train.warmup_steps = 5
        cfg.train.log_every = 10
        cfg.train.eval_every = 20
        cfg.train.eval_batches = 4
        cfg.train.checkpoint_every = 10  # 4 checkpoints: --from_checkpoints 3 works here too
    return cfg
