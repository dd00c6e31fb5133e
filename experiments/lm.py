"""Causal Transformer LM on the shipped KJV corpus, byte or word level.

The default experiment (README's first command) is the byte-level one:

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/hpnlp/lm_bytes
    python -m hpnlp.main --config experiments/lm.py:words --workdir /tmp/hpnlp/lm_words
    python -m hpnlp.main --config experiments/lm.py:bpe --workdir /tmp/hpnlp/lm_bpe
    python -m hpnlp.main --config experiments/lm.py:bytes,local \\
        --workdir /tmp/hpnlp/lm_smoke  # ~30 s
    python -m hpnlp.main --config experiments/lm.py:bytes,moe --workdir /tmp/hpnlp/lm_moe
    python -m hpnlp.main --config experiments/lm.py:bytes,compressive --workdir /tmp/hpnlp/lm_comp

Arguments (comma separated): `bytes` | `words` | `bpe` | `unigram` picks the tokenization
(`bpe`, `unigram`: SentencePiece subwords, 8K pieces, trained on the training split and kept
in the workdir; `--config.data.vocab_size=N` changes the size, `--config.data.prepared=DIR`
reads a corpus prepared by `python -m hpnlp.data.prepare`); `moe` makes every
block's MLP a Switch mixture of 8 experts of the same width (hpnlp.moe: 8x the MLP
parameters, the same compute per token); `compressive` makes it a Compressive Transformer
(Rae et al. 2020: Transformer-XL on stream batches whose evicted memory is compressed 4 to 1
by a learned convolution into a second memory, models/transformer_xl.py; not with `moe`,
whose experts route the MLPs of plain Transformer blocks only); `local` shrinks
the run to a quick smoke test (big_vision's `runlocal`).
"""

from hpnlp.config import default_configdict, experiment_args

TOKENIZATIONS = ("bytes", "words", "bpe", "unigram")


def get_config(arg: str = "bytes"):
    args = experiment_args(arg, file="experiments/lm.py", default=("bytes",),
                           allowed=(*TOKENIZATIONS, "moe", "compressive", "local"),
                           exclusive=(TOKENIZATIONS, ("moe", "compressive")))
    words = "words" in args
    subword = next((a for a in ("bpe", "unigram") if a in args), None)
    cfg = default_configdict()
    cfg.name = "lm_words" if words else f"lm_{subword}" if subword else "lm_bytes"

    cfg.data.task = "word_lm" if words else "byte_lm"
    cfg.data.seq_len = 128  # tokens per training row
    cfg.data.batching = "pack"  # documents packed into rows with segment ids: no padding waste
    if words:  # (only words read it: a new run is refused it under bytes or subwords)
        cfg.data.word_vocab_size = 8000  # most frequent kept, the rest -> <unk>
    if subword:
        cfg.data.tokenizer = subword
        cfg.data.vocab_size = 8000  # pieces

    cfg.model.kind = "lm"
    cfg.model.width = 128  # d_model
    cfg.model.depth = 2  # Transformer blocks
    cfg.model.num_heads = 4
    cfg.model.mlp_dim = 512
    cfg.model.dropout = 0.0  # the corpus is large relative to this model and run
    cfg.model.max_len = 128  # learned position table; >= data.seq_len

    cfg.attention.name = "dense"  # see hpnlp.attention.names()
    cfg.output.name = "full"  # see hpnlp.softmax.names()
    cfg.output.tie_embeddings = True

    cfg.train.steps = 800  # 1 to 3.5 minutes on a 2-core CPU (README, first command)
    cfg.train.batch_size = 32
    cfg.train.lr = 3e-3
    cfg.train.warmup_steps = 100
    cfg.train.schedule = "cosine"
    cfg.train.log_every = 50
    cfg.train.eval_every = 400
    cfg.train.eval_batches = 25  # 25 x 32 rows x 128 tokens = 100K held-out tokens
    cfg.train.checkpoint_every = 200

    if "moe" in args:  # Switch Transformer (Fedus et al. 2021) at this size
        cfg.name += "_moe"
        cfg.model.moe.num_experts = 8
        cfg.model.moe.every = 1  # two blocks: both MoE (Switch: every other of many)
        cfg.model.moe.top_k = 1
        cfg.model.moe.router = "switch"
        cfg.model.moe.capacity_factor = 1.25
        cfg.model.moe.balance_loss = 0.01
        cfg.model.moe.z_loss = 0.001

    if "compressive" in args:  # Rae et al. 2020, at this size
        cfg.name += "_compressive"
        cfg.model.arch = "transformer_xl"  # relative positions, segment memory
        cfg.data.batching = "stream"  # row b of each batch continues row b of the last one
        cfg.model.mem_len = 128  # memory: the previous segment's layer inputs
        cfg.model.comp_mem_len = 128  # compressed slots: 4 x 128 = 512 more tokens back
        cfg.model.comp_rate = 4  # divides data.seq_len and mem_len
        cfg.model.comp_fn = "conv"  # learned, trained by the attention-reconstruction loss only
        cfg.model.comp_loss_weight = 1.0

    if "local" in args:
        cfg.train.steps = 60
        cfg.train.warmup_steps = 10
        cfg.train.log_every = 10
        cfg.train.eval_every = 30
        cfg.train.eval_batches = 4
        cfg.train.checkpoint_every = 30
    return cfg
