"""The notebooks' settings (colabs/), read from the environment the same way in each.

    HPNLP_NOTEBOOK_QUICK=1   every notebook but quickstart on its tiny settings
    HPNLP_NOTEBOOK_STEPS=N   quickstart's training steps (default 300; the test suite sets
                             both, STEPS=20)
    HPNLP_NOTEBOOK_STACK=1   parallelism's stacked layers and its pipeline mode (default off)

One variable per meaning (a bug hunt, session 95: HPNLP_NOTEBOOK_STEPS was quickstart's step
count and the other notebooks' "tiny settings" switch, so 1000 steps asked of one ran the
others tiny), each refused in one line naming it where its value is not one it takes.
"""

from __future__ import annotations

import os


def _switch(var: str, on: str, off: str) -> bool:
    """An on/off setting: "1" on; "0" or unset off; anything else refused naming `var`."""
    value = os.environ.get(var, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{var}={value!r}: set 1 for {on}, or 0 (or unset it) for {off}")
    return value == "1"


def quick() -> bool:
    """HPNLP_NOTEBOOK_QUICK: "1" runs a notebook on its tiny settings; "0" or unset, at the
    sizes its text describes (every notebook but quickstart, whose size is its steps)."""
    return _switch("HPNLP_NOTEBOOK_QUICK", "the notebooks' tiny settings", "their full sizes")


def stack() -> bool:
    """HPNLP_NOTEBOOK_STACK: "1" gives parallelism.ipynb's model stacked layers in every mode,
    and a fourth mode of two pipeline stages; "0" or unset, one array per layer's weight."""
    return _switch("HPNLP_NOTEBOOK_STACK", "stacked layers and the pipeline mode",
                   "unstacked layers")


def steps(default: int) -> int:
    """HPNLP_NOTEBOOK_STEPS: a notebook's training steps (a whole number >= 1), `default`
    where unset."""
    value = os.environ.get("HPNLP_NOTEBOOK_STEPS", "").strip()
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"HPNLP_NOTEBOOK_STEPS={value!r}: give a whole number of training "
                         f"steps >= 1, or unset it for {default}")
    return n
