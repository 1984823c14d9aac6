#!/usr/bin/env bash
# One prepared device run: speculative decoding on the H200.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/meshserve
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
git rev-parse HEAD 2>/dev/null
B="python3 -m meshserve.bench.speculative --device cuda --dtype bfloat16 --tokens 128 --rounds 2 --prompts 6"
date +%T; timeout 210 $B --method draft --batches 1 4 --step-log $OUT/draft_steps.jsonl 2>&1 | grep -v -E "Loading weights|Writing model" | tee $OUT/spec_draft.log
date +%T; timeout 170 $B --method ngram --batches 1 4 16 64 --step-log $OUT/ngram_steps.jsonl 2>&1 | grep -v -E "Loading weights|Writing model" | tee $OUT/spec_ngram.log
date +%T; for m in draft ngram; do timeout 30 python3 -m meshserve.launch.cli diagnose diagnose.records=$OUT/${m}_steps.jsonl 2>&1 | tail -25 | tee $OUT/diagnose_$m.txt; done
date +%T; timeout 140 python3 -m pytest -q -p no:cacheprovider tests/engine/test_speculative_gpu.py tests/kernels/test_gpu_kernels.py 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
date +%T; gzip -f $OUT/*_steps.jsonl; ls -la $OUT
