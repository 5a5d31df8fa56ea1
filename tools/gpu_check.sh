#!/usr/bin/env bash
# Build every kernel, run the GPU tests, and run the quick benchmarks, in one go (for a lent GPU machine with a
# time limit). Usage: tools/gpu_check.sh [OUTDIR] [PYTEST_MARK_EXPR] [PYTEST_PATHS...]
# Logs go to OUTDIR (default: ./gpu-check); a short summary is printed last.
set -uo pipefail
out=${1:-gpu-check}; mark=${2:-"cuda and not slow"}; shift $(( $# > 2 ? 2 : $# ))
paths=("$@"); [ ${#paths[@]} -gt 0 ] || paths=(tests)
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
  echo "tools/gpu_check.sh: needs a CUDA GPU that torch can use (none here); the CPU tests: python -m pytest" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nvcc --version | tail -2; } 2>&1 | tee "$out/env.txt"
python3 -m pipegoose.kernels doctor > "$out/doctor.txt" 2>&1
( time python3 -m pipegoose.kernels build --all -j 16 ) > "$out/build.txt" 2>&1; echo "build rc=$?"
tail -15 "$out/build.txt"
timeout "${PYTEST_TIMEOUT:-360}" python3 -m pytest -m "$mark" -q -rfEs -p no:cacheprovider "${paths[@]}" > "$out/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$out/pytest.txt" | head -40; tail -3 "$out/pytest.txt"
for q in benchmarks/quick_*.py; do [ -f "$q" ] && timeout 120 python3 "$q" > "$out/$(basename "$q" .py).txt" 2>&1; echo "== $q rc=$?"; tail -25 "$out/$(basename "$q" .py).txt"; done
# Sanitizers over every launch path of our own kernels (tools/sanitize_kernels.py), when compute-sanitizer exists.
if command -v compute-sanitizer > /dev/null; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 python3 tools/sanitize_kernels.py > "$out/memcheck.txt" 2>&1
  echo "memcheck rc=$? $(grep -E 'kernel calls|ERROR SUMMARY' "$out/memcheck.txt" | tr '\n' ' ')"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 python3 tools/sanitize_kernels.py softmax long > "$out/memcheck_long.txt" 2>&1
  echo "memcheck softmax long rc=$? $(grep -E 'kernel calls|ERROR SUMMARY' "$out/memcheck_long.txt" | tr '\n' ' ')"
  for fam in norms softmax cross_entropy clip; do
    timeout 300 compute-sanitizer --tool racecheck --error-exitcode 99 python3 tools/sanitize_kernels.py $fam > "$out/racecheck_$fam.txt" 2>&1
    echo "racecheck $fam rc=$? $(grep -E 'kernel calls|RACECHECK SUMMARY' "$out/racecheck_$fam.txt" | tr '\n' ' ')"
  done
fi
