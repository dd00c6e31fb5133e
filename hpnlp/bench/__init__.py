"""Benchmarks: one harness (`harness.py`), peers in the same run, reports in one folder.

    python -m hpnlp.bench attention --out /tmp/bench/attention [--quick]
"""
