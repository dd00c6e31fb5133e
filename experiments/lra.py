"""Long Range Arena style encoder tasks on embedded data: ListOps, byte-level document
classification (the "text" task) and byte-level document matching (the "retrieval" task).

    python -m hpnlp.main --config experiments/lra.py:listops --workdir /tmp/hpnlp/listops
    python -m hpnlp.main --config experiments/lra.py:text --workdir /tmp/hpnlp/text
    python -m hpnlp.main --config experiments/lra.py:retrieval --workdir /tmp/hpnlp/retrieval
    python -m hpnlp.main --config experiments/lra.py:listops,local \\
        --workdir /tmp/hpnlp/listops_smoke
    (`lra.py:local` is ListOps' small preset)

Swap attention with `--config.attention.name=NAME` (see hpnlp.attention.names()); every
variant runs with the same model size and steps, as LRA compares them.
"""

from hpnlp.config import default_configdict, experiment_args

TASKS = {
    # arg: (data.task, model.kind, seq_len)
    "listops": ("listops", "classifier", 512),
    "text": ("doc_classify", "classifier", 1024),
    "retrieval": ("doc_match", "dual_encoder", 1024),
}


def get_config(arg: str = "listops"):
    # a task and `local`, in any order; `local` alone is ListOps' (a bug hunt: it was read
    # as an unknown task)
    args = experiment_args(arg, file="experiments/lra.py", allowed=(*TASKS, "local"),
                           exclusive=(tuple(TASKS),))
    name = next((t for t in TASKS if t in args), "listops")
    task, kind, seq_len = TASKS[name]
    cfg = default_configdict()
    cfg.name = f"lra_{name}"

    cfg.data.task = task
    cfg.data.seq_len = seq_len  # bytes (text, retrieval) or ListOps tokens per example
    cfg.data.batching = "bucket" if name == "listops" else "pad"  # ListOps lengths vary widely
    listops = name == "listops"  # (the generator's fields are refused to the other tasks)
    if listops:
        cfg.data.listops_max_length = seq_len

    cfg.model.kind = kind
    cfg.model.width = 128
    cfg.model.depth = 2
    cfg.model.num_heads = 4
    cfg.model.mlp_dim = 256
    cfg.model.dropout = 0.1
    cfg.model.max_len = seq_len
    cfg.model.pool = "mean"  # over real tokens

    cfg.attention.name = "dense"

    cfg.train.steps = 2000
    cfg.train.batch_size = 32
    cfg.train.lr = 1e-3
    cfg.train.warmup_steps = 200
    cfg.train.log_every = 50
    cfg.train.eval_every = 500
    cfg.train.checkpoint_every = 500

    if "local" in args:
        cfg.data.seq_len = 128
        if listops:
            cfg.data.listops_max_length = 128
            cfg.data.listops_num_train = 512
            cfg.data.listops_num_eval = 128
        cfg.model.max_len = 128
        cfg.train.steps = 40
        cfg.train.warmup_steps = 5
        cfg.train.log_every = 10
        cfg.train.eval_every = 20
        cfg.train.eval_batches = 4
        cfg.train.checkpoint_every = 20
    return cfg
