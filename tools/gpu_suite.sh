#!/usr/bin/env bash
# The test suite on a GPU machine whose image has jax (CUDA), flax, optax and orbax but not
# hpnlp's other needs: those travel as wheels in WHEELS (default .whl: grain, array-record,
# ml-collections, portpicker, tensorboardX; see docs/tests.md "On a GPU"). Usage, from the
# repo root:
#   bash tools/gpu_suite.sh [pytest arguments]   (-m "not slow" unless they give -m)
# Writes the log to $OUT/suite.txt when OUT is set (the lent machines' output folder).
set -o pipefail
WHEELS=${WHEELS:-.whl}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install --quiet --no-deps --no-index --target /tmp/site "$WHEELS"/*.whl >/dev/null 2>&1 || exit
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
case " $* " in *" -m "*) ;; *) set -- -m "not slow" "$@" ;; esac
JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -n "${WORKERS:-14}" -p no:cacheprovider \
  --ignore=tests/test_colabs.py --ignore=tests/test_retrieval.py "$@" tests 2>&1 \
  | tee "${OUT:-/tmp}/suite.txt" | grep -v -E "Warning: |warnings.warn\(" | tail -60
