#!/usr/bin/env bash
# The GPU image (Python 3.12, jax 0.11) lacks grain and gin-config. Run this on a machine with
# the package registry; the wheels land in .whl/ (git-ignored), travel with the tree, and
# gpu_check.sh installs them into /tmp/site before running.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl grain gin-config array-record portpicker tensorboardX
ls .whl
