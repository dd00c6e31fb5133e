"""Experiment configs: an `ml_collections.ConfigDict` becomes frozen dataclasses here, once.

Every experiment file in `experiments/` returns a ConfigDict with the groups below
(`model`, `attention`, `output`, `train`, `data`, `mesh`). `from_configdict` turns it into
a `Config` and `validate` checks it against the task and the devices *before* anything is
compiled, so a bad field fails in a second with a message that names the field, the bad
value and what is allowed.

Eval variants are `dataclasses.replace(cfg.model, dropout=0.0)`; nothing mutates a config.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Any, Mapping

import flax.core
import ml_collections


class ConfigError(ValueError):
    """A config field has a value hpnlp cannot run. The message names field, value and fix."""


def config_error(field: str, value: Any, allowed: str) -> ConfigError:
    """The error for one bad field, in the words every config check uses."""
    return ConfigError(f"config field `{field}` = {value!r} is not allowed: {allowed}")


def to_json(cfg: "Config") -> dict:
    """The config as plain JSON (option and rule mappings as objects), which
    `from_configdict` reads back: a run's config.json."""
    def plain(v):
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return json.loads(json.dumps(plain(dataclasses.asdict(cfg)), default=str))


def _fail(field: str, value: Any, allowed: str) -> None:
    raise config_error(field, value, allowed)


def _check_choice(field: str, value: Any, choices) -> None:
    if value not in choices:
        _fail(field, value, f"choose one of {sorted(choices)}")


