"""The config's groups as frozen dataclasses, each field commented, and the one conversion
from an experiment's `ml_collections.ConfigDict` (`from_configdict`) and back to JSON
(`to_json`, a run's config.json). The checks of what may run are `hpnlp.config.checks`."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Mapping

import flax.core
import ml_collections
import numpy as np


class ConfigError(ValueError):
    """A config field has a value hpnlp cannot run. The message names field, value and fix."""


def config_flag(field: str, text: str) -> str:
    """`--config.FIELD=TEXT` as a shell takes it: quoted where TEXT holds parentheses or
    spaces (a review, session 115: `--config.data.bucket_boundaries=(128, 256)` pasted was a
    bash syntax error)."""
    flag = f"--config.{field}={text}"
    return f"'{flag}'" if any(c in text for c in "() ") and "'" not in text else flag


def config_error(field: str, value: Any, allowed: str) -> ConfigError:
    """The error for one bad field, in the words every config check uses."""
    return ConfigError(f"config field `{field}` = {value!r} is not allowed: {allowed}")


def to_json(cfg: "Config") -> dict:
    """The config as plain JSON (option and rule mappings as objects), which
    `from_configdict` reads back: a run's config.json."""
    return as_json(dataclasses.asdict(cfg))


def as_json(v):
    """`v` as JSON reads it back: mappings at any depth (FrozenDicts too) as objects, tuples
    as lists, numpy scalars as their Python numbers, anything else JSON lacks as its str."""
    def plain(v):
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.generic):  # a review (session 117): an option's np.int64 was
            # written as the string "3", which every reader of config.json then refused
            return v.item()
        return v
    return json.loads(json.dumps(plain(v), default=str))


# DataConfig fields naming a file or folder that the run's readers open again (a resume,
# generate, hpnlp.compress): a training run's config.json holds them absolute (a bug hunt,
# session 98: a run trained from data.prepared='p1' was read from another directory as a
# folder "moved or deleted")
DATA_PATH_FIELDS = ("train_path", "eval_path", "prepared")


def same_data_path(saved: Any, now: Any) -> bool:
    """Whether a DATA_PATH_FIELDS value a run saved (relative before session 98, read from
    the current directory) names the file `now` does."""
    return (isinstance(saved, str) and isinstance(now, str) and bool(saved)
            and os.path.abspath(saved) == os.path.abspath(now))


def with_absolute_paths(cfg: "Config") -> "Config":
    """`cfg` with its DATA_PATH_FIELDS made absolute (from the current directory)."""
    given = {f: getattr(cfg.data, f) for f in DATA_PATH_FIELDS}
    absolute = {f: os.path.abspath(v) for f, v in given.items() if v and not os.path.isabs(v)}
    return (dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **absolute))
            if absolute else cfg)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise config_error(field, value, allowed)


def _check_choice(field: str, value: Any, choices) -> None:
    if value not in choices:
        _fail(field, value, f"choose one of {sorted(choices)}")


def _check_positive(field: str, value: Any, *, allow_zero: bool = False) -> None:
    # finite: a bug hunt (session 90) ran train.loss_scale_init=inf to the end, every step
    # skipped, and train.lr=inf stopped only at its first step, the workdir written
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        _fail(field, value, "must be a finite number " + (">= 0" if allow_zero else "> 0"))




# float16 compute turns on dynamic loss scaling (train.loss_scale_*); bfloat16 needs none.
DTYPES = ("float32", "bfloat16", "float16")

# Block activations `model.remat = "names:a,b"` can keep (see models.transformer.Block).
REMAT_NAMES = ("qkv", "context", "attention_out", "mlp_in")


# Products `quant.layers` names (hpnlp.compress.qlinear): the Transformer's fused QKV
# projection, attention output projection, MLP, output layer (and tied embedding),
# classifier / dual-encoder heads, and the LSTM/GRU input projection and recurrent product.
QUANT_LAYERS = ("qkv", "out", "mlp", "output", "head", "input", "recurrent")


