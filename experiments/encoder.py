"""A bi-encoder that embeds verses for search (hpnlp.models.bi_encoder) on `verse_pairs`:
each odd-numbered verse of a chapter (1st, 3rd, ...) is trained to find the verse after it
among all others.

    python -m hpnlp.main --config experiments/encoder.py --workdir /tmp/hpnlp/encoder
    python -m hpnlp.main --config experiments/encoder.py:bag --workdir /tmp/hpnlp/encoder_bag
    python -m hpnlp.main --config experiments/encoder.py:mine --workdir /tmp/hpnlp/encoder_mine
    python -m hpnlp.retrieval encoder --workdir /tmp/hpnlp/encoder   # recall@1/10, MRR on the held-out pool

Arguments (comma separated): `transformer` (default) | `lstm` | `bag` picks the encoder
(`bag`: StarSpace-style mean of byte embeddings, the cheap baseline); `triplet` trains with
the triplet margin loss instead of in-batch softmax; `mine` adds hard negatives mined from
the whole train pool every 100 steps; `batch_freq` | `corpus_freq` scale the embedding
gradients by inverse token frequency (model.embed_grad_scale); `local` shrinks the run to a
quick smoke test.
"""

from hpnlp.config import default_configdict, experiment_args

ARGS = ("transformer", "lstm", "bag", "triplet", "mine", "batch_freq", "corpus_freq", "local")


def get_config(arg: str = ""):
    args = experiment_args(arg, file="experiments/encoder.py", allowed=ARGS,
                           exclusive=(("transformer", "lstm", "bag"),
                                      ("batch_freq", "corpus_freq")))
    cfg = default_configdict()
    arch = "lstm" if "lstm" in args else "bag" if "bag" in args else "transformer"
    cfg.name = "encoder_" + arch

    cfg.data.task = "verse_pairs"
    cfg.data.seq_len = 128  # bytes per verse (longer ones are cut, as the batches cut them)
    cfg.data.batching = "pad"

    cfg.model.kind = "bi_encoder"
    cfg.model.arch = arch
    cfg.model.width = 128  # the search vectors' dimension
    cfg.model.depth = 2
    cfg.model.num_heads = 4
    cfg.model.mlp_dim = 512
    cfg.model.dropout = 0.1
    cfg.model.max_len = 128
    cfg.model.pool = "mean"
    cfg.model.encoder.loss = "triplet" if "triplet" in args else "in_batch"
    cfg.model.encoder.temperature = 0.05
    cfg.model.encoder.margin = 0.2
    if "mine" in args:
        cfg.name += "_mine"
        cfg.model.encoder.mine_every = 100
        cfg.model.encoder.mine_depth = 10
    if "triplet" in args:
        cfg.name += "_triplet"
    for a, scale in (("batch_freq", "batch"), ("corpus_freq", "corpus")):
        if a in args:
            cfg.name += "_" + a
            cfg.model.embed_grad_scale = scale

    cfg.train.steps = 600
    cfg.train.batch_size = 64  # 63 in-batch negatives per verse
    cfg.train.lr = 2e-3 if arch != "bag" else 1e-2
    cfg.train.warmup_steps = 50
    cfg.train.schedule = "cosine"
    cfg.train.log_every = 50
    cfg.train.eval_every = 300
    cfg.train.eval_batches = 10
    cfg.train.checkpoint_every = 300

    if "local" in args:
        cfg.model.width, cfg.model.mlp_dim = 32, 64
        cfg.data.seq_len = cfg.model.max_len = 32
        cfg.train.steps = 20
        cfg.train.batch_size = 16
        cfg.train.warmup_steps = 5
        cfg.train.log_every = cfg.train.eval_every = cfg.train.checkpoint_every = 10
        cfg.train.eval_batches = 2
        if "mine" in args:
            cfg.model.encoder.mine_every = 10
    return cfg
