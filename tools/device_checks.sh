#!/usr/bin/env bash
# The GPU checks, run on a lent CUDA machine (numbers in docs/benchmarks.md): the CUDA tests,
# `bench memory` at GPT-2-small size (float32) and at 1.2B parameters (bfloat16, float32), and
# `bench sharpness` at GPT-2-small size. The machine's python has torch but not geoopt: its
# wheel travels in .whl/ (ignored by git; `pip download --no-deps -d .whl geoopt`). Results go
# to $OUT (default ./device-out), stderr of every step to $OUT/log.txt; at most 8 files come
# back from the device tool.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
run() {  # output file, then the command
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name" 2>>"$OUT/log.txt" || { echo "FAILED: $name"; tail -20 "$OUT/log.txt"; }
  echo "$name: $((SECONDS - t0)) s"
}
run test_cuda.txt python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py
tail -1 "$OUT/test_cuda.txt"
qg="python3 -m quotientgeo.cli bench"
big=(--layers 22 --d 2048 --heads 16)
run memory_124m_f32.json $qg memory --device cuda --json
run memory_1b_bf16.json $qg memory --device cuda --json "${big[@]}" --dtype bfloat16
run memory_1b_f32.json $qg memory --device cuda --json "${big[@]}" --only adaptive geodesic_mix
run sharpness_124m.json $qg sharpness --device cuda --json --layers 12 --d 768 --heads 12 --rounds ${ROUNDS:-6}
grep -h -A5 '"ratios"' "$OUT"/sharpness_*.json
