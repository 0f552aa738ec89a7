#!/usr/bin/env bash
# One node, N ranks: a thin wrapper over torchrun with tpkit's defaults.
#   launch/torchrun.sh --nproc 2 examples/demo.py [script args...]
# NPROC / OMP_NUM_THREADS / PYTHON may also be set in the environment.
set -euo pipefail
nproc="${NPROC:-2}"
if [[ "${1:-}" == "--nproc" ]]; then nproc="$2"; shift 2; fi
if [[ $# -lt 1 ]]; then echo "usage: $0 [--nproc N] script.py [args...]" >&2; exit 2; fi
# One thread per rank unless told otherwise: N ranks x all cores oversubscribes the CPU.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every output line prefixed with its rank (torchrun applies it to teed output).
prefix='[rank${rank}]:'  # torchrun fills in ${rank}, not bash
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-$prefix}"
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$nproc" --tee 3 "$@"
