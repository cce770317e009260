#!/usr/bin/env bash
# The CUDA checks on a lent single-GPU machine (docs/gpu.md): the GPU tests (tests/gpu) and
# `bench kernels`, with Colossal-AI's pinned stack installed from wheels carried in .whl/
# (the machine has no registry; see docs/gpu.md for how .whl/ is filled). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, transformers, colossalai; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__, \
'colossalai', colossalai.__version__)" 2>&1 | grep -v -i warn | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/env.txt"
timeout "${GPU_TESTS_S:-300}" python3 -m pytest tests/gpu -q -p no:cacheprovider -rA \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout "${GPU_BENCH_S:-200}" python3 -m colossal_hetero.cli bench kernels --quick \
    --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
tail -20 "$OUT/kernels.log"
