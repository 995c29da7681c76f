#!/usr/bin/env bash
# A training pipeline with autofit's pre-flight: check the tuned configuration on
# this machine before training starts; stop with the reasons when it does not fit.
#
#   examples/pipeline.sh                         # tune (first time), check, train
#   AUTOFIT_DEVICE=cpu:64MiB examples/pipeline.sh  # a machine too small: stops, exit 3
#
# Run from the repository root. Exit status: train.py's, or 3 when the pre-flight
# says the configuration does not fit (no compute spent), or 2 on bad input.
set -uo pipefail

CONFIG=${CONFIG:-examples/tuned.yaml}
DEVICE=${AUTOFIT_DEVICE:-cpu:1GiB}   # on a GPU machine: auto

if [ ! -f "$CONFIG" ]; then
  # once, on the machine the job runs on: the fastest configuration that fits
  autofit tune examples/tiny-model --dataset tiny-samples --device cpu:1GiB \
    --target-batch-size 16 --precision 32-true --optim adamw_torch --max-trials 4 \
    -o "$CONFIG" || exit $?
fi

# pre-flight: from the cache when exactly this configuration was measured here
autofit check "$CONFIG" --device "$DEVICE"
status=$?
if [ "$status" -eq 3 ]; then
  echo "pre-flight: $CONFIG does not fit on $DEVICE; training not started" >&2
  exit 3
elif [ "$status" -ne 0 ]; then
  echo "pre-flight: could not check $CONFIG (exit $status)" >&2
  exit "$status"
fi

python examples/train.py "$CONFIG"