def layers_name(layers: str, kind: str) -> bool:
    """Whether a `layers` field ("all" or a comma list of product kinds) names `kind`."""
    return layers == "all" or kind in (n.strip() for n in layers.split(","))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Quantization of the model's matrix products (hpnlp.compress; `quant.*` on any
    experiment). Set on a training run it is quantization-aware training: fake
    quantization in the forward pass, straight-through gradients, float shadow weights.
    `python -m hpnlp.compress quantize` applies it after training (PTQ)."""

    # "none" | "int8" | "int4" | "fp8" | "binary" | "ternary" | "pow2" (hpnlp.compress.formats):
    # per-output-channel scales (int4: per group of `group_size` along the contraction).
    weights: str = "none"
    # "none" | "int8" | "fp8" | "binary" (XNOR-Net: with binary weights)
    activations: str = "none"
    # "dynamic": a scale per token, from the token itself | "static": one calibrated range
    # per product (PTQ calibration: hpnlp.compress.ptq)
    act_scale: str = "dynamic"
    group_size: int = 0  # int4 weights: scale groups along the contraction; 0 = per channel
    # Weight clipping range per channel: "absmax" | "percentile" | "mse" (calibrate.py); PTQ
    # uses the same methods for static activation ranges.
    calibration: str = "absmax"
    percentile: float = 99.99  # for calibration = "percentile"
    # Which products: "all" or a comma list of QUANT_LAYERS (e.g. "qkv,out,mlp" keeps the
    # output layer in float, as low-bit recipes usually do).
    layers: str = "all"
    # The key/value cache decoding keeps (generate, speculative decoding): "none" (the model's
    # dtype) | "int8" (codes with a float32 scale per position and key/value head, read by the
    # cache kernel at a quarter of float32's bytes; attention/cache_cpu.py). The forward pass
    # (training, eval) then sees keys and values as that cache holds them (fake quantization,
    # straight-through gradients); weights are unchanged, so a float run can decode with it
    # (`generate --kv-cache int8`) and evaluate what that costs.
    kv_cache: str = "none"

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.activations != "none"

    def applies(self, kind: str) -> bool:
        """Whether products of this kind (a QUANT_LAYERS name) are quantized."""
        return self.enabled and layers_name(self.layers, kind)


# products model.lowrank can factorize: the Transformer's, classifier heads, the input
# embedding table (`embed`) and the output layer's vectors (`output`; a tied table is the
# output layer's weight)
LOWRANK_LAYERS = ("qkv", "out", "mlp", "head", "embed", "output")


@dataclasses.dataclass(frozen=True)
class LowRankConfig:
    """Low-rank factorization of product weights (hpnlp.compress.lowrank; `model.lowrank.*`):
    each chosen weight W [K, N] is a real two-product layer U [K, r] V [r, N]."""

    rank: int = 0  # r for every chosen weight; 0 = off (or `energy`)
    # Rank by kept energy: each weight's r is the smallest whose truncated SVD keeps this
    # fraction of sum(S^2) of the weight `train.init_from` holds; resolved when the run is
    # built into `ranks`, which config.json keeps (so a reload builds the same shapes)
    energy: float = 0.0
    ranks: Mapping[str, int] = dataclasses.field(default_factory=flax.core.FrozenDict)
    layers: str = "qkv,out,mlp"  # comma list of LOWRANK_LAYERS, or "all"

    def enabled(self) -> bool:
        return bool(self.rank or self.energy or self.ranks)

    def applies(self, kind: str) -> bool:
        return self.enabled() and layers_name(self.layers, kind)

    def rank_of(self, path: str) -> int:
        """The rank of the weight at `path` ("a/b/kernel")."""
        return int(self.ranks.get(path, self.rank))


MOE_ROUTERS = ("top_k", "switch", "expert_choice")  # hpnlp.moe.routing.ROUTERS


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (hpnlp.moe; `model.moe.*`): the chosen blocks' MLP becomes
    `num_experts` expert MLPs and a router that sends each token to `top_k` of them."""

    num_experts: int = 0  # X; 0 = off (every block keeps its dense MLP)
    every: int = 1  # MoE in every n-th block (blocks n-1, 2n-1, ...; 2 = Switch's every other)
    # experts per token (expert_choice: mean experts per token = top_k x capacity_factor,
    # padding and capacity's rounding aside)
    top_k: int = 1
    mlp_dim: int = 0  # each expert's hidden width; 0 = model.mlp_dim
    # "switch": top-1, gate = the router probability (Fedus et al. 2021) | "top_k": token
    # choice, gates = softmax over the k chosen logits (Shazeer et al. 2017; top_k >= 2) |
    # "expert_choice": each expert takes its top-C tokens (Zhou et al. 2022; it sees every
    # token of its routing group, so in a causal LM a token's route depends on later tokens)
    router: str = "switch"
    noisy: bool = False  # noisy top-k gating in training (Shazeer et al. 2017): + N(0,1) softplus(x W_noise)
    # "capacity": C = ceil(capacity_factor * S * top_k / X) slots per expert and routing group of
    # S tokens; choices past capacity are dropped (first choices before second choices, then in
    # token order) and pass through the residual (GShard, Switch) | "dropless": every choice is
    # computed (tokens sorted by expert, products over padded blocks; hpnlp.moe.dispatch)
    dispatch: str = "capacity"
    capacity_factor: float = 1.25  # training (and expert_choice's evaluation)
    # evaluation of token choice (decoding is always dropless); expert_choice evaluates at
    # capacity_factor, since its capacity is its routing
    eval_capacity_factor: float = 2.0
    shared_experts: int = 0  # experts every token uses besides its routed ones (DeepSeekMoE)
    balance_loss: float = 0.01  # weight of X * sum_i fraction_i * prob_i (Switch), per MoE layer
    z_loss: float = 0.001  # weight of mean logsumexp(router logits)^2 (ST-MoE)
    # Routing groups (capacity is per group): the batch's rows split into this many blocks;
    # 0 = one per data-parallel shard (what each device holds), as GShard's groups
    groups: int = 0
    # dropless dispatch (and a token-choice LM's decoding, dropless under either dispatch):
    # rows per padded block of one expert; 0 = automatic
    block_size: int = 0

    def enabled(self) -> bool:
        return self.num_experts > 0

    def applies(self, block: int) -> bool:
        """Whether Transformer block `block` (0-based) is an MoE block."""
        return self.enabled() and block % self.every == self.every - 1

    def expert_dim(self, m: "ModelConfig") -> int:
        return self.mlp_dim or m.mlp_dim


ENCODER_LOSSES = ("in_batch", "triplet")  # hpnlp.models.bi_encoder


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The bi-encoder (`model.kind = "bi_encoder"`, hpnlp.models.bi_encoder; `model.encoder.*`):
    texts embedded to unit vectors, trained to bring each pair's two sides together."""

    # "in_batch": softmax over the batch's other sides (and mined negatives) at `temperature`,
    # both directions averaged when `symmetric` | "triplet": max(0, margin + s(q, neg) - s(q, pos))
    # with neg the mined negative, or the hardest in-batch one when nothing is mined
    loss: str = "in_batch"
    temperature: float = 0.05
    symmetric: bool = True
    margin: float = 0.2
    # model.arch = "bag" (StarSpace-style bag of embeddings): "mean" | "sum", one model in
    # fact: every embedding is scaled to unit length, which a row's token count cancels
    bag: str = "mean"
    # Hard negatives mined from the whole train pool with hpnlp.retrieval's exact search every
    # `mine_every` steps (0: none), one per pair drawn from its `mine_depth` nearest non-positives.
    mine_every: int = 0
    mine_depth: int = 10


