"""`python -m hpnlp.kernels [--retune] [--repeat N]`: the kernels' tuned block sizes on this
CPU (see hpnlp.kernels.tuning)."""

from hpnlp.kernels.tuning import main

raise SystemExit(main())
