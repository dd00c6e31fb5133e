"""Rare events: a verse's book (66 classes, most with 2-5 train verses), with and without the
key-value memory of Kaiser et al. 2017 ("Learning to Remember Rare Events").

    python -m hpnlp.main --config experiments/rare_events.py:memory --workdir /tmp/hpnlp/rare_memory
    python -m hpnlp.main --config experiments/rare_events.py:head --workdir /tmp/hpnlp/rare_head
    python -m hpnlp.main --config experiments/rare_events.py:memory,local --workdir /tmp/hpnlp/rare_smoke

Arguments (comma separated): `memory` (default) turns the memory on: the classifier's pooled
encoding is projected to a unit query that reads a memory of (key, book) slots, trained with
the memory's margin loss beside the head's cross-entropy, and `accuracy` scores the memory's
answer (the nearest key's book; `accuracy_head` is the head's); `head` is the same model
without a memory; `local` shrinks the run to a quick smoke test (big_vision's `runlocal`).
The task (hpnlp/data/rare_events.py): 10 frequent books keep 300 train verses each, the
other 56 keep 2-5; eval holds up to 20 verses of each book from held-out chapters.
`python -m hpnlp.bench retrieval` splits the accuracy into rare and frequent books.
"""

from hpnlp.config import default_configdict, experiment_args


def get_config(arg: str = "memory"):
    args = experiment_args(arg, file="experiments/rare_events.py", default=("memory",),
                           allowed=("memory", "head", "local"), exclusive=(("memory", "head"),))
    memory = "head" not in args
    cfg = default_configdict()
    cfg.name = "rare_events_memory" if memory else "rare_events_head"

    cfg.data.task = "verse_book"  # see hpnlp/data/rare_events.py
    cfg.data.seq_len = 64  # words per verse (99% of verses fit)
    cfg.data.word_vocab_size = 8000  # most frequent words of the train chapters; rest -> <unk>
    cfg.data.batching = "bucket"  # verses are short: rows padded to the nearest bucket

    cfg.model.kind = "classifier"
    cfg.model.width = 128  # d_model
    cfg.model.depth = 2  # Transformer blocks
    cfg.model.num_heads = 4
    cfg.model.mlp_dim = 256
    cfg.model.dropout = 0.1
    cfg.model.max_len = 64  # learned position table; >= data.seq_len
    cfg.model.pool = "mean"  # the head and the memory's query read the mean over words

    # The memory (hpnlp.retrieval.memory): slots enough for every train verse, so a rare
    # verse written once stays until it is the oldest of 4096 writes.
    cfg.model.memory.size = 4096 if memory else 0
    cfg.model.memory.key_dim = 64  # width of keys and queries
    cfg.model.memory.k = 16  # neighbours the margin loss looks at
    cfg.model.memory.margin = 0.1  # the paper's alpha
    cfg.model.memory.loss_weight = 1.0  # margin loss beside the head's cross-entropy
    cfg.model.memory.predict = "memory"  # `accuracy` scores the memory's answer

    cfg.attention.name = "dense"

    cfg.train.steps = 600  # ~6 epochs of the 3194 train verses
    cfg.train.batch_size = 32
    cfg.train.lr = 1e-3
    cfg.train.warmup_steps = 50
    cfg.train.schedule = "cosine"
    cfg.train.log_every = 50
    cfg.train.eval_every = 200
    cfg.train.eval_batches = 0  # the whole eval split (891 verses)
    cfg.train.checkpoint_every = 200

    if "local" in args:
        cfg.model.width = 64
        cfg.model.depth = 1
        cfg.model.num_heads = 2
        cfg.model.mlp_dim = 128
        if memory:
            cfg.model.memory.size = 512
        cfg.train.steps = 40
        cfg.train.warmup_steps = 5
        cfg.train.log_every = 10
        cfg.train.eval_every = 20
        cfg.train.eval_batches = 4
        cfg.train.checkpoint_every = 20
    return cfg