def _check_positive(field: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        _fail(field, value, "must be a number " + (">= 0" if allow_zero else "> 0"))


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
    top_k: int = 1  # experts per token (expert_choice: the mean experts per token)
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
    capacity_factor: float = 1.25  # training
    eval_capacity_factor: float = 2.0  # evaluation (decoding is always dropless)
    shared_experts: int = 0  # experts every token uses besides its routed ones (DeepSeekMoE)
    balance_loss: float = 0.01  # weight of X * sum_i fraction_i * prob_i (Switch), per MoE layer
    z_loss: float = 0.001  # weight of mean logsumexp(router logits)^2 (ST-MoE)
    # Routing groups (capacity is per group): the batch's rows split into this many blocks;
    # 0 = one per data-parallel shard (what each device holds), as GShard's groups
    groups: int = 0
    block_size: int = 0  # dropless: rows per padded block of one expert; 0 = automatic

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
    bag: str = "mean"  # model.arch = "bag" (StarSpace-style bag of embeddings): "mean" | "sum"
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
    pool: str = "mean"  # classifier pooling: "mean" over real tokens | "first" token
    # A classifier whose tokens attend only to earlier ones, as a causal LM's trunk was
    # trained to (GPT's fine-tuning keeps the mask): what a classifier started from an LM's
    # trunk (`train.init_params='trunk'`) reads the trunk's features through. An LM is
    # always causal.
    causal: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; softmax and losses always run in float32
    # Per-block rematerialization: "none" | "full" | "dots_saveable" | "names:qkv,mlp_in"
    # (save only these REMAT_NAMES activations, recompute the rest in the backward pass) |
    # "elementwise" (recompute only the layer norms' and gelu's outputs, keep all else).
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
    # `scale_grad_by_freq`: each row's gradient divided by its id's count in the batch) |
    # "corpus" (a fixed table: divided by the id's expected count in a batch, from the task's
    # train counts, at least 1)
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
    model.depth the number of layers, model.dropout standard dropout of the embeddings
    and between layers. Rates are probabilities; all off at evaluation."""

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
    # student's states go through a learned projection (TinyBERT's W_h)
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
    sparsity: float = 0.5  # final fraction of each pruned weight set to zero, in [0, 1)
    # "layer": every weight to `sparsity` | "global": one magnitude threshold over them all
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
    # loss, driving weights towards zero before (and while) the masks take them
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
    end_lr_frac: float = 0.1  # final lr as a fraction of `lr`
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
    # stream, redrawn every this many steps (eval uses the current draw); 0 = never.
    feature_redraw_every: int = 1000
    # Dynamic loss scaling, active only when model.dtype = "float16": gradients of
    # loss * scale; a step whose gradients overflow is skipped and halves the scale, and
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

    def rule_tuples(self) -> tuple[tuple[str, Any], ...]:
        """The rules as flax wants them: ((logical, mesh axes), ...)."""
        return tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                     for k, v in self.rules.items())

    def mesh_axes_of(self, logical: str) -> tuple[str, ...]:
        """Mesh axes a logical name is split over (empty: replicated or unmapped)."""
        v = self.rules.get(logical)
        return () if v is None else ((v,) if isinstance(v, str) else tuple(v))


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
    quant = None
    for key, value in plain.items():
        if key == "quant":  # the user's `quant.*` group lives in ModelConfig.quant
            names = {f.name for f in dataclasses.fields(QuantConfig)}
            value = dict(value or {})
            for field_name in value:
                if field_name not in names:
                    _fail(f"quant.{field_name}", value[field_name],
                          f"unknown field; `quant` has {sorted(names)}")
            quant = QuantConfig(**value)
        elif key in _GROUPS:
            cls = _GROUPS[key]
            names = {f.name for f in dataclasses.fields(cls)}
            value = dict(value or {})
            if key == "model" and isinstance(value.get("quant"), Mapping):  # a saved config.json
                quant = quant or QuantConfig(**value.pop("quant"))
            for field_name in value:
                if field_name not in names:
                    _fail(f"{key}.{field_name}", value[field_name],
                          f"unknown field; `{key}` has {sorted(names)}")
            for f in dataclasses.fields(cls):  # subgroups: train.distill, train.prune
                if dataclasses.is_dataclass(f.default) and f.name in value:
                    value[f.name] = _subgroup(f"{key}.{f.name}", type(f.default), value[f.name])
            if "bucket_boundaries" in value:
                value["bucket_boundaries"] = tuple(value["bucket_boundaries"])
            if "options" in value:  # hashable: configs become flax module fields
                value["options"] = flax.core.FrozenDict(value["options"] or {})
            if key == "mesh" and "rules" in value:  # given rules override the defaults one by one
                given = {k: _rule_value(v) for k, v in dict(value["rules"] or {}).items()}
                value["rules"] = flax.core.FrozenDict({**DEFAULT_RULES, **given})
            kwargs[key] = cls(**value)
        elif key in ("seed", "name"):
            kwargs[key] = value
        else:
            _fail(key, value, f"unknown group; a config has "
                              f"{sorted([*_GROUPS, 'quant']) + ['name', 'seed']}")
    for group, cls in _GROUPS.items():
        kwargs.setdefault(group, cls())
    if quant is not None:
        kwargs["model"] = dataclasses.replace(kwargs["model"], quant=quant)
    return Config(**kwargs)


def _subgroup(field: str, cls: type, value: Any):
    """A nested group (`train.distill`) from a mapping; unknown fields are errors."""
    if isinstance(value, cls):
        return value
    value = dict(value or {})
    names = {f.name for f in dataclasses.fields(cls)}
    for name in value:
        if name not in names:
            _fail(f"{field}.{name}", value[name], f"unknown field; `{field}` has {sorted(names)}")
    for f in dataclasses.fields(cls):  # hashable: configs become flax module fields
        if f.name in value and f.default_factory is flax.core.FrozenDict:
            value[f.name] = flax.core.FrozenDict(dict(value[f.name] or {}))
    return cls(**value)


# What the model gives an output layer itself: not options (found in review: accepted, then
# overwritten when the layer was built), with the field that sets each
_MODEL_SET_OUTPUT = {"vocab_size": "model.vocab_size", "embed": "output.tie_embeddings",
                     "counts": "the task's token counts", "dtype": "model.dtype",
                     "param_dtype": "model.param_dtype", "quant": "the quant group"}


def _check_options(field: str, options: Mapping[str, Any], cls: type) -> None:
    """Options must be constructor fields of the registered module class, of their default's
    type where it is a bool, an int or a float (found in review: 'false' from the command line
    was a string, so true, and 'abc' failed deep inside the loss)."""
    params = inspect.signature(cls).parameters
    model_set = _MODEL_SET_OUTPUT if field == "output.options" else {}
    allowed = sorted(p for p in params if p not in ("parent", "name") and p not in model_set)
    for key, value in options.items():
        if key in model_set:
            _fail(f"{field}.{key}", value, f"is set by the model from {model_set[key]}; set "
                  "that instead")
        if key not in params or key in ("parent", "name"):
            _fail(f"{field}.{key}", value,
                  f"unknown option for {cls.__name__}; it takes {allowed}")
        default = params[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                _fail(f"{field}.{key}", value, "must be True or False")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(f"{field}.{key}", value, "must be an integer")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(f"{field}.{key}", value, "must be a number")


def _check_remat(remat: Any) -> None:
    if isinstance(remat, str) and remat.startswith("names:"):
        names = [n.strip() for n in remat[len("names:"):].split(",")]
        bad = [n for n in names if n not in REMAT_NAMES]
        if bad:
            _fail("model.remat", remat, f"unknown activation name(s) {bad}; after 'names:' list "
                  f"comma-separated names from {list(REMAT_NAMES)}")
        return
    _check_choice("model.remat", remat, ("none", "full", "dots_saveable", "elementwise",
                                         "names:<a>,<b>"))


def _check_quant(q: QuantConfig, m: ModelConfig) -> None:
    """The `quant` group: formats, the int4 group size against every contraction width."""
    from hpnlp.compress import calibrate, formats  # light modules: numerics only

    _check_choice("quant.weights", q.weights, ("none", *formats.FORMATS))
    _check_choice("quant.activations", q.activations, ("none", *formats.ACTIVATION_FORMATS))
    _check_choice("quant.act_scale", q.act_scale, ("dynamic", "static"))
    _check_choice("quant.calibration", q.calibration, calibrate.METHODS)
    if not (isinstance(q.percentile, (int, float)) and 50.0 < q.percentile <= 100.0):
        _fail("quant.percentile", q.percentile, "must be in (50, 100]")
    if q.activations == "binary" and q.weights != "binary":
        _fail("quant.activations", q.activations, "binary activations are XNOR-Net's binary "
              "products and need quant.weights='binary'")
    _check_layers("quant.layers", q.layers, QUANT_LAYERS)
    if q.enabled and m.arch == "transformer_xl":
        _fail("quant.weights", q.weights, "Transformer-XL's relative-position attention has its "
              "own products, not yet quantizable; quantize model.arch='transformer' or an LSTM/GRU")
    if q.act_scale == "static" and m.reversible:
        _fail("quant.act_scale", "static", "reversible blocks recompute themselves functionally and "
              "hold no calibrated ranges; use quant.act_scale='dynamic'")
    if not isinstance(q.group_size, int) or q.group_size < 0:
        _fail("quant.group_size", q.group_size, "must be an integer >= 0 (0: per channel)")
    if q.group_size and q.weights != "int4":
        _fail("quant.group_size", q.group_size, f"group scales are for quant.weights='int4' "
              f"(got {q.weights!r}); set quant.group_size=0")
    if q.group_size:  # every contraction the quantized products sum over must split evenly
        widths = {"model.width": m.width, "model.mlp_dim": m.mlp_dim,
                  "model.num_heads * head size": m.num_heads * m.dims_per_head()}
        for name, width in widths.items():
            if width % q.group_size:
                _fail("quant.group_size", q.group_size, f"must divide {name}={width} (int4 "
                      "groups split each product's contraction); choose a divisor of it")


def _check_layers(field: str, layers: str, allowed) -> None:
    """A `layers` field: "all" or a comma list of `allowed` product kinds."""
    if layers == "all":
        return
    names = [n.strip() for n in layers.split(",")]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        _fail(field, layers, f"'all' or a comma list of {list(allowed)} (unknown: {bad})")


def _check_lowrank(cfg: Config) -> None:
    """`model.lowrank`: the rank against every chosen product's shape, what it combines with."""
    lr, m = cfg.model.lowrank, cfg.model
    if not isinstance(lr.rank, int) or lr.rank < 0:
        _fail("model.lowrank.rank", lr.rank, "must be an integer >= 0 (0: no factorization)")
    if not isinstance(lr.energy, (int, float)) or not 0.0 <= lr.energy <= 1.0:
        _fail("model.lowrank.energy", lr.energy, "the kept fraction of sum(S^2) must be in (0, 1] "
              "(0: off)")
    if lr.rank and lr.energy:
        _fail("model.lowrank.energy", lr.energy, "give a fixed model.lowrank.rank or a kept "
              "energy, not both")
    if lr.ranks and not lr.energy:
        _fail("model.lowrank.ranks", dict(lr.ranks), "is filled from model.lowrank.energy when "
              "the run is built; set model.lowrank.energy (or one model.lowrank.rank) instead")
    bad = {k: v for k, v in lr.ranks.items() if not isinstance(v, int) or v < 1}
    if bad:
        _fail("model.lowrank.ranks", bad, "ranks must be integers >= 1")
    if lr.energy and not lr.ranks and not cfg.train.init_from:
        _fail("model.lowrank.energy", lr.energy, "measures the energy of trained weights: set "
              "train.init_from to the run to factorize")
    if not lr.enabled():
        return
    _check_layers("model.lowrank.layers", lr.layers, LOWRANK_LAYERS)
    if m.arch != "transformer" and any(lr.applies(k) for k in ("qkv", "out", "mlp")):
        _fail("model.lowrank.layers", lr.layers, f"model.arch={m.arch!r} has no qkv/out/mlp "
              "products; factorize a Transformer, or set model.lowrank.layers to what it has "
              "('embed,output' for an LM, 'embed,head' for a classifier)")
    hd = m.num_heads * m.dims_per_head()
    # grouped key/value heads: q [E, H*D] and kv [E, 2*G*D] are two qkv products
    qkv = 3 * hd if m.kv_heads() == m.num_heads else min(hd, 2 * m.kv_heads() * m.dims_per_head())
    shapes = [("qkv", (m.width, qkv)), ("out", (hd, m.width))]
    if not all(m.moe.applies(i) for i in range(m.depth)):  # a dense block's MLP
        shapes.append(("mlp", (m.width, m.mlp_dim)))
    if m.moe.enabled():  # each expert's own products (the shared experts' are wider)
        shapes.append(("mlp", (m.width, m.moe.expert_dim(m))))
    for kind, (k, n) in shapes:  # the heads' once the task's classes are known
        if lr.rank and lr.applies(kind) and lr.rank > min(k, n):
            _fail("model.lowrank.rank", lr.rank, f"the {kind} product is [{k}, {n}], of rank at "
                  f"most {min(k, n)} (and smaller only below {k * n // (k + n) + 1}); lower the "
                  f"rank or drop {kind!r} from model.lowrank.layers")
    named = {n.strip() for n in lr.layers.split(",")}  # "all": whichever the model has
    if "output" in named and m.kind != "lm":
        _fail("model.lowrank.layers", lr.layers, f"'output' is an LM's output layer and "
              f"model.kind={m.kind!r} has none; drop 'output' (a classifier's is 'head')")

    def vectors() -> bool:  # the output layer is one [V, E] matrix of vectors (asked late:
        from hpnlp import softmax  # output.name itself is checked after this)
        from hpnlp.softmax.base import VocabLayer
        return issubclass(softmax.get(cfg.output.name), VocabLayer)
    if "output" in named and m.kind == "lm" and not vectors():
        _fail("model.lowrank.layers", lr.layers, f"output layer {cfg.output.name!r} keeps "
              "its own tables, not one [V, E] matrix of output vectors; drop 'output' or "
              "use output.name='full' (or another VocabLayer: sampled, nce, ...)")
    tied = m.kind == "lm" and cfg.output.tie_embeddings
    if tied and lr.applies("embed") and not vectors():
        _fail("model.lowrank.layers", lr.layers, f"output layer {cfg.output.name!r} reads "
              "the tied embedding table itself, so the table cannot be factorized; drop "
              "'embed' from model.lowrank.layers")
    if lr.applies("embed") and tied and not lr.applies("output"):
        _fail("model.lowrank.layers", lr.layers, "the input embedding is the output layer's "
              "table (output.tie_embeddings=True): one weight, factorized as the output "
              "layer's; name 'output' too (or instead)")
    if (lr.applies("embed") or (tied and lr.applies("output"))) and m.embed_grad_scale != "none":
        _fail("model.embed_grad_scale", m.embed_grad_scale, "scales each looked-up row's "
              "gradient, and a factorized embedding has no rows of its own; set it to 'none' "
              "or drop 'embed' from model.lowrank.layers")
    q = m.quant
    # the fixed ranks; none while model.lowrank.energy waits to choose them at build time
    ranks = sorted({lr.rank} if lr.rank else set(lr.ranks.values()))
    if q.applies("output") and lr.applies("output"):
        _fail("quant.layers", q.layers, "names the output layer, whose table model.lowrank "
              "factorizes, and a factorized output table is not quantized yet; leave 'output' "
              "out of quant.layers (the table stays float) or out of model.lowrank.layers")
    if q.group_size and any(q.applies(k) and lr.applies(k) for k in ("qkv", "out", "mlp", "head")):
        if not ranks:  # model.lowrank.energy, resolved when the run is built
            _fail("quant.group_size", q.group_size, "int4 groups split the rank of each "
                  "factorized product, and model.lowrank.energy chooses the ranks later; use "
                  "model.lowrank.rank, or quant.group_size=0")
        if any(r % q.group_size for r in ranks):
            _fail("quant.group_size", q.group_size, f"must divide the rank of every factorized "
                  f"product (ranks {ranks}: x U [*, r] is the second product's input); choose "
                  "a divisor of them, or quant.group_size=0")
    pr = cfg.train.prune
    try:
        nm = pr.nm()
    except ValueError:  # a malformed structure: refused with the prune fields
        nm = None
    if pr.method != "none" and nm and any(pr.applies(k) and lr.applies(k)
                                               for k in LOWRANK_LAYERS):
        M = nm[1]
        if not ranks or any(r % M for r in ranks):
            _fail("train.prune.structure", pr.structure, f"groups M={M} consecutive weights "
                  "along each factor's contraction, and V's is the rank: M must divide every "
                  f"rank ({ranks or 'chosen later by model.lowrank.energy'}); choose ranks that "
                  "M divides (model.lowrank.rank), or unstructured pruning")
    if pr.method != "none" and pr.structure == "structured":
        _fail("train.prune.structure", pr.structure, "removes whole heads and neurons, which a "
              "factorized weight's U and V do not own apart; prune and shrink before "
              "factorizing, or prune unstructured or N:M (each factor pruned)")
    for field, value, on in (("model.stack_layers", True, m.stack_layers),
                             ("model.reversible", True, m.reversible)):
        if on:
            _fail(field, value, "is not combined with model.lowrank yet; factorize (and "
                  "fine-tune) first, or set model.lowrank.rank=0")


def _check_compressive(cfg: Config) -> None:
    """`model.comp_*`: the Compressive Transformer's memory (models/transformer_xl.py)."""
    m, d = cfg.model, cfg.data
    if not isinstance(m.comp_mem_len, int) or m.comp_mem_len < 0:
        _fail("model.comp_mem_len", m.comp_mem_len, "must be an integer >= 0 (0: no compressed memory)")
    if not isinstance(m.comp_rate, int) or m.comp_rate < 1:
        _fail("model.comp_rate", m.comp_rate, "must be an integer >= 1 (positions per compressed slot)")
    _check_choice("model.comp_fn", m.comp_fn, ("pool", "conv"))
    _check_positive("model.comp_loss_weight", m.comp_loss_weight, allow_zero=True)
    if not m.comp_mem_len:
        return
    if m.arch != "transformer_xl":
        _fail("model.comp_mem_len", m.comp_mem_len, f"the compressed memory extends Transformer-XL's; "
              f"set model.arch='transformer_xl' (got {m.arch!r}) or model.comp_mem_len=0")
    if d.batching != "stream":
        _fail("data.batching", d.batching, "the compressed memory is carried from batch to batch; "
              "set data.batching='stream' (or model.comp_mem_len=0)")
    mem = m.mem_len or d.seq_len
    for name, n in (("data.seq_len", d.seq_len), ("model.mem_len", mem)):
        if n % m.comp_rate:
            _fail("model.comp_rate", m.comp_rate, f"must divide {name}={n} (each segment compresses "
                  "the positions it pushes out of the memory in whole groups); pick a divisor")


def _check_encoder(cfg: Config) -> None:
    """`model.encoder` (the bi-encoder, hpnlp.models.bi_encoder)."""
    e, m = cfg.model.encoder, cfg.model
    _check_choice("model.encoder.loss", e.loss, ENCODER_LOSSES)
    _check_choice("model.encoder.bag", e.bag, ("mean", "sum"))
    _check_positive("model.encoder.temperature", e.temperature)
    _check_positive("model.encoder.margin", e.margin, allow_zero=True)
    for name in ("mine_every", "mine_depth"):
        if not isinstance(getattr(e, name), int) or getattr(e, name) < (name == "mine_depth"):
            _fail(f"model.encoder.{name}", getattr(e, name),
                  "must be an integer >= " + ("1" if name == "mine_depth" else "0 (0: no mining)"))
    if e.mine_depth > 1024:
        _fail("model.encoder.mine_depth", e.mine_depth, "must be <= 1024 (the negative is drawn "
              "from this many nearest non-positives; deeper draws are nearly random)")
    if e.mine_every and m.kind != "bi_encoder":
        _fail("model.encoder.mine_every", e.mine_every, "hard negatives are mined for the "
              "bi-encoder; set model.kind='bi_encoder' or model.encoder.mine_every=0")


def _check_memory(cfg: Config) -> None:
    """`model.memory` (hpnlp.retrieval.memory): fields, and what the memory combines with."""
    mm, m, t = cfg.model.memory, cfg.model, cfg.train
    if not isinstance(mm.size, int) or mm.size < 0:
        _fail("model.memory.size", mm.size, "must be an integer >= 0 (0: no memory)")
    if not mm.size:
        return
    if m.kind != "classifier":
        _fail("model.memory.size", mm.size, f"the key-value memory answers with a class label, for "
              f"model.kind='classifier' (this run has {m.kind!r}); set model.memory.size=0")
    if not isinstance(mm.key_dim, int) or mm.key_dim < 1:
        _fail("model.memory.key_dim", mm.key_dim, "must be an integer >= 1")
    if not isinstance(mm.k, int) or not 1 <= mm.k <= mm.size:
        _fail("model.memory.k", mm.k, f"must be an integer in [1, model.memory.size={mm.size}]")
    _check_positive("model.memory.margin", mm.margin, allow_zero=True)
    _check_positive("model.memory.loss_weight", mm.loss_weight, allow_zero=True)
    _check_choice("model.memory.predict", mm.predict, MEMORY_PREDICTIONS)
    if t.grad_accum != 1:
        _fail("train.grad_accum", t.grad_accum, "the key-value memory is updated from each step's "
              "whole batch, which microbatches would drop; set train.grad_accum=1 (or "
              "model.memory.size=0)")
    if t.distill.teacher:
        _fail("train.distill.teacher", t.distill.teacher, "distillation and the key-value memory "
              "both replace the model's loss; set model.memory.size=0 or train.distill.teacher=''")


def check_moe_fields(c: MoEConfig) -> None:
    """`model.moe`'s own fields (num_experts >= 1), checked by `validate` and by an MoE layer
    built directly (`hpnlp.moe.MoE`), so both refuse a bad field in the same one line."""
    if not isinstance(c.num_experts, int) or c.num_experts < 1:
        _fail("model.moe.num_experts", c.num_experts, "an MoE layer needs an integer >= 1 "
              "(0 turns MoE off in a model's config)")
    X = c.num_experts
    _check_choice("model.moe.router", c.router, MOE_ROUTERS)
    _check_choice("model.moe.dispatch", c.dispatch, ("capacity", "dropless"))
    for name in ("every", "top_k"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
            _fail(f"model.moe.{name}", getattr(c, name), "must be an integer >= 1")
    for name in ("mlp_dim", "shared_experts", "groups", "block_size"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 0:
            _fail(f"model.moe.{name}", getattr(c, name), "must be an integer >= 0")
    if c.top_k > X:
        _fail("model.moe.top_k", c.top_k, f"a token cannot choose more than the "
              f"model.moe.num_experts={X} experts; lower top_k or add experts")
    if c.router == "switch" and c.top_k != 1:
        _fail("model.moe.router", c.router, f"Switch routing is top-1 (model.moe.top_k="
              f"{c.top_k}); use router='top_k' for k >= 2")
    if c.router == "top_k" and c.top_k == 1:
        _fail("model.moe.router", c.router, "top_k gates are a softmax over the chosen logits, "
              "which is 1 for a single choice (the router would learn nothing); use "
              "router='switch' for top-1")
    if c.router == "expert_choice" and c.dispatch != "capacity":
        _fail("model.moe.dispatch", c.dispatch, "expert-choice routing fills each expert's "
              "capacity by construction; use dispatch='capacity'")
    if c.noisy and c.router == "expert_choice":
        _fail("model.moe.noisy", True, "noisy gating is for token-choice routers (top_k, switch)")
    for name in ("capacity_factor", "eval_capacity_factor"):
        v = getattr(c, name)
        if not isinstance(v, (int, float)) or v <= 0:
            _fail(f"model.moe.{name}", v, "must be > 0 (slots per expert = factor x tokens x "
                  "top_k / experts); use model.moe.dispatch='dropless' for no capacity limit")
    _check_positive("model.moe.balance_loss", c.balance_loss, allow_zero=True)
    _check_positive("model.moe.z_loss", c.z_loss, allow_zero=True)


def _check_moe(cfg: Config, sizes: Mapping[str, int]) -> None:
    """`model.moe`: fields, the mesh's expert axis, what MoE combines with (hpnlp.moe)."""
    c, m, t, d = cfg.model.moe, cfg.model, cfg.train, cfg.data
    if not isinstance(c.num_experts, int) or c.num_experts < 0:
        _fail("model.moe.num_experts", c.num_experts, "must be an integer >= 0 (0: no MoE)")
    if not c.enabled():
        default = MoEConfig()
        for f in dataclasses.fields(c):  # a field set without experts would be ignored
            if f.name != "num_experts" and getattr(c, f.name) != getattr(default, f.name):
                _fail(f"model.moe.{f.name}", getattr(c, f.name), "is ignored while "
                      "model.moe.num_experts=0 (no MoE: every block keeps its dense MLP); set "
                      "num_experts > 0 to use it, or leave it at its default "
                      f"{getattr(default, f.name)!r}")
        if sizes["expert"] > 1 and cfg.mesh.mesh_axes_of("batch").count("expert") == 0:
            _fail("mesh.expert", sizes["expert"], "without model.moe the expert axis only splits "
                  "the batch, and mesh.rules.batch does not name it; add 'expert' to "
                  "mesh.rules.batch or set mesh.expert=1")
        return
    check_moe_fields(c)
    default = MoEConfig()
    ignored = [("block_size", "it sizes dropless dispatch's blocks, and dispatch='capacity'")]
    if c.dispatch == "dropless":
        ignored = [(f, "dropless dispatch gives every token its experts, with no capacity")
                   for f in ("capacity_factor", "eval_capacity_factor")]
    if c.router == "expert_choice":
        ignored.append(("balance_loss", "expert-choice routing balances the experts' loads by "
                        "construction (each takes its capacity)"))
    for f, why in ignored:
        if getattr(c, f) != getattr(default, f):
            _fail(f"model.moe.{f}", getattr(c, f), f"is ignored: {why}; leave it at its default "
                  f"{getattr(default, f)!r}")
    X = c.num_experts
    if m.arch != "transformer":
        _fail("model.moe.num_experts", X, f"MoE replaces Transformer MLPs; model.arch={m.arch!r} "
              "has none (use model.arch='transformer' or num_experts=0)")
    if c.every > m.depth:
        _fail("model.moe.every", c.every, f"no block of model.depth={m.depth} would be MoE; "
              f"choose every <= {m.depth}")
    for field, value, on, why in (
            ("model.reversible", True, m.reversible, "reversible blocks recompute themselves "
             "in a custom backward pass that cannot report the router's losses"),
            ("mesh.pipeline", sizes["pipeline"], sizes["pipeline"] > 1, "pipeline stages apply "
             "their layers functionally and cannot report the router's losses"),
            ("quant.act_scale", "static", m.quant.act_scale == "static" and
             m.quant.activations != "none" and m.quant.applies("mlp"), "the experts read their "
             "inputs quantized per token (dynamic), not by calibrated ranges; use "
             "quant.act_scale='dynamic' or leave 'mlp' out of quant.layers")):
        if on:
            _fail(field, value, f"cannot be combined with model.moe: {why}")
    q = m.quant
    if q.group_size and q.applies("mlp") and c.expert_dim(m) % q.group_size:
        _fail("quant.group_size", q.group_size, f"must divide the experts' width "
              f"{c.expert_dim(m)} (int4 groups split their second product's contraction)")
    if m.stack_layers and c.every != 1:
        _fail("model.moe.every", c.every, "stacked layers (model.stack_layers=True) are one "
              "block repeated; use every=1 or model.stack_layers=False")
    ep = sizes["expert"]
    if X % ep:
        _fail("model.moe.num_experts", X, f"must be divisible by mesh.expert={ep} (each "
              f"device holds num_experts / mesh.expert experts)")
    batch_axes = cfg.mesh.mesh_axes_of("batch")
    shards = math.prod(sizes[a] for a in batch_axes)
    if ep > 1:
        if "expert" not in batch_axes:
            _fail("mesh.rules.batch", cfg.mesh.rules.get("batch"), "expert parallelism sends "
                  "each device's own tokens to the experts' devices, so the batch must be split "
                  "over the expert axis too: add 'expert' to mesh.rules.batch")
        if c.dispatch != "capacity":
            _fail("model.moe.dispatch", c.dispatch, f"expert parallelism (mesh.expert={ep}) moves "
                  "fixed-size capacity buffers with all-to-all; use dispatch='capacity'")
        if sizes["sequence"] > 1:
            _fail("mesh.sequence", sizes["sequence"], "expert parallelism routes whole rows; "
                  "set mesh.sequence=1 with mesh.expert > 1")
    groups = c.groups or shards
    rows = {"train.batch_size / train.grad_accum": t.batch_size // t.grad_accum,
            "data.eval_batch_size (or train.batch_size)": d.eval_batch_size or t.batch_size}
    for field, n in rows.items():
        if n % groups:
            _fail("model.moe.groups", c.groups, f"{groups} routing groups must divide the rows the "
                  f"model sees per step, {field} = {n}")
    if shards > 1 and c.dispatch == "capacity" and groups % shards:
        _fail("model.moe.groups", c.groups, f"must be a multiple of the {shards} data-parallel "
              "shards (each device routes whole groups)")


def _check_compress(cfg: Config) -> None:
    """`train.distill` and `train.prune` (hpnlp.compress): fields, and what they combine with."""
    dist, p, m = cfg.train.distill, cfg.train.prune, cfg.model
    if dist.teacher:
        if not 0.0 <= dist.alpha <= 1.0:
            _fail("train.distill.alpha", dist.alpha, "the soft-target weight must be in [0, 1]")
        _check_positive("train.distill.temperature", dist.temperature)
        if not isinstance(dist.chunk_tokens, int) or dist.chunk_tokens < -1:
            _fail("train.distill.chunk_tokens", dist.chunk_tokens, "-1 (automatic), 0 (never) or "
                  "a positive number of tokens")
        _check_positive("train.distill.hidden", dist.hidden, allow_zero=True)
        _check_positive("train.distill.attention", dist.attention, allow_zero=True)
        if dist.attention:
            from hpnlp import attention as attention_lib
            if not attention_lib.get(cfg.attention.name).returns_probabilities:
                _fail("train.distill.attention", dist.attention, f"attention variant "
                      f"{cfg.attention.name!r} does not return its probabilities; use "
                      "attention.name='dense' for attention-map distillation")
        _check_choice("train.distill.init", dist.init, ("none", "every_other", "select",
                                                         "importance", "pca"))
        _check_choice("train.distill.init_blocks", dist.init_blocks, ("first", "last"))
        if dist.init_blocks != "first" and dist.init == "none":
            _fail("train.distill.init_blocks", dist.init_blocks, "picks the teacher blocks the "
                  "student starts as, and train.distill.init='none' starts it from none; set "
                  "train.distill.init to every_other, select, importance or pca")
        if (isinstance(dist.importance_batches, bool) or not isinstance(dist.importance_batches, int)
                or dist.importance_batches < 1):
            _fail("train.distill.importance_batches", dist.importance_batches,
                  "must be a whole number of training batches >= 1")
        blocks = dist.matches_blocks()
        if blocks and (m.kind == "dual_encoder" or m.arch != "transformer"):
            _fail(*blocks, "matches Transformer blocks of an LM or classifier; this run has "
                  f"model.kind={m.kind!r}, model.arch={m.arch!r}")
        if m.arch == "transformer_xl" and cfg.data.batching == "stream":
            _fail("train.distill.teacher", dist.teacher, "Transformer-XL on a stream carries "
                  "memory through its loss and cannot distill yet; use data.batching='pack'")
    _check_choice("train.prune.method", p.method, ("none", "magnitude", "random", "movement"))
    if p.method == "none":
        return
    if not (isinstance(p.sparsity, (int, float)) and 0.0 <= p.sparsity < 1.0):
        _fail("train.prune.sparsity", p.sparsity, "the fraction pruned must be in [0, 1)")
    _check_choice("train.prune.scope", p.scope, ("layer", "global"))
    _check_choice("train.prune.schedule", p.schedule, ("oneshot", "cubic", "imp"))
    if p.schedule == "imp":
        for name in ("rounds", "rewind_step"):
            v = getattr(p, name)
            if not isinstance(v, int) or v < (1 if name == "rounds" else 0):
                _fail(f"train.prune.{name}", v, "must be an integer >= "
                      + ("1 (pruning rounds)" if name == "rounds" else "0"))
        if (cfg.train.steps - p.rewind_step) < p.rounds + 1:
            _fail("train.prune.rounds", p.rounds, f"train.steps={cfg.train.steps} after "
                  f"rewind_step={p.rewind_step} cannot make rounds + 1 training segments")
        if p.method not in ("magnitude", "random") or p.structure != "unstructured":
            _fail("train.prune.schedule", p.schedule, "iterative pruning with rewinding takes "
                  "method 'magnitude' (or 'random', the control) and structure 'unstructured'")
    for name in ("start_step", "end_step"):
        v = getattr(p, name)
        if not isinstance(v, int) or v < 0:
            _fail(f"train.prune.{name}", v, "must be an integer >= 0")
    _check_positive("train.prune.l1", p.l1, allow_zero=True)
    if not isinstance(p.every, int) or p.every < 1:
        _fail("train.prune.every", p.every, "must be an integer >= 1 (steps between mask updates)")
    if m.stack_layers or m.reversible:
        _fail("model.stack_layers" if m.stack_layers else "model.reversible", True, "pruning "
              "masks are per layer; prune a model with model.stack_layers=False and "
              "model.reversible=False")
    end = p.end_step or cfg.train.steps
    if p.schedule == "cubic" and end <= p.start_step:
        _fail("train.prune.end_step", p.end_step, f"the cubic schedule needs end_step (0: "
              f"train.steps={cfg.train.steps}) after start_step={p.start_step}")
    # found in review: schedules past the run were accepted, and pruned nothing (or never
    # reached their sparsity) without a word
    if p.schedule != "imp" and p.start_step >= cfg.train.steps:
        _fail("train.prune.start_step", p.start_step, f"pruning would start after the run's "
              f"last step (train.steps={cfg.train.steps}, steps 0..{cfg.train.steps - 1}); "
              "choose a start_step below train.steps")
    if p.schedule == "cubic" and p.end_step > cfg.train.steps:
        _fail("train.prune.end_step", p.end_step, f"the cubic schedule would not reach its "
              f"sparsity within train.steps={cfg.train.steps}; choose end_step <= train.steps "
              "(0: the run's end)")
    _check_layers("train.prune.layers", p.layers, QUANT_LAYERS)
    if p.structure == "structured":
        if m.arch in ("lstm", "gru"):  # hidden units: model.width channels (compress.prune)
            if cfg.rnn.layer_norm:
                _fail("rnn.layer_norm", True, "structured pruning removes hidden units, but layer "
                      "norm mixes every unit's gates (removing one renormalizes the rest); set "
                      "rnn.layer_norm=False or use train.prune.structure='unstructured'")
            if cfg.rnn.bidirectional:
                _fail("rnn.bidirectional", True, "structured pruning cannot remove hidden units of "
                      "a bidirectional layer yet; set rnn.bidirectional=False")
            if m.kind not in ("lm", "classifier"):
                _fail("model.kind", m.kind, "structured pruning of an LSTM/GRU knows the "
                      "consumers of the 'lm' and 'classifier' trunks only")
            if m.kind == "lm" and cfg.output.name != "full":
                _fail("output.name", cfg.output.name, "structured pruning of an LSTM/GRU removes "
                      "hidden units from the 'full' output layer only")
            if not (layers_name(p.layers, "input") and layers_name(p.layers, "recurrent")):
                _fail("train.prune.layers", p.layers, "an LSTM/GRU hidden unit owns input and "
                      "recurrent weights; name both (e.g. 'input,recurrent')")
        elif m.arch != "transformer":
            _fail("train.prune.structure", p.structure, "structured pruning removes Transformer "
                  f"heads and MLP neurons and LSTM/GRU hidden units; model.arch={m.arch!r} has "
                  "none: use 'unstructured' or 'N:M'")
        if p.method not in ("magnitude", "random"):
            _fail("train.prune.method", p.method, "structured pruning ranks whole heads and "
                  "neurons by 'magnitude' (their weights' L2 norm) or 'random'")
        if p.scope != "layer":
            _fail("train.prune.scope", p.scope, "structured pruning removes the same number of "
                  "heads and neurons from every block (so the shrunk model is one config); set "
                  "train.prune.scope='layer'")
        from hpnlp import attention as attention_lib
        heads = m.arch == "transformer" and (layers_name(p.layers, "qkv")
                                             or layers_name(p.layers, "out"))
        if heads and m.kv_heads() < m.num_heads:
            _fail("train.prune.structure", p.structure, f"model.num_kv_heads={m.num_kv_heads} "
                  "shares each key/value head among query heads, so removing a head is not one "
                  "slice of each product; set train.prune.layers='mlp' (or prune a multi-head "
                  "model)")
        if heads and m.kv_latent_dim:
            _fail("train.prune.structure", p.structure, f"model.kv_latent_dim={m.kv_latent_dim} "
                  "derives every head's keys and values from one shared latent, so removing a "
                  "head is not one slice of each product; set train.prune.layers='mlp'")
        if heads and not attention_lib.get(cfg.attention.name).heads_independent:
            free = [n for n in attention_lib.names() if attention_lib.get(n).heads_independent]
            _fail("train.prune.structure", p.structure, f"attention variant "
                  f"{cfg.attention.name!r} has per-head parameters or random draws, so its heads "
                  f"cannot be removed; use a variant whose heads are independent ({', '.join(free)}) "
                  "or set train.prune.layers='mlp'")
        extra = sorted(k for k in QUANT_LAYERS if layers_name(p.layers, k)
                       and k not in ("qkv", "out", "mlp", "input", "recurrent"))
        if extra:
            _fail("train.prune.layers", p.layers, f"structured pruning removes heads (qkv, out), "
                  f"MLP neurons (mlp) and LSTM/GRU hidden units (input, recurrent); {extra} have "
                  "no such units")
    elif p.structure != "unstructured":
        try:
            n, mm = (int(v) for v in p.structure.split(":"))
        except ValueError:
            n = mm = None
        if n is None or not 0 < n < mm:
            _fail("train.prune.structure", p.structure, "'unstructured', 'structured' (heads and "
                  "MLP neurons) or 'N:M' with 0 < N < M (e.g. '2:4': 2 kept in every 4 weights "
                  "along the contraction)")
        if p.scope != "layer":
            _fail("train.prune.scope", p.scope, "N:M groups are pruned each on its own; set "
                  "train.prune.scope='layer'")
        if p.schedule != "oneshot":
            _fail("train.prune.schedule", p.schedule, "N:M masks are made once, at start_step; "
                  "set train.prune.schedule='oneshot'")
        widths = [("model.width", m.width), ("model.mlp_dim", m.mlp_dim),
                  ("model.num_heads * head size", m.num_heads * m.dims_per_head())]
        if m.moe.enabled():  # found in review: the experts' own width went unchecked
            widths.append(("model.moe.mlp_dim (each expert's width)", m.moe.expert_dim(m)))
        for field, width in widths:
            if width % mm:
                _fail("train.prune.structure", p.structure, f"M={mm} must divide {field}={width} "
                      "(groups split each product's contraction)")


def _check_kv_cache(cfg: Config) -> None:
    from hpnlp import attention  # the registry; imported late to avoid cycles

    m, q = cfg.model, cfg.model.quant
    _check_choice("quant.kv_cache", q.kv_cache, ("none", "int8"))
    if q.kv_cache == "none":
        return
    if m.kind != "lm" or m.arch != "transformer":
        _fail("quant.kv_cache", q.kv_cache, f"is the key/value cache a Transformer LM decodes "
              f"through (model.kind='lm', model.arch='transformer'); this is kind={m.kind!r}, "
              f"arch={m.arch!r}; set quant.kv_cache='none'")
    if not attention.get(cfg.attention.name).exact_cache():
        _fail("quant.kv_cache", q.kv_cache, f"attention.name={cfg.attention.name!r} decodes "
              "through a cache of its own, not the exact key/value cache that int8 codes "
              "replace; use a variant that keeps it (e.g. dense or chunked) or "
              "quant.kv_cache='none'")


def _check_kv_heads(m: ModelConfig) -> None:
    G = m.num_kv_heads
    if not isinstance(G, int) or isinstance(G, bool) or G < 0:
        _fail("model.num_kv_heads", G, "must be an integer >= 0 (0: model.num_heads, multi-head)")
    if G and (G > m.num_heads or m.num_heads % G):
        _fail("model.num_kv_heads", G, f"must divide model.num_heads={m.num_heads} (each key/value "
              "head serves the same number of query heads); 1 is multi-query attention")
    if m.kv_heads() < m.num_heads and m.arch != "transformer":
        _fail("model.num_kv_heads", G, f"grouped key/value heads are the Transformer's "
              f"(model.arch='transformer'); model.arch={m.arch!r} has its own attention or none; "
              "set model.num_kv_heads=0")


def _check_kv_latent(cfg: Config) -> None:
    m = cfg.model
    C, R = m.kv_latent_dim, m.kv_latent_rope_dim
    for name, v in (("model.kv_latent_dim", C), ("model.kv_latent_rope_dim", R)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            _fail(name, v, "must be an integer >= 0 (0: off)")
    if R and not C:
        _fail("model.kv_latent_rope_dim", R, "sizes the rotary part of multi-head latent "
              "attention's keys; set model.kv_latent_dim too, or leave it 0")
    if not isinstance(m.kv_latent_norm, bool):
        _fail("model.kv_latent_norm", m.kv_latent_norm, "must be true or false")
    if not m.kv_latent_norm and not C:
        _fail("model.kv_latent_norm", False, "switches off the latent's layer norm in multi-head "
              "latent attention; set model.kv_latent_dim too, or leave it true")
    if not C:
        return
    if m.arch != "transformer":
        _fail("model.kv_latent_dim", C, f"multi-head latent attention is the Transformer's "
              f"(model.arch='transformer'); model.arch={m.arch!r} has its own attention or none; "
              "set model.kv_latent_dim=0")
    if m.kv_heads() < m.num_heads:
        _fail("model.kv_latent_dim", C, f"the latent replaces grouped key/value heads "
              f"(model.num_kv_heads={m.num_kv_heads}): every head's keys and values come from "
              "it; set model.num_kv_heads=0 (or model.kv_latent_dim=0)")
    D = m.dims_per_head()
    if R and m.pos_emb != "rope":
        _fail("model.kv_latent_rope_dim", R, f"is the rotary part of each head, and "
              f"model.pos_emb={m.pos_emb!r} rotates nothing; set model.pos_emb='rope' or leave "
              "it 0")
    if m.pos_emb == "rope":
        R = m.latent_rope_dims()
        if R % 2 or not 0 < R < D:
            _fail("model.kv_latent_rope_dim" if m.kv_latent_rope_dim else "model.head_dim",
                  m.kv_latent_rope_dim or D, f"the rotary dims R={R} of each head must be even "
                  f"and below its {D} dims (the rest are the latent's); set "
                  "model.kv_latent_rope_dim to an even number below model.head_dim")


def validate(cfg: Config, *, task_info: Mapping[str, Any] | None = None,
             num_devices: int | None = None, num_processes: int = 1) -> Config:
    """Check every field; returns the config with task-derived fields filled in.

    `task_info` has `kind` ("lm" | "classify" | "match"), `vocab_size`, `num_classes`;
    it comes from `hpnlp.data.task_info(cfg.data)` without building the data set.
    """
    from hpnlp import attention, softmax  # registries; imported late to avoid cycles

    m, t, d = cfg.model, cfg.train, cfg.data
    _check_choice("model.kind", m.kind, ("lm", "classifier", "dual_encoder", "bi_encoder"))
    for name in ("width", "depth", "num_heads", "mlp_dim", "max_len"):
        _check_positive(f"model.{name}", getattr(m, name))
    if not isinstance(m.head_dim, int) or m.head_dim < 0:
        _fail("model.head_dim", m.head_dim, "must be an integer >= 0 (0: width / num_heads)")
    if not m.head_dim and m.width % m.num_heads:
        _fail("model.width", m.width,
              f"must be divisible by model.num_heads={m.num_heads} (head_dim = width / heads), "
              "or set model.head_dim")
    _check_kv_heads(m)
    if not 0.0 <= m.dropout < 1.0:
        _fail("model.dropout", m.dropout, "must be in [0, 1)")
    _check_choice("model.pos_emb", m.pos_emb, ("learned", "sinusoidal", "rope"))
    if m.pos_emb == "rope" and m.dims_per_head() % 2:
        _fail("model.pos_emb", m.pos_emb, f"RoPE rotates pairs of dims, and each head has "
              f"{m.dims_per_head()} (odd); set model.head_dim (or model.width / model.num_heads) "
              "even, or use model.pos_emb='learned'")
    _check_choice("model.pool", m.pool, ("mean", "first"))
    if m.causal not in (True, False):
        _fail("model.causal", m.causal, "must be true or false")
    if m.causal and m.kind != "classifier":
        _fail("model.causal", m.causal, f"makes a classifier's attention causal; a "
              f"model.kind={m.kind!r} model is " + ("always causal" if m.kind == "lm" else
                                                    "not") + "; leave it false")
    if m.causal and m.arch != "transformer":
        _fail("model.causal", m.causal, f"applies to Transformer classifiers; a model.arch="
              f"{m.arch!r} trunk reads in its own order; leave it false")
    if m.causal and m.pool == "first":
        _fail("model.causal", m.causal, "with model.pool='first' the pooled token would see only "
              "itself; set model.pool='mean'")
    if m.arch in ("lstm", "gru") and m.kind == "classifier" and m.pool == "first" \
            and not cfg.rnn.bidirectional:  # found in review: it read one token
        _fail("model.pool", m.pool, f"a left-to-right {m.arch.upper()}'s first output has read "
              "only the first token; set model.pool='mean' or rnn.bidirectional=True")
    _check_choice("model.param_dtype", m.param_dtype, DTYPES)
    _check_choice("model.dtype", m.dtype, DTYPES)
    if m.param_dtype == "float16":
        _fail("model.param_dtype", m.param_dtype, "float16 master weights lose small updates; keep "
              "model.param_dtype='float32' and set model.dtype='float16' (loss scaling is automatic)")
    _check_remat(m.remat)
    if not isinstance(m.reversible, bool):
        _fail("model.reversible", m.reversible, "must be True or False")
    if m.reversible and m.arch != "transformer":
        _fail("model.reversible", True, f"reversible blocks are Transformer blocks; "
              f"model.arch={m.arch!r} has none (set model.reversible=False)")
    if m.reversible and m.remat != "none":
        _fail("model.remat", m.remat, "model.reversible=True already recomputes each block in the "
              "backward pass; set model.remat='none'")
    _check_choice("model.arch", m.arch, ("transformer", "transformer_xl", "lstm", "gru", "bag"))
    if m.arch == "bag" and m.kind != "bi_encoder":
        _fail("model.arch", m.arch, "a bag of embeddings has no sequence model, only the "
              "bi-encoder pools one; set model.kind='bi_encoder' or another model.arch")
    _check_choice("model.embed_grad_scale", m.embed_grad_scale, ("none", "batch", "corpus"))
    _check_encoder(cfg)
    if not isinstance(m.mem_len, int) or m.mem_len < 0:
        _fail("model.mem_len", m.mem_len, "must be an integer >= 0 (0: = data.seq_len)")
    if m.arch == "transformer_xl":
        if m.pos_emb == "rope":
            _fail("model.pos_emb", m.pos_emb, "model.arch='transformer_xl' has its own relative "
                  "positions (which ignore model.pos_emb); set model.pos_emb='learned'")
        if m.kind != "lm":
            _fail("model.arch", m.arch, "Transformer-XL memory is for causal LMs; set model.kind='lm'")
        if cfg.attention.name != "dense":
            _fail("attention.name", cfg.attention.name, "model.arch='transformer_xl' has its own "
                  "exact relative-position attention; set attention.name='dense'")
        if d.batching == "stream" and t.grad_accum != 1:
            _fail("train.grad_accum", t.grad_accum, "Transformer-XL on stream batches carries each "
                  "row's memory to the next step, which microbatches would break; set "
                  "train.grad_accum=1")
    _check_compressive(cfg)
    if not isinstance(m.stack_layers, bool):
        _fail("model.stack_layers", m.stack_layers, "must be True or False")
    if m.stack_layers and m.arch != "transformer":
        _fail("model.stack_layers", True, f"it stacks Transformer blocks; model.arch={m.arch!r} has "
              "none (set model.stack_layers=False)")
    if m.stack_layers and m.reversible:
        _fail("model.stack_layers", True, "reversible blocks keep their own stack "
              "(models/reversible.py); set model.stack_layers=False or model.reversible=False")
    _check_quant(m.quant, m)
    q = m.quant
    if q.enabled and m.kind == "lm" and "output" in {n.strip() for n in q.layers.split(",")}:
        from hpnlp import softmax  # found in review: ignored, the layer evaluated float
        if cfg.output.name in softmax.names() and "quant" not in {
                f.name for f in dataclasses.fields(softmax.get(cfg.output.name))}:
            _fail("quant.layers", q.layers, f"names the output layer, but output layer "
                  f"{cfg.output.name!r} keeps its own tables, which are not quantized yet; drop "
                  "'output' (the layer stays float) or use output.name='full' (or another "
                  "VocabLayer: sampled, nce, ...)")
    _check_kv_cache(cfg)
    _check_kv_latent(cfg)
    _check_choice("train.init_kv_heads", t.init_kv_heads, ("mean", "svd"))
    _check_choice("train.init_params", t.init_params, ("all", "trunk"))
    if t.init_params != "all" and not t.init_from:
        _fail("train.init_params", t.init_params, "chooses what this run takes of the run "
              "train.init_from names; set train.init_from, or leave it 'all'")
    if t.init_params == "trunk":
        defaults = type(t)()
        for field in ("init_kv_heads", "init_kv_calibration", "init_experts",
                      "init_expert_batches"):
            value, default = getattr(t, field), getattr(defaults, field)
            if value != default:
                _fail(f"train.{field}", value, "converts a run of the same task, and "
                      "train.init_params='trunk' copies another task's trunk as it is; convert "
                      f"that run first (its own fine-tune), or leave train.{field}={default!r}")
    _check_choice("train.init_experts", t.init_experts, ("routed", "random", "merged"))
    if (not isinstance(t.init_expert_batches, int) or isinstance(t.init_expert_batches, bool)
            or t.init_expert_batches < 1):
        _fail("train.init_expert_batches", t.init_expert_batches, "must be an integer >= 1 "
              "(training batches routed to rank the experts a run of fewer keeps)")
    if t.init_experts != "routed" and not t.init_from:
        _fail("train.init_experts", t.init_experts, "chooses the experts a run keeps of the run "
              "train.init_from names; set train.init_from, or leave it 'routed'")
    if (not isinstance(t.init_kv_calibration, int) or isinstance(t.init_kv_calibration, bool)
            or t.init_kv_calibration < 0):
        _fail("train.init_kv_calibration", t.init_kv_calibration, "must be an integer >= 0 "
              "(batches; 0: fit the weights alone)")
    if t.init_kv_calibration and not t.init_from:
        _fail("train.init_kv_calibration", t.init_kv_calibration, "weights the SVD fits that "
              "convert the run train.init_from names; set train.init_from, or leave it 0")
    if t.init_kv_heads == "svd" and not t.init_from:
        _fail("train.init_kv_heads", "svd", "converts the key/value heads of the run "
              "train.init_from names; set train.init_from, or leave it 'mean'")
    _check_compress(cfg)
    _check_lowrank(cfg)
    _check_memory(cfg)
    r = cfg.rnn
    _check_choice("rnn.combine", r.combine, ("last", "sum", "residual"))
    for name in ("variational_dropout", "state_dropout", "recurrent_dropout", "zoneout", "weight_drop"):
        rate = getattr(r, name)
        if not (isinstance(rate, (int, float)) and 0.0 <= rate < 1.0):
            _fail(f"rnn.{name}", rate, "must be a probability in [0, 1)")
    _check_positive("rnn.unroll", r.unroll)
    _check_choice("rnn.impl", r.impl, ("auto", "scan", "fused"))
    if r.impl == "fused" and m.arch in ("lstm", "gru"):
        blocker = ("model.arch='gru'" if m.arch == "gru" else "rnn.layer_norm=True" if r.layer_norm
                   else "rnn.zoneout > 0" if r.zoneout > 0 else None)
        if blocker:
            _fail("rnn.impl", "fused", f"the fused kernel is a plain LSTM and {blocker}; use "
                  "rnn.impl='auto' (the kernel where it applies) or 'scan'")
    if m.arch != "transformer" and m.kind == "lm" and r.bidirectional:
        _fail("rnn.bidirectional", True, "a language model reads left to right; bidirectional "
              "layers are for model.kind='classifier' or 'dual_encoder'")

    # Attention: registry name, options, and the variant's own shape rules.
    if cfg.attention.name not in attention.names():
        _fail("attention.name", cfg.attention.name, f"choose one of {attention.names()}")
    att_cls = attention.get(cfg.attention.name)
    _check_options("attention.options", cfg.attention.options, att_cls)
    causal = m.kind == "lm" or m.causal
    check = getattr(att_cls, "check_config", None)
    if check is not None:
        check(dict(cfg.attention.options), seq_len=d.seq_len, causal=causal,
              field="attention.options")
        if d.batching == "bucket":  # every bucket width is a sequence length the model sees
            from hpnlp.data.batching import bucket_boundaries
            for width in bucket_boundaries(d):
                try:
                    check(dict(cfg.attention.options), seq_len=width, causal=causal,
                          field="attention.options")
                except ConfigError as e:
                    which = "data.bucket_boundaries" if d.bucket_boundaries else \
                        "the default data.bucket_boundaries"
                    raise ConfigError(
                        f"{e} -- here the length is bucket width {width} from {which}; set "
                        "data.bucket_boundaries to multiples of the block sizes") from None

    if cfg.output.name not in softmax.names():
        _fail("output.name", cfg.output.name, f"choose one of {softmax.names()}")
    _check_options("output.options", cfg.output.options, softmax.get(cfg.output.name))

    # Training.
    for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints",
                 "loss_scale_init", "loss_scale_period"):
        _check_positive(f"train.{name}", getattr(t, name))
    for name in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every",
                 "clip_norm", "weight_decay", "early_stopping_patience", "feature_redraw_every"):
        _check_positive(f"train.{name}", getattr(t, name), allow_zero=True)
    _check_positive("train.lr", t.lr)
    _check_choice("train.schedule", t.schedule, ("cosine", "linear", "constant"))
    # found in review: these took any number (end_lr_frac -1 ascended the loss after its middle)
    if not 0 <= t.end_lr_frac <= 1:
        _fail("train.end_lr_frac", t.end_lr_frac, "the final learning rate as a fraction of "
              "train.lr must be in [0, 1]")
    for name in ("b1", "b2"):
        if not 0 <= getattr(t, name) < 1:
            _fail(f"train.{name}", getattr(t, name), "Adam's moment decay must be in [0, 1)")
    if t.warmup_steps > t.steps or (t.schedule != "constant" and t.warmup_steps >= t.steps):
        _fail("train.warmup_steps", t.warmup_steps,
              f"must be < train.steps={t.steps} (the {t.schedule!r} decay needs steps after warmup)")
    metrics = ("loss", "accuracy", "ppl") if m.kind == "lm" else ("loss", "accuracy")
    _check_choice("train.early_stopping_metric", t.early_stopping_metric, metrics)

    # Data.
    from hpnlp import data as data_lib
    if d.task not in data_lib.task_names():
        _fail("data.task", d.task, f"choose one of {data_lib.task_names()}")
    _check_positive("data.seq_len", d.seq_len)
    _check_choice("data.batching", d.batching, ("pad", "bucket", "pack", "stream"))
    _check_choice("data.eval_split", d.eval_split, ("eval", "validation"))
    if d.eval_split == "validation":
        for field in ("train_path", "eval_path", "prepared"):
            if getattr(d, field):
                _fail("data.eval_split", d.eval_split,
                      f"'validation' holds out part of the shipped corpus or of generated "
                      f"ListOps, and data.{field} is set; with your own data pass a validation "
                      "file as data.eval_path and keep data.eval_split='eval'")
        if d.task == "listops" and d.listops_num_train <= d.listops_num_eval:
            _fail("data.eval_split", d.eval_split,
                  f"'validation' holds out data.listops_num_eval={d.listops_num_eval} of the "
                  f"data.listops_num_train={d.listops_num_train} generated training examples; "
                  "raise data.listops_num_train above it")
    from hpnlp.data.tokenizers import KINDS as tokenizer_kinds
    _check_choice("data.tokenizer", d.tokenizer, ("",) + tokenizer_kinds)
    # sinusoidal and rope positions have no table: rows longer than model.max_len train, and
    # only decoding (generate: length <= model.max_len, the cache's size) is bounded by it
    if d.seq_len > m.max_len and m.pos_emb == "learned" and m.arch != "transformer_xl":
        _fail("data.seq_len", d.seq_len,
              f"must be <= model.max_len={m.max_len} (the learned position table); "
              "raise model.max_len or use model.pos_emb='sinusoidal' or 'rope'")
    if any(b <= 0 or b > d.seq_len for b in d.bucket_boundaries):
        _fail("data.bucket_boundaries", d.bucket_boundaries,
              f"every boundary must be in [1, data.seq_len={d.seq_len}]")

    info = dict(task_info) if task_info is not None else data_lib.task_info(d)
    want_kind = {"lm": "lm", "classifier": "classify", "dual_encoder": "match",
                 "bi_encoder": "match"}[m.kind]
    if info["kind"] != want_kind:
        kinds = {"lm": "lm", "classify": "classifier", "match": "dual_encoder"}
        _fail("model.kind", m.kind,
              f"data.task={d.task!r} is a {info['kind']!r} task and needs "
              f"model.kind={kinds[info['kind']]!r}")
    if d.batching == "pack" and not getattr(att_cls, "supports_segments", True):
        _fail("data.batching", d.batching,
              f"attention {cfg.attention.name!r} takes padding as lengths only (one segment per "
              "row), so packed rows cannot be separated; use data.batching='pad' or another attention")
    if d.batching == "stream" and m.arch == "transformer":
        _fail("data.batching", d.batching, "stream batches continue each row across batches for "
              "Transformer-XL memory, so positions grow past model.max_len, and a plain "
              "Transformer has absolute positions and no memory; use data.batching='pack' or "
              "'pad', or model.arch='transformer_xl'")
    if d.batching in ("pack", "stream") and info["kind"] != "lm":
        _fail("data.batching", d.batching, f"{d.batching!r} is for LM tasks; use 'pad' or 'bucket'")
    if m.vocab_size and m.vocab_size < info["vocab_size"]:
        _fail("model.vocab_size", m.vocab_size,
              f"data.task={d.task!r} has {info['vocab_size']} token ids; use 0 to take it from the task")
    if m.num_classes and m.num_classes < info.get("num_classes", 0):
        _fail("model.num_classes", m.num_classes,
              f"data.task={d.task!r} has {info['num_classes']} classes; use 0 to take it from the task")
    model = dataclasses.replace(
        m, vocab_size=m.vocab_size or info["vocab_size"],
        num_classes=m.num_classes or info.get("num_classes", 0))
    lr, V, C = m.lowrank, model.vocab_size, model.num_classes
    for kind in ("embed", "output"):  # the [V, E] tables, now that V is known
        if lr.rank and lr.applies(kind) and V and lr.rank > min(V, m.width):
            _fail("model.lowrank.rank", lr.rank, f"the {kind} table is [{V}, {m.width}], of "
                  f"rank at most {min(V, m.width)}; lower the rank or drop {kind!r} from "
                  "model.lowrank.layers")
    # the heads' products (`head`), now that the classes are known: a classifier's [E, C]; a
    # dual encoder's MLP over [u, v, u v, u - v], [4 E, mlp_dim], then [mlp_dim, C]
    heads = {"classifier": [(m.width, C)],
             "dual_encoder": [(4 * m.width, m.mlp_dim), (m.mlp_dim, C)]}.get(m.kind, [])
    for k, n in heads:
        if lr.rank and lr.applies("head") and C and lr.rank > min(k, n):
            _fail("model.lowrank.rank", lr.rank, f"the head product is [{k}, {n}] (data.task="
                  f"{d.task!r} has {C} classes), of rank at most {min(k, n)}; lower the rank or "
                  "drop 'head' from model.lowrank.layers")
    if m.kind == "lm" and getattr(softmax.get(cfg.output.name), "requires_tied", False) \
            and not cfg.output.tie_embeddings:
        _fail("output.tie_embeddings", False, f"output layer {cfg.output.name!r} predicts the "
              "target's input embedding, so it needs the tied table; set "
              "output.tie_embeddings=True")
    if m.kind == "lm" and cfg.output.tie_embeddings:
        tieable = [n for n in softmax.names() if softmax.can_tie(n)]
        if cfg.output.name not in tieable:
            _fail("output.tie_embeddings", True, f"output layer {cfg.output.name!r} cannot share the "
                  f"input embedding; set output.tie_embeddings=False, or use one of {tieable}")
    if m.kind == "lm":  # the output layer's own rules, now that the vocabulary is known
        softmax.check_config(cfg.output.name, cfg.output.options, vocab_size=model.vocab_size,
                             frequency_sorted=info.get("frequency_sorted"))

    # Devices and batch.
    import jax
    n = jax.device_count() if num_devices is None else num_devices
    mesh = cfg.mesh
    for name in MESH_AXES:
        v = getattr(mesh, name)
        if not isinstance(v, int) or v == 0 or v < -1:
            _fail(f"mesh.{name}", v, "must be a positive axis size or -1 (fill the rest)")
    filled = [a for a in MESH_AXES if getattr(mesh, a) == -1]
    if len(filled) > 1:
        _fail("mesh", {a: -1 for a in filled}, "at most one axis may be -1")
    sizes = mesh.axis_sizes(n)
    if math.prod(sizes.values()) != n or 0 in sizes.values():
        shown = {a: getattr(mesh, a) for a in MESH_AXES}
        _fail("mesh", shown, f"the axis sizes must multiply to the device count {n} "
              f"(got {sizes}); set one axis to -1 to fill the rest")
    for logical, axes in mesh.rules.items():
        if logical not in DEFAULT_RULES:
            _fail(f"mesh.rules.{logical}", axes,
                  f"unknown logical axis name; the models use {sorted(DEFAULT_RULES)}")
        named = (axes,) if isinstance(axes, str) else tuple(axes or ())
        for a in named:
            if a not in MESH_AXES:
                _fail(f"mesh.rules.{logical}", axes,
                      f"{a!r} is not a mesh axis; use None (replicated) or names from {list(MESH_AXES)}")
        if len(set(named)) != len(named):
            _fail(f"mesh.rules.{logical}", axes, "names a mesh axis twice")
    # Every dimension the rules shard must split evenly over its mesh axes.
    dims = {"heads": {"model.num_heads": m.num_heads},
            "kv_heads": {"model.num_kv_heads": m.kv_heads()} if m.kv_heads() < m.num_heads else {},
            "mlp": {"model.mlp_dim": m.mlp_dim},
            "vocab": {"model.vocab_size": model.vocab_size}, "embed": {"model.width": m.width},
            "kv": {"model.head_dim": m.dims_per_head()},
            "layers": {"model.depth": m.depth}}
    for logical, named in dims.items():
        split = math.prod(sizes[a] for a in mesh.mesh_axes_of(logical))
        for name, dim in named.items():
            if dim % split:
                axes = " x ".join(f"mesh.{a}={sizes[a]}" for a in mesh.mesh_axes_of(logical))
                _fail(f"mesh.rules.{logical}", mesh.rules.get(logical),
                      f"it splits {name}={dim} over {axes} = {split}, which does not divide it; "
                      "change the axis size or map the rule to None")
    if sizes["sequence"] > 1 and cfg.attention.name != "ring":
        _fail("mesh.sequence", sizes["sequence"],
              "sequence parallelism splits every sequence over devices and needs "
              "attention.name='ring' (exact attention passing key/value blocks around the ring)")
    if sizes["sequence"] > 1 and d.seq_len % sizes["sequence"]:
        _fail("data.seq_len", d.seq_len, f"must be a multiple of mesh.sequence={sizes['sequence']}")
    if sizes["sequence"] > 1 and d.batching == "bucket":  # found in review: failed mid-run
        from hpnlp.data.batching import bucket_boundaries
        odd = [w for w in bucket_boundaries(d) if w % sizes["sequence"]]
        if odd:
            _fail("data.bucket_boundaries", list(d.bucket_boundaries) or "(default)",
                  f"bucket widths {odd} do not split over mesh.sequence={sizes['sequence']}; "
                  f"give widths that are multiples of {sizes['sequence']}")
    _check_moe(cfg, sizes)
    shards = math.prod(sizes[a] for a in mesh.mesh_axes_of("batch"))
    per_step = t.grad_accum * math.lcm(shards, num_processes)
    if t.batch_size % per_step:
        _fail("train.batch_size", t.batch_size,
              f"must be a multiple of train.grad_accum x data-parallel shards = "
              f"{t.grad_accum} x lcm({shards} devices, {num_processes} processes) = {per_step}")
    eval_bs = d.eval_batch_size or t.batch_size
    if eval_bs % math.lcm(shards, num_processes):
        _fail("data.eval_batch_size", eval_bs,
              f"must be a multiple of {math.lcm(shards, num_processes)} (data-parallel shards)")
    # Pipeline (GPipe, parallel/pipeline.py): stages split the stacked layer axis, and each
    # batch the trunk sees splits into microbatches. model.depth % mesh.pipeline is the
    # `layers` rule's check above.
    stages, micro = sizes["pipeline"], mesh.pipeline_microbatches
    if not isinstance(micro, int) or micro < 0:
        _fail("mesh.pipeline_microbatches", micro, "must be an integer >= 0 (0: = mesh.pipeline)")
    if stages > 1:
        if m.arch != "transformer":
            _fail("mesh.pipeline", stages, f"pipeline stages are Transformer blocks; model.arch="
                  f"{m.arch!r} has none; set mesh.pipeline=1")
        if not m.stack_layers:
            _fail("mesh.pipeline", stages, "pipeline stages split the stacked layer axis; set "
                  "model.stack_layers=True (or mesh.pipeline=1)")
        if sizes["sequence"] > 1:  # ring attention's shard_map does not nest in the stages' yet
            _fail("mesh.pipeline", stages, f"pipeline stages cannot yet run ring attention over "
                  f"mesh.sequence={sizes['sequence']}; set mesh.sequence=1 or mesh.pipeline=1")
        if mesh.mesh_axes_of("layers") != ("pipeline",):
            _fail("mesh.rules.layers", mesh.rules.get("layers"),
                  "must be 'pipeline' when mesh.pipeline > 1 (each stage holds its own layers)")
        n_micro = micro or stages
        for field, rows in (("train.batch_size / train.grad_accum", t.batch_size // t.grad_accum),
                            ("data.eval_batch_size (or train.batch_size)", eval_bs)):
            if rows % n_micro:
                _fail("mesh.pipeline_microbatches", micro,
                      f"{n_micro} microbatches must divide the batch the model sees per step, "
                      f"{field} = {rows}; choose a divisor of {rows}")
    return dataclasses.replace(cfg, model=model)
