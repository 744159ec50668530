#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's chromium for the bench HTML report test (skipped there when it can't be installed).
bash scripts/ci-deps.sh || echo "test.sh: chromium not installed; the HTML report test will skip" >&2
# torchtitan's own loader for the emitted torchtitan lines (beside the venv; CI fails that test without it).
bash scripts/torchtitan-loader.sh || echo "test.sh: torchtitan's loader not installed; its emit test will skip" >&2
# DeepSpeed compiles its CPU ops on first use (minutes). Build them once, before the tests, into a
# stable cache so no test pays for it inside its timeout.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(.venv/bin/python -c "from shardfit.runtime_env import extensions_dir; print(extensions_dir())")}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A build killed mid-way leaves its lock file behind, and every later load waits on it forever (the
# ranks of a DeepSpeed test then hang until their timeout): a lock older than any build is stale.
find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +30 -delete 2>/dev/null || true
.venv/bin/python - <<'PY'
import time
from deepspeed.accelerator import get_accelerator
start = time.time()
for name in ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
print(f"test.sh: DeepSpeed CPU ops ready ({time.time() - start:.0f} s)")
PY
# Tests run in SHARDFIT_TEST_WORKERS pytest-xdist processes (0: in this one), a file per worker so a
# module's shared fixture (one torchrun launch for a whole matrix) runs once. More workers than cores on
# purpose: much of a multi-rank test is waiting (rendezvous, process start, a timeout being proven).
workers=${SHARDFIT_TEST_WORKERS:-3}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
