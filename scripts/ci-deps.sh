#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: Debian's chromium, used headless by
# tests/bench/test_html.py to open the bench HTML report. Skipped when it is already installed.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "ci-deps: not root, skipping chromium (the HTML report test will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "ci-deps: chromium $(/usr/bin/chromium --version 2>/dev/null | awk '{print $2}') installed"
