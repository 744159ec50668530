#!/usr/bin/env bash
# torchtitan's own config loader for tests/emit/test_emit_torchtitan.py, beside the venv and not in it:
# torchtitan 0.3.0 and what importing its config registry needs (its trainer imports triton, tensorboard,
# torchdata, spmd_types; tyro parses the overrides), installed with --no-deps into .venv/torchtitan-loader
# so torch and everything else stay the venv's. Only a test subprocess puts it on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
target=.venv/torchtitan-loader
pins="torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 triton==3.9.0
      tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 torchdata==0.11.0"
want=$(echo $pins | sha256sum | cut -c1-16)
if [ -f "$target/.stamp" ] && [ "$(cat "$target/.stamp")" = "$want" ]; then
  exit 0
fi
rm -rf "$target"
.venv/bin/python -m pip -q --disable-pip-version-check install --no-deps --target "$target" $pins
echo "$want" > "$target/.stamp"
echo "torchtitan-loader: torchtitan 0.3.0's loader ready in $target"
