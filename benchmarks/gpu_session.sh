#!/usr/bin/env bash
# Everything a lent GPU is for, as one prepared run (the device tool's `run`: at most 10 minutes a
# command, about 15 minutes of device time a session).
#
#   bash benchmarks/gpu_session.sh                    # every part, on the GPU machine, from the repo root
#   bash benchmarks/gpu_session.sh tests kernels      # only those parts
#
# Parts (each with its own time limit, 560 s in all, so that one hanging part leaves the others' results):
#   tests     the CUDA-only tests: the multi-tensor Triton launch, Adam over many CUDA leaves, the offload
#             engine with device blocks, CUDA checkpoints, a 2^31-element step (180 s)
#   kernels   benchmarks/gpu_kernels.py: correctness against the CPU, then speed against torch's fused
#             AdamW, flat tensors and GPT-2 small's list: one call per tensor, step_many,
#             sofx.adamw(...).update (210 s)
#   b2b       benchmarks/gpu_back_to_back.py (60 s)
#   offload   benchmarks/gpu_offload.py: a CUDA model with CPU Adam, plain-torch offload against the
#             engine, serial and speculative (110 s)
# Output goes to $OUT (the device tool's result folder; ./gpu_out otherwise). The GPU machine has torch
# and triton but not optree: a wheel of it in .whl/ (not in git; carry it) is installed to /tmp/site.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
parts="${*:-tests kernels b2b offload}"
if ! python3 -c "import optree" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"
for part in $parts; do
    case "$part" in
        tests)
            timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_cuda.py tests/test_offload_features.py \
                tests/test_checkpoint_io.py -k "cuda" > "$OUT/cuda_tests.log" 2>&1
            echo "tests: rc=$?" | tee -a "$OUT/summary.txt"
            tail -3 "$OUT/cuda_tests.log" ;;
        kernels)
            timeout 210 python3 benchmarks/gpu_kernels.py > "$OUT/gpu_kernels.log" 2>&1
            echo "kernels: rc=$?" | tee -a "$OUT/summary.txt"
            grep -A12 "GPT-2 small" "$OUT/gpu_kernels.log" || tail -20 "$OUT/gpu_kernels.log" ;;
        b2b)
            timeout 60 python3 benchmarks/gpu_back_to_back.py > "$OUT/back_to_back.log" 2>&1
            echo "b2b: rc=$?" | tee -a "$OUT/summary.txt" ;;
        offload)
            timeout 110 python3 benchmarks/gpu_offload.py > "$OUT/gpu_offload.log" 2>&1
            echo "offload: rc=$?" | tee -a "$OUT/summary.txt"
            tail -12 "$OUT/gpu_offload.log" ;;
        *)
            echo "unknown part: $part (tests, kernels, b2b, offload)" | tee -a "$OUT/summary.txt" ;;
    esac
done
