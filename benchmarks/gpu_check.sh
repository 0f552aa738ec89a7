#!/usr/bin/env bash
# The GPU check, unattended: tp=1 on one CUDA device, and tp=2 when two exist (NCCL).
#
#   bash benchmarks/gpu_check.sh               # results in $OUT/gpu, else benchmarks/results/gpu
#   bash benchmarks/gpu_check.sh --cpu         # dry run on CPU with gloo and the tiny model
#   PYTHON=python3 bash benchmarks/gpu_check.sh --size small --repeats 3
#
# Extra arguments go to `python -m benchmarks.gpu` (--size, --repeats, --new-tokens, --batch,
# --seq, --no-compile). Each tp size runs under its own timeout (GPU_CHECK_TIMEOUT, default 240 s)
# so one hang cannot eat the other's time; its log is kept next to the results.
set -u
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DEST="${OUT:+$OUT/gpu}"
DEST="${DEST:-benchmarks/results/gpu}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
TIMEOUT="${GPU_CHECK_TIMEOUT:-240}"

CPU=0
for a in "$@"; do [ "$a" = "--cpu" ] && CPU=1; done
if [ "$CPU" = 1 ]; then
  NGPU=0
  set -- --size tiny --repeats 3 --new-tokens 8 --batch 2 --seq 32 "$@"
  export OMP_NUM_THREADS=1
else
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.device_count() = $NGPU);" \
         "run with --cpu for the dry run." | tee "$DEST/gpu-check.log"
    exit 2
  fi
fi
"$PYTHON" - <<'PY' > "$DEST/environment.txt" 2>&1
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print("device", i, torch.cuda.get_device_name(i))
import transformers, tpkit
print("transformers", transformers.__version__, "tpkit", tpkit.__file__)
PY

SIZES="1"
if [ "$CPU" = 1 ] || [ "$NGPU" -ge 2 ]; then SIZES="1 2"; fi
STATUS=0
for TP in $SIZES; do
  echo "gpu_check: tp=$TP (devices: $NGPU, cpu dry run: $CPU) -> $DEST"
  timeout -k 10 "$TIMEOUT" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$TP" -m benchmarks.gpu --out "$DEST" "$@" > "$DEST/gpu-tp$TP.log" 2>&1
  RC=$?
  tail -n 5 "$DEST/gpu-tp$TP.log"
  if [ "$RC" -ne 0 ]; then echo "gpu_check: tp=$TP failed (rc=$RC), see $DEST/gpu-tp$TP.log"; STATUS=1; fi
  [ -f "$DEST/gpu-tp$TP.md" ] && cat "$DEST/gpu-tp$TP.md"
done
exit $STATUS
