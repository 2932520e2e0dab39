#!/usr/bin/env bash
# The GPU tier of a rendered project (its tests/test_gpu.py), as `make gpu-check` runs it.
#
#   bash tests/gpu_check.sh PYTHON PROJECT WHEELS
#
# PYTHON is the interpreter whose torch has CUDA: on a GPU image, usually python3, which
# keeps its own torch (2.9 or newer). Nothing is downloaded: what that interpreter lacks of
# the project's small pure-Python dependencies (omegaconf and antlr4, whose wheels
# `make gpu-prepare` puts in WHEELS) goes into a folder of its own on PYTHONPATH, so the
# image's packages are left as they are. Without CUDA every step is skipped with the
# reason, and the exit status is 0. Bounded: the whole tier ends within GPU_CHECK_S.
set -euo pipefail
python=${1:?the interpreter whose torch has CUDA}
project=$(cd "${2:?the rendered project}" && pwd)
wheels=$(cd "${3:?the folder of wheels}" && pwd)
limit=${GPU_CHECK_S:-330}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if ! "$python" -c "import omegaconf" 2>/dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" - <<'PY'
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, {gpu}", flush=True)
PY
cd "$project"
PYTHONPATH="$project/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 timeout "$limit" \
    "$python" -m pytest -p no:cacheprovider -q -rs -s --durations=10 -m gpu tests/test_gpu.py
