#!/usr/bin/env bash
# The GPU checks, run on a lent CUDA machine (numbers in docs/benchmarks.md): the CUDA tests,
# `bench sharpness` at GPT-2-small size and at 1.2B parameters, one Hessian-vector product at
# GPT-2-small size against curvlinops (`bench cost --hvp`), `bench memory` at GPT-2-small size
# (float32) and at 1.2B parameters (bfloat16), and `bench cost` on CUDA. The machine's python
# has torch but not geoopt or curvlinops: their wheels travel in .whl/ (ignored by git;
# `pip download --no-deps -d .whl geoopt curvlinops-for-pytorch backpack-for-pytorch einconv
# unfoldNd`). Results go to $OUT (default ./device-out), stderr of every step to $OUT/log.txt;
# at most 8 files come back from the device tool. Every step stops at its own limit and at the
# script's BUDGET seconds (default 420), so that the whole run ends inside one device call.
set -uo pipefail
OUT=${OUT:-device-out}
BUDGET=${BUDGET:-420}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
run() {  # limit in seconds, output file, then the command
  local limit=$1 name=$2; shift 2
  local left=$((BUDGET - SECONDS)) t0=$SECONDS
  ((left < limit)) && limit=$left
  ((limit < 10)) && { echo "$name: skipped, out of time"; return; }
  timeout "$limit" "$@" >"$OUT/$name" 2>>"$OUT/log.txt" \
    || { echo "FAILED or timed out: $name"; tail -5 "$OUT/log.txt"; }
  echo "$name: $((SECONDS - t0)) s"
}
run 90 test_cuda.txt python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py
tail -1 "$OUT/test_cuda.txt"
qg="python3 -m quotientgeo.cli bench"
gpt2=(--layers 12 --d 768 --heads 12)
big=(--layers 22 --d 2048 --heads 16)
run 100 sharpness_124m.json $qg sharpness --device cuda --json "${gpt2[@]}" --rounds ${ROUNDS:-4} \
  --n-iter 2 --extra 8
grep -h -A5 '"ratios"' "$OUT"/sharpness_124m.json
run 80 hvp_124m.json $qg cost --hvp --device cuda --json "${gpt2[@]}" --vocab 50257 --seq 128 \
  --batch 4 --hvp-rounds 3
run 60 memory_124m_f32.json $qg memory --device cuda --json
run 70 memory_1b_bf16.json $qg memory --device cuda --json "${big[@]}" --dtype bfloat16
run 60 cost.json $qg cost --device cuda --json
run 120 sharpness_1b.json $qg sharpness --device cuda --json "${big[@]}" --rounds 1 --n-iter 2 \
  --extra 2
grep -h -A5 '"ratios"' "$OUT"/sharpness_1b.json