MEMORY_PREDICTIONS = ("memory", "head")  # what model.memory.predict may score as `accuracy`


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """The classifier's key-value memory with ages (Kaiser et al. 2017, "Learning to Remember
    Rare Events"; hpnlp.retrieval.memory; `model.memory.*`): a normalized projection of the
    pooled encoding queries S (key, label) slots, trained with the margin loss beside the
    head's, the memory updated every step by the paper's rule and kept in the train state."""

    size: int = 0  # S slots; 0 = off
    key_dim: int = 64  # width of the keys and queries
    k: int = 16  # nearest keys the margin loss looks at (the paper's choose_k; <= size)
    margin: float = 0.1  # the margin loss's alpha
    loss_weight: float = 1.0  # the margin loss's weight beside the head's cross-entropy
    # What `correct` (so `accuracy`) scores: "memory" (the nearest key's value, the paper's
    # prediction) | "head" (the softmax head); both are reported as accuracy_memory and
    # accuracy_head
    predict: str = "memory"

    def enabled(self) -> bool:
        return self.size > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    kind: str = "lm"  # "lm" | "classifier" | "dual_encoder" | "bi_encoder"
    # "transformer" | "transformer_xl" (see `mem_len`) | "lstm" | "gru" (recurrent: see `cfg.rnn`)
    # | "bag" (bi_encoder only: a bag of embeddings, `encoder.bag`)
    arch: str = "transformer"
    width: int = 128  # d_model
    depth: int = 2  # number of Transformer blocks
    num_heads: int = 4
    # Size of each head's queries, keys and values; 0: width / num_heads. Set explicitly by
    # structured pruning's shrink (hpnlp.compress.prune.shrink), which removes heads and keeps
    # their size.
    head_dim: int = 0
    # Key/value heads: 0 = num_heads (multi-head attention); 1 = multi-query attention
    # (Shazeer 2019); in between, grouped-query attention (Ainslie et al. 2023): each key/value
    # head serves num_heads / num_kv_heads query heads. Decoding caches and reads that many
    # heads' keys and values, not num_heads'.
    num_kv_heads: int = 0
    # Multi-head latent attention (MLA; DeepSeek-AI 2024, DeepSeek-V2): 0 = off; C > 0: each
    # block projects the input to one latent of C dims (layer-normed), from which every head's
    # keys and values are expanded (`k_up`, `v_up`). Decoding caches only the latent (with the
    # rotary key below, C + R numbers per position and block, against 2 H D for multi-head)
    # and never expands it: the up-projections are absorbed into the queries and the outputs,
    # so every query head reads the one cached row (as multi-query does), over C + R dims.
    kv_latent_dim: int = 0
    # With kv_latent_dim and model.pos_emb = "rope": R, the dims of each head's query and key
    # that RoPE rotates (the "decoupled" key: one R-dim key shared by all heads, projected from
    # the input and cached beside the latent; the other D - R dims of each head are the
    # latent's, unrotated). 0: D / 2. Even, below D.
    kv_latent_rope_dim: int = 0
    # With kv_latent_dim: whether the latent is layer-normed (`kv_norm`, DeepSeek-V2's). Off,
    # the latent is a linear map of the input, which a multi-head run's key and value weights
    # convert into (`train.init_from`, hpnlp.compress.mla: their joint truncated SVD).
    kv_latent_norm: bool = True
    mlp_dim: int = 512
    dropout: float = 0.1
    max_len: int = 512  # size of the learned position table and of the decode cache
    # "learned" | "sinusoidal" (a table added to the token embeddings) | "rope" (rotary, Su et
    # al. 2021: each block rotates its queries and keys by the token's position, theta base
    # 10000, rotate-half layout; nothing is added to the embeddings, so no table bounds the
    # training length; not with model.arch = "transformer_xl", which has its own relative
    # positions)
    pos_emb: str = "learned"
    # How a classifier, a dual encoder (each text) and a bi-encoder (q and d) pool the
    # trunk's outputs into one vector: "mean" over real tokens | "first" token (review,
    # session 102: said "classifier pooling", and the encoders read it too)
    pool: str = "mean"
    # A classifier whose tokens attend only to earlier ones, as a causal LM's trunk was
    # trained to (GPT's fine-tuning keeps the mask): what a classifier started from an LM's
    # trunk (`train.init_params='trunk'`) reads the trunk's features through. An LM is
    # always causal.
    causal: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; softmax and losses always run in float32
    # Per-block rematerialization: "none" | "full" | "dots_saveable" | "names:qkv,mlp_in"
    # (save only these REMAT_NAMES activations, recompute the rest in the backward pass) |
    # "elementwise" (recompute only the layer norms and gelu: their statistics and temporaries
    # are freed; their outputs, the next products' inputs, those products keep).
    remat: str = "none"
    # Reversible residual blocks (RevNet/Reformer, models/reversible.py): the backward pass
    # recomputes each block's inputs from its outputs, so activation memory stops growing
    # with depth (for ~1 extra forward pass of compute).
    reversible: bool = False
    # The `depth` blocks as ONE parameter tree with a leading `layers` axis, applied with
    # nn.scan: one compiled block (faster compiles for deep models); needed for pipeline
    # parallelism (mesh.pipeline > 1, parallel/pipeline.py), whose stages split that axis.
    stack_layers: bool = False
    # Transformer-XL (model.arch = "transformer_xl", models/transformer_xl.py): positions of
    # the previous segment(s) each layer keeps as memory; 0: = data.seq_len.
    mem_len: int = 0
    # Compressive Transformer (Rae et al. 2020, same file): slots of a second, compressed memory
    # per layer (0: off, plain Transformer-XL; needs data.batching = "stream"). The positions
    # each segment pushes out of the memory are compressed `comp_rate` to a slot by `comp_fn`
    # ("pool": strided mean | "conv": a learned 1-D convolution, kernel = stride = comp_rate),
    # which only the attention-reconstruction loss trains, weighted `comp_loss_weight`.
    comp_mem_len: int = 0
    comp_rate: int = 3  # must divide data.seq_len and the memory length
    comp_fn: str = "conv"
    comp_loss_weight: float = 1.0
    # Filled from the task by `validate` when left at 0.
    vocab_size: int = 0
    num_classes: int = 0
    # The config's `quant` group (hpnlp.compress): every product the model builds reads it.
    quant: QuantConfig = QuantConfig()
    lowrank: LowRankConfig = LowRankConfig()  # `model.lowrank.*`: factorized products
    moe: MoEConfig = MoEConfig()  # `model.moe.*`: mixture-of-experts MLPs (hpnlp.moe)
    memory: MemoryConfig = MemoryConfig()  # `model.memory.*`: the classifier's key-value memory
    encoder: EncoderConfig = EncoderConfig()  # `model.encoder.*`: the bi-encoder's loss and mining
    # Input-embedding gradients scaled per row by token frequency (rare ids get a stronger
    # signal; models/transformer.py `scaled_take`): "none" | "batch" (PyTorch's
    # `scale_grad_by_freq`: each row's gradient divided by its id's count in the batch, each
    # microbatch's under train.grad_accum) |
    # "corpus" (a fixed table: divided by the id's expected count in an optimizer step's
    # batch, train.batch_size rows whatever train.grad_accum, from the task's train counts,
    # at least 1)
    embed_grad_scale: str = "none"

    def dims_per_head(self) -> int:
        """D, each head's size: `head_dim`, or width / num_heads when it is 0."""
        return self.head_dim or self.width // self.num_heads

    def kv_heads(self) -> int:
        """G, the key/value heads: `num_kv_heads`, or num_heads when it is 0."""
        return self.num_kv_heads or self.num_heads

    def latent_rope_dims(self) -> int:
        """R, the rotary dims of each head under multi-head latent attention
        (`kv_latent_dim`): `kv_latent_rope_dim`, or D / 2 when it is 0; 0 without RoPE or
        without the latent."""
        if not self.kv_latent_dim or self.pos_emb != "rope":
            return 0
        return self.kv_latent_rope_dim or self.dims_per_head() // 2


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    name: str = "dense"
    # Extra constructor fields of the chosen attention class (e.g. block sizes).
    options: Mapping[str, Any] = dataclasses.field(default_factory=flax.core.FrozenDict)


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    name: str = "full"
    tie_embeddings: bool = False
    options: Mapping[str, Any] = dataclasses.field(default_factory=flax.core.FrozenDict)


