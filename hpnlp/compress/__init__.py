"""Model compression: quantization (PTQ and QAT, int8 to binary), with more to come
(distillation, pruning, low-rank) behind the same `python -m hpnlp.compress` entry point.

- `formats`: the quantization formats (int8, int4, fp8, binary, ternary, pow2), their
  codes and scales, and `fake_quant` with the straight-through estimator.
- `calibrate`: clipping ranges by absmax, percentile or least squared error.
- `qlinear`: `qeinsum` and `Dense`, the products every model builds; `QWeight`, a packed
  weight in a parameter tree.
- `packing`: int4 two per byte, binary eight per byte.
- `ptq`: post-training quantization of a trained run (`python -m hpnlp.compress quantize`).

Quantization-aware training is the `quant.*` config group on any experiment.
"""
