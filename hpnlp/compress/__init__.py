"""Model compression: quantization (PTQ and QAT, int8 to binary), distillation, pruning,
low-rank factorization and smaller key/value caches, with `python -m hpnlp.compress` for
what acts on a trained run (`quantize`, `shrink`, `sparsify`) and config fields for what trains.

- `formats`: the quantization formats (int8, int4, fp8, binary, ternary, pow2), their
  codes and scales, and `fake_quant` with the straight-through estimator.
- `calibrate`: clipping ranges by absmax, percentile or least squared error.
- `qlinear`: `qeinsum` and `Dense`, the products every model builds; `QWeight`, a packed
  weight in a parameter tree.
- `packing`: int4 two per byte, binary eight per byte.
- `ptq`: post-training quantization of a trained run (`python -m hpnlp.compress quantize`).
- `distill`: a frozen teacher's soft targets, hidden states and attention maps
  (`train.distill.*`), and students initialized from its weights.
- `prune`: masks in the train state (`train.prune.*`), and `shrink` for structured ones.
- `lowrank`: products factorized by truncated SVD (`model.lowrank.*`).
- `gqa`, `mla`: a multi-head run uptrained into grouped key/value heads (averaged, or
  fitted by SVD) or converted into a latent (joint SVD), by `train.init_from`.
- `experts`: an MoE run into fewer experts (the most routed kept), or a dense run
  upcycled into experts, by `train.init_from`.
- `kernels`, `qgemm.cc`: the integer CPU products a quantized model runs on.
- `spmm`, `spmm.cc`: the sparse (CSC) CPU product of a pruned weight; `sparsify` serves a
  pruned run by it (`python -m hpnlp.compress sparsify`).

Quantization-aware training is the `quant.*` config group on any experiment.
"""