@dataclasses.dataclass(frozen=True)
class RNNConfig:
    """Recurrent trunks (model.arch = "lstm" | "gru"): model.width is the hidden size,
    model.depth the number of layers, model.dropout standard dropout of the embeddings,
    between layers and of the top layer's output. Rates are probabilities; all off at
    evaluation."""

    combine: str = "last"  # "last" layer's outputs | "sum" of all layers | "residual"
    layer_norm: bool = False  # layer-normalized gates (Ba et al. 2016)
    bidirectional: bool = False  # encoders only (classifier, dual encoder)
    learned_init: bool = False  # learned initial state instead of zeros
    variational_dropout: float = 0.0  # one mask per sequence on inputs/outputs (Gal & Ghahramani)
    state_dropout: float = 0.0  # one mask per sequence on h_{t-1} in the recurrence
    recurrent_dropout: float = 0.0  # on the cell update, per step (Semeniuta et al.)
    zoneout: float = 0.0  # keep units' previous values (Krueger et al.)
    weight_drop: float = 0.0  # DropConnect on the recurrent matrix (Wan et al.; AWD-LSTM)
    unroll: int = 1  # lax.scan unroll factor
    # "auto": the fused C++ LSTM kernel where it can run (hpnlp.rnn.fused), else the XLA
    # scan | "scan" | "fused" (an error where it cannot run)
    impl: str = "auto"


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Knowledge distillation (hpnlp.compress.distill; `train.distill.*`): the student (this
    run's model) trains against a frozen teacher inside the same jitted step."""

    teacher: str = ""  # workdir of a trained hpnlp run of the same task and vocabulary; "" = off
    # loss = (1 - alpha) * hard-label loss + alpha * T^2 * CE(teacher_T, student_T), the
    # soft targets at temperature T (Hinton et al. 2015; the cross-entropy is the KL plus the
    # teacher's entropy, a constant: the same gradients, a larger logged loss_soft)
    alpha: float = 0.5
    temperature: float = 2.0
    # LM soft loss over the vocabulary: tokens per chunk (teacher and student logits exist one
    # chunk at a time, as output `full` chunks its loss); -1 = automatic, 0 = never
    chunk_tokens: int = -1
    # Hidden-state matching (TinyBERT / MobileBERT): weight of the mean squared error between
    # each student block's output and its teacher block's (student block i of Ls matches
    # teacher block (i + 1) Lt / Ls - 1), per real token; where the widths differ the
    # student's states go through a learned projection (TinyBERT's W_h), as under init='pca'
    # at any width, started at the student's rotation P^T
    hidden: float = 0.0
    # Attention-map matching (TinyBERT / MobileBERT): weight of the KL between the teacher's
    # and the student's attention distributions of the same block pairs, per real query;
    # both must use an attention variant that returns its probabilities ('dense')
    attention: float = 0.0
    # "none" | "every_other" | "select" | "importance" | "pca": the student's blocks start as the
    # teacher's blocks (`init_blocks`: 0, Lt/Ls, 2 Lt/Ls, ..., DistilBERT's), its embeddings,
    # position table, final norm and output layer as the teacher's; every_other needs the
    # teacher's shapes but its depth, select (weight selection, Xu et al. 2024) takes the
    # leading slice of each weight, so the student may also be narrower (fewer heads, MLP
    # neurons, width channels); importance (Minitron, Muralidharan et al. 2024) keeps the
    # teacher's most active heads, neurons and width channels instead, read on the run's
    # first `importance_batches` training batches; pca keeps importance's heads and neurons
    # but narrows the width by rotating the residual stream into its principal components
    # on those batches (SliceGPT, Ashkboos et al. 2024; hpnlp.compress.slicing)
    init: str = "none"
    importance_batches: int = 8
    # which teacher blocks the student's start as: "first" (0, Lt/Ls, 2 Lt/Ls, ...:
    # DistilBERT's) or "last" (Lt/Ls - 1, ..., Lt - 1: ending at the teacher's last block,
    # the one its final norm and output layer read; hidden-state matching's layer map)
    init_blocks: str = "first"

    def matches_blocks(self) -> tuple[str, Any] | None:
        """(field, value) of the first option set that reads the student's Transformer
        blocks against the teacher's (hidden, attention, init), or None."""
        for name in ("hidden", "attention"):
            if getattr(self, name):
                return f"train.distill.{name}", getattr(self, name)
        return ("train.distill.init", self.init) if self.init != "none" else None


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """Pruning (hpnlp.compress.prune; `train.prune.*`): masks in the train state, applied
    after every optimizer update so pruned weights stay exactly zero."""

    # "none" | "magnitude" | "random" (the control) | "movement" (Sanh et al. 2020: scores
    # learned through a straight-through mask; pruned weights may come back)
    method: str = "none"
    # final fraction set to zero, in [0, 1): of each pruned weight (scope "layer"), or of
    # all of them together (scope "global": each weight ends at its own sparsity)
    sparsity: float = 0.5
    # "layer": every weight to `sparsity` | "global": one ranking of the method's scores
    # (|W|, random, movement's) over them all
    scope: str = "layer"
    # "unstructured" | "N:M" (e.g. "2:4": N kept in every M consecutive weights along the
    # contraction; the sparsity is then 1 - N/M) | "structured": whole attention heads (when
    # `layers` names qkv or out) and MLP neurons (mlp), `sparsity` of each block's heads and
    # of its neurons, or for an LSTM/GRU `sparsity` of its model.width hidden units (one unit
    # of every layer at once); `python -m hpnlp.compress shrink` then removes them
    structure: str = "unstructured"
    # "oneshot": prune at `start_step` | "cubic": gradual, from 0 at `start_step` to
    # `sparsity` at `end_step`, masks recomputed every `every` steps (Zhu & Gupta 2017) |
    # "imp": iterative magnitude pruning with rewinding (`rounds`, `rewind_step`)
    schedule: str = "oneshot"
    start_step: int = 0
    end_step: int = 0  # 0 (or train.steps): the run's last step
    every: int = 100
    # schedule "imp": iterative magnitude pruning with weight rewinding (lottery tickets) in
    # one run: `rounds` prunings, survivors reset each time to their values after
    # `rewind_step` updates (hpnlp.compress.prune.imp_boundaries)
    rounds: int = 3
    rewind_step: int = 0
    # which products (QUANT_LAYERS names, comma list, or "all"); embeddings and the output
    # layer are left dense by default, as pruning recipes usually do
    layers: str = "qkv,out,mlp,input,recurrent"
    # L1-regularized training: l1 * sum |W| over the pruned products added to the per-token
    # objective (an auxiliary loss: the logged loss stays the model's), driving weights
    # towards zero before (and while) the masks take them
    l1: float = 0.0

    def nm(self) -> tuple[int, int] | None:
        """(N, M) for an "N:M" structure, else None."""
        if self.structure in ("unstructured", "structured"):
            return None
        n, m = self.structure.split(":")
        return int(n), int(m)

    def applies(self, kind: str) -> bool:
        return layers_name(self.layers, kind)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # global batch, summed over devices and processes
    grad_accum: int = 1  # microbatches per optimizer step
    lr: float = 1e-3
    warmup_steps: int = 100
    schedule: str = "cosine"  # "cosine" | "linear" | "constant" (after warmup)
    # where the decay ends, as a fraction of `lr`: the rate reaches lr * end_lr_frac at
    # optimizer count train.steps, one past the last step's (step s applies the rate at count
    # s - 1, the first step the warmup's 0), so the last step applies a little more
    end_lr_frac: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0  # global-norm clipping; 0 turns it off
    log_every: int = 10
    eval_every: int = 100  # 0: evaluate only at the end
    eval_batches: int = 0  # 0: the whole eval split
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 2
    early_stopping_patience: int = 0  # evals without improvement before stopping; 0: off
    early_stopping_metric: str = "loss"  # an eval metric name
    progress: bool = True  # tqdm bar
    # Random-feature attention (Performer) draws its features from the `features` RNG
    # stream, redrawn every this many steps; 0 = never. Eval, ensembles and generate use the
    # draw the last train step trained with (TrainState.features_key).
    feature_redraw_every: int = 1000
    # Dynamic loss scaling, active only when model.dtype = "float16": gradients of the
    # batch's mean loss per token (or example) * scale (of its sum, a large batch overflowed
    # at scale 1: session 98); a step whose gradients overflow is skipped and halves it, and
    # `loss_scale_period` good steps in a row double it (Micikevicius et al. 2018).
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 2000
    # Fine-tuning: workdir of a trained run of the same model shape whose newest checkpoint's
    # parameters start this run (the optimizer, step and data start fresh); "" = random init
    init_from: str = ""
    # What of `init_from`'s parameters start this run: "all" (a run of the same task and
    # shapes, or one `init_from` converts: other key/value heads or experts); "trunk", its
    # token embedding and trunk alone, every other parameter (the task's head) this run's
    # own draw: pretrain-then-fine-tune, e.g. the byte LM's trunk under the text classifier
    # (hpnlp.train.transfer).
    init_params: str = "all"
    # How `init_from` turns a run of more key/value heads into this run's fewer
    # (`model.num_kv_heads`, hpnlp.compress.gqa): "mean", each group's key and value heads
    # averaged (Ainslie et al. 2023); "svd", each group's keys and values the best rank-D fit
    # of its heads' (the truncated SVD of their weights side by side), each head's D x D
    # remainder folded into its query heads' query weights and output projection.
    init_kv_heads: str = "mean"
    # Batches of training data whose attention inputs weight those SVD fits (`init_kv_heads=
    # 'svd'` and a latent's conversion, hpnlp.compress.mla): each minimizes the error of the
    # keys and values on those inputs instead of the weights' (the inputs' covariance
    # whitens the SVD, as SVD-LLM and Yu et al. 2024 do); 0 = the weights alone.
    init_kv_calibration: int = 0
    # Which experts `init_from` keeps when it has more than this run's model.moe.num_experts
    # (expert pruning, hpnlp.compress.experts): "routed", each MoE layer's experts whose outputs
    # carried the most gate weight over `init_expert_batches` training batches (routed as
    # that run evaluates); "random", a uniform draw per layer (the control); "merged", each
    # of those the average of itself and the experts routed most like it, their neurons
    # aligned to it (MC-SMoE).
    init_experts: str = "routed"
    init_expert_batches: int = 8
    distill: DistillConfig = DistillConfig()  # `train.distill.*`: a frozen teacher (hpnlp.compress)
    prune: PruneConfig = PruneConfig()  # `train.prune.*`: masks kept in the train state


@dataclasses.dataclass(frozen=True)
class DataConfig:
    task: str = "listops"  # see hpnlp.data.task_names()
    seq_len: int = 512  # every batch is [batch, seq_len] (bucketing may use shorter)
    seed: int = 0
    # "pad" | "bucket" | "pack" (pack: LM tasks only) | "stream" (LM tasks only: row b of
    # batch t continues row b of batch t-1, for Transformer-XL memory; data/stream.py)
    batching: str = "pad"
    bucket_boundaries: tuple[int, ...] = ()  # empty: 4 boundaries up to seq_len
    train_path: str = ""  # users' own file (ListOps TSV or plain text); "" = embedded
    eval_path: str = ""
    eval_batch_size: int = 0  # 0: same as train.batch_size
    # ListOps generator (Long Range Arena recipe)
    listops_num_train: int = 20000
    listops_num_eval: int = 2000
    listops_min_length: int = 16
    listops_max_length: int = 512
    listops_max_depth: int = 10
    listops_max_args: int = 10
    # Word-level LM: keep the most frequent words, the rest map to <unk>
    word_vocab_size: int = 10000
    # LM tasks' tokenizer: "" (the task's own: byte_lm bytes, word_lm words) | "bytes" |
    # "words" | "bpe" | "unigram" (SentencePiece models of `vocab_size` pieces, trained on the
    # training split and kept in WORKDIR/tokenizer; hpnlp/data/tokenizers.py)
    tokenizer: str = ""
    vocab_size: int = 8000  # pieces of a bpe / unigram tokenizer
    # A folder written by `python -m hpnlp.data.prepare` (on-disk shards of a tokenized
    # corpus, read through grain; LM tasks). "" = the text in memory.
    prepared: str = ""
    # What the run evaluates on: "eval" (the task's eval set) | "validation" (a slice of the
    # training data held out and left out of training: the shipped corpus's chapters at
    # index 4 mod 10, 119 of its 1071 training chapters, or ListOps' last `listops_num_eval`
    # generated training examples), for choosing hyperparameters without reading the eval set
    eval_split: str = "eval"


# Device mesh axes, in mesh order. Model code never names these; it names logical axes,
# and `MeshConfig.rules` maps each logical name to mesh axes.
MESH_AXES = ("data", "fsdp", "tensor", "sequence", "pipeline", "expert")

# Logical axis names the models use -> mesh axes (a name, a tuple of names, or None:
# replicated). Parameters: `vocab`, `embed`, `heads`, `kv`, `mlp`, `layers` (a stacked
# layer axis), `expert`; activations: `batch`, `length`, `activation_embed`,
# `activation_mlp`. With every mesh axis of size 1 this is plain single-device code.
DEFAULT_RULES = {
    # data parallel over all three: fsdp also shards parameters, expert also shards experts
    "batch": ("data", "fsdp", "expert"),
    "length": "sequence",  # sequence (context) parallel: ring attention
    "vocab": "tensor",  # Megatron: vocabulary, heads and MLP hidden split over tensor
    "embed": "fsdp",  # ZeRO-3: parameters' model dim split over fsdp, gathered per layer
    "heads": "tensor",
    # the key/value heads of grouped-query attention (model.num_kv_heads; None replicates that
    # projection, as multi-query attention under tensor parallelism needs)
    "kv_heads": "tensor",
    "kv": None,
    "mlp": "tensor",
    "layers": "pipeline",  # stacked blocks split into pipeline stages
    "expert": "expert",
    "activation_embed": None,
    "activation_mlp": "tensor",
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes (-1: all devices left over; at most one) and the logical-axis rules."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    pipeline: int = 1
    expert: int = 1
    # GPipe microbatches per step when pipeline > 1 (bubble (P-1)/(M+P-1)); 0: = pipeline.
    pipeline_microbatches: int = 0
    # logical name -> None | "axis" | ("a", "b"); in a ConfigDict (and on the command line)
    # spelled as strings: "None", "tensor", "data,fsdp". Given rules override the defaults.
    rules: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: flax.core.FrozenDict(DEFAULT_RULES))

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        fixed = math.prod(v for v in sizes.values() if v != -1)
        for k, v in sizes.items():
            if v == -1:
                sizes[k] = num_devices // fixed if fixed else 0
        return sizes

    def fits(self, num_devices: int) -> bool:
        """Whether the axis sizes lay out exactly `num_devices` devices (a -1 axis filling
        the rest); the config check and a read-only run's relayout both ask this."""
        sizes = self.axis_sizes(num_devices)
        return math.prod(sizes.values()) == num_devices and 0 not in sizes.values()

    def rule_tuples(self) -> tuple[tuple[str, Any], ...]:
        """The rules as flax wants them: ((logical, mesh axes), ...)."""
        return tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                     for k, v in self.rules.items())

    def mesh_axes_of(self, logical: str) -> tuple[str, ...]:
        """Mesh axes a logical name is split over (empty: replicated or unmapped)."""
        return self.axes_in(self.rules.get(logical))

    @staticmethod
    def axes_in(rule) -> tuple[str, ...]:
        """A rule's value (None, an axis name, or names) as a tuple of mesh axis names."""
        return () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    attention: AttentionConfig
    output: OutputConfig
    train: TrainConfig
    data: DataConfig
    mesh: MeshConfig
    rnn: RNNConfig = RNNConfig()
    seed: int = 0
    name: str = "experiment"

    @property
    def quant(self) -> QuantConfig:
        return self.model.quant


