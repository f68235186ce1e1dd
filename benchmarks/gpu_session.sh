#!/usr/bin/env bash
# Everything a lent GPU is for, as one prepared run (the device tool: `run`, a few minutes of budget).
#
#   bash benchmarks/gpu_session.sh            # on the GPU machine, from the repository root
#
# 1. the CUDA-only tests (the multi-tensor Triton launch, Adam over many CUDA leaves, the offload
#    engine with device blocks, CUDA checkpoints);
# 2. benchmarks/gpu_kernels.py (correctness against the CPU, then speed against torch's fused AdamW,
#    flat tensors and GPT-2 small's list: one call per tensor, step_many, sofx.adamw(...).update);
# 3. benchmarks/gpu_back_to_back.py.
# Each part has its own time limit, so that one hanging part leaves the others' results. Output goes
# to $OUT (the device tool's result folder; ./gpu_out otherwise). The GPU machine has torch and
# triton but not optree: a wheel of it in .whl/ (not in git; carry it) is installed to /tmp/site.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
if ! python3 -c "import optree" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_cuda.py tests/test_offload_features.py \
    tests/test_checkpoint_io.py -k "cuda" > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests: rc=$?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/cuda_tests.log"
timeout 300 python3 benchmarks/gpu_kernels.py > "$OUT/gpu_kernels.log" 2>&1
echo "gpu_kernels: rc=$?" | tee -a "$OUT/summary.txt"
timeout 120 python3 benchmarks/gpu_back_to_back.py > "$OUT/back_to_back.log" 2>&1
echo "gpu_back_to_back: rc=$?" | tee -a "$OUT/summary.txt"
grep -A12 "GPT-2 small" "$OUT/gpu_kernels.log" || tail -20 "$OUT/gpu_kernels.log"