_GROUPS = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "output": OutputConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "rnn": RNNConfig,
    "mesh": MeshConfig,
}


def _to_plain(value: Any) -> Any:
    if isinstance(value, ml_collections.ConfigDict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value


def _rule_value(v: Any) -> Any:
    """A rule's mesh axes as given in a file or on the command line: None, "None" or ""
    (replicated), "axis", "a,b" or a list/tuple of axes."""
    if isinstance(v, str):
        names = tuple(a.strip() for a in v.split(",") if a.strip())
        if not names or names in (("None",), ("none",)):
            return None
        return names[0] if len(names) == 1 else names
    return tuple(v) if isinstance(v, list) else v


def _rule_string(v: Any) -> str:
    return "None" if v is None else (v if isinstance(v, str) else ",".join(v))


def experiment_args(arg: str, *, file: str, allowed, default: tuple[str, ...] = (),
                    exclusive=()) -> set[str]:
    """The comma-separated arguments of an experiment file's `get_config(arg)` as a set
    (`default` when `arg` is empty); ValueError naming `file` for one not in `allowed`, or
    for two of one group in `exclusive` (e.g. two tokenizations)."""
    args = {a.strip() for a in arg.split(",") if a.strip()} if arg else set(default)
    unknown = sorted(args - set(allowed))
    if unknown:
        raise ValueError(f"{file}: unknown argument(s) {unknown}; choose from {list(allowed)}")
    for group in exclusive:
        both = [a for a in group if a in args]
        if len(both) > 1:
            raise ValueError(f"{file}: arguments {both} exclude each other; give one of them")
    return args


def default_configdict() -> ml_collections.ConfigDict:
    """A ConfigDict holding every field at its default; experiments start from this."""
    cfg = ml_collections.ConfigDict()
    cfg.seed = 0
    cfg.name = "experiment"
    for group, cls in _GROUPS.items():
        sub = ml_collections.ConfigDict()
        for f in dataclasses.fields(cls):
            if group == "model" and f.name == "quant":  # its own group, `quant.*`
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if group == "mesh" and f.name == "rules":
                # Strings ("None", "data,fsdp"), so every rule can be overridden on the
                # command line (ml_collections refuses None- and tuple-typed overrides).
                default = {k: _rule_string(v) for k, v in default.items()}
            if isinstance(default, Mapping):
                default = ml_collections.ConfigDict(dict(default))
            if dataclasses.is_dataclass(default):  # a subgroup (train.distill, train.prune)
                default = ml_collections.ConfigDict({  # plain dicts: to_dict() stays JSON
                    k: dict(v) if isinstance(v, Mapping) else v
                    for k, v in dataclasses.asdict(default).items()})
            setattr(sub, f.name, default)
        setattr(cfg, group, sub)
    cfg.quant = ml_collections.ConfigDict(
        {f.name: f.default for f in dataclasses.fields(QuantConfig)})
    return cfg


def from_configdict(cd: ml_collections.ConfigDict | Mapping[str, Any]) -> Config:
    """ConfigDict (or nested dict) -> frozen `Config`; unknown fields are errors."""
    plain = _to_plain(cd) if isinstance(cd, ml_collections.ConfigDict) else dict(cd)
    kwargs: dict[str, Any] = {}
    quant = model_quant = None
    for key, value in plain.items():
        if key == "quant":  # the user's `quant.*` group lives in ModelConfig.quant
            quant = _subgroup("quant", QuantConfig, value)
        elif key in _GROUPS:
            cls = _GROUPS[key]
            names = {f.name for f in dataclasses.fields(cls)}
            value = dict(value or {})
            if key == "model" and "quant" in value:  # a saved config.json's place for it
                # checked as `quant` is (a bug hunt, session 103: built unchecked, a typo was
                # a raw TypeError, and beside the `quant` group it was silently replaced)
                model_quant = _subgroup("model.quant", QuantConfig, value.pop("quant"))
            for field_name in value:
                if field_name not in names:
                    _fail(f"{key}.{field_name}", value[field_name],
                          f"unknown field; `{key}` has {sorted(names)}")
            _check_kinds(key, cls, value)
            for f in dataclasses.fields(cls):  # subgroups: train.distill, train.prune
                if dataclasses.is_dataclass(f.default) and f.name in value:
                    value[f.name] = _subgroup(f"{key}.{f.name}", type(f.default), value[f.name])
            if "bucket_boundaries" in value:
                value["bucket_boundaries"] = _hashable(tuple(value["bucket_boundaries"]))
            if "options" in value:  # hashable: configs become flax module fields
                value["options"] = _hashable(dict(value["options"] or {}))
            if key == "mesh" and "rules" in value:  # given rules override the defaults one by one
                given = {k: _rule_value(v) for k, v in dict(value["rules"] or {}).items()}
                value["rules"] = flax.core.FrozenDict({**DEFAULT_RULES, **given})
            kwargs[key] = cls(**value)
        elif key in ("seed", "name"):
            kwargs[key] = _check_kind(key, value, getattr(Config, key))
        else:
            _fail(key, value, f"unknown group; a config has "
                              f"{sorted([*_GROUPS, 'quant']) + ['name', 'seed']}")
    for group, cls in _GROUPS.items():
        kwargs.setdefault(group, cls())
    if model_quant is not None:
        given = [f.name for f in dataclasses.fields(QuantConfig) if quant is not None
                 and getattr(quant, f.name) != getattr(model_quant, f.name)
                 and getattr(quant, f.name) != getattr(QuantConfig(), f.name)]
        if given:
            _fail(f"quant.{given[0]}", getattr(quant, given[0]), "the config sets model.quant "
                  "too (a saved config.json's place for the `quant` group), and the two would "
                  "disagree: set the quantization as quant.* alone, or as model.quant alone")
        quant = model_quant
    if quant is not None:
        kwargs["model"] = dataclasses.replace(kwargs["model"], quant=quant)
    return Config(**kwargs)


def _subgroup(field: str, cls: type, value: Any):
    """A nested group (`train.distill`) from a mapping; unknown fields are errors."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping) and value is not None:
        _fail(field, value, f"must be a group of `{field}.*` fields (a mapping)")
    value = dict(value or {})
    names = {f.name for f in dataclasses.fields(cls)}
    for name in value:
        if name not in names:
            _fail(f"{field}.{name}", value[name], f"unknown field; `{field}` has {sorted(names)}")
    _check_kinds(field, cls, value)
    for f in dataclasses.fields(cls):  # hashable: configs become flax module fields
        if f.name in value and f.default_factory is flax.core.FrozenDict:
            value[f.name] = _hashable(dict(value[f.name] or {}))
    return cls(**value)


# A field's default's kind -> the kinds of value it takes, and how its error says them; bool
# first, as a bool is an int (and True is no integer count, nor a number, here)
# (numbers' classes, so a NumPy integer or float a bench or an experiment computed passes)
_KINDS = ((bool, (bool, np.bool_), "True or False"), (int, (numbers.Integral,), "an integer"),
          (float, (numbers.Real,), "a number"), (str, (str,), "a string"),
          (tuple, (list, tuple), "a list"))


def _check_kinds(group: str, cls: type, given: Mapping[str, Any]) -> None:
    """Each field of `cls` in `given` of its default's kind (`_check_kind`). A review (r4):
    ml_collections lets None replace any value, and a config.json may be edited, so
    `model.dropout = None` or `"dropout": "0.1"` reached `validate`'s `0 <= dropout` as a raw
    TypeError (and `seed = None` jax, after the data was built)."""
    for f in dataclasses.fields(cls):
        if f.name in given:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            given[f.name] = _check_kind(f"{group}.{f.name}", given[f.name], default)


def _check_kind(field: str, value: Any, default: Any) -> Any:
    """`value`, a NumPy scalar as its Python number (config.json would write NumPy's as text,
    which no reader takes: review of session 104), or a ConfigError unless it is of
    `default`'s kind: an int for a float, a list for a tuple, a mapping (or None) for a
    mapping (options, rules, ranks: their own checks read what is in them). Fields whose
    default is None or a subgroup are not judged here."""
    if isinstance(default, Mapping):
        if value is not None and not isinstance(value, Mapping):
            _fail(field, value, "must be a mapping of option names to values ({} for none)")
        return value
    for kind, takes, words in _KINDS:
        if isinstance(default, kind):
            if isinstance(value, takes) and (kind is bool
                                             or not isinstance(value, (bool, np.bool_))):
                return value.item() if isinstance(value, np.generic) else value
            _fail(field, value, f"must be {words} (the default is {default!r})")
    return value


def _hashable(value: Any) -> Any:
    """`value` with every mapping in it a FrozenDict and every list a tuple, all the way down
    (a bug hunt, session 103: a config.json's `output.options.cutoffs` came back a list, the
    reloaded Config unhashable, and retrieval.knnlm's cached forward raised TypeError), and
    every NumPy scalar its Python number, as `_check_kind` makes a field's (a review, session
    118: an option's np.int64(3) was refused as "must be an integer")."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return flax.core.FrozenDict({k: _hashable(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value
