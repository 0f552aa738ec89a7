#!/usr/bin/env bash
# Several nodes, N ranks each, c10d rendezvous. Run the same command on every node:
#   launch/multinode.sh --nnodes 2 --nproc 8 --endpoint node0:29500 examples/demo.py [script args...]
# --endpoint is host:port of any one node (it hosts the rendezvous store); every node must reach it.
# NNODES / NPROC / RDZV_ENDPOINT / RDZV_ID / OMP_NUM_THREADS / PYTHON may be set in the env instead;
# TORCHRUN_ARGS adds torchrun options (e.g. "--local-addr 10.0.0.5" on hosts with several NICs).
set -euo pipefail
nnodes="${NNODES:-2}"
endpoint="${RDZV_ENDPOINT:-}"
rdzv_id="${RDZV_ID:-tpkit}"  # one id per job: two jobs sharing an endpoint need different ids
if command -v nvidia-smi >/dev/null 2>&1; then nproc="${NPROC:-gpu}"; else nproc="${NPROC:-2}"; fi
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) nnodes="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --endpoint | --rdzv-endpoint) endpoint="$2"; shift 2 ;;
    --rdzv-id) rdzv_id="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ -z "$endpoint" || $# -lt 1 ]]; then
  echo "usage: $0 --nnodes N [--nproc N] --endpoint HOST:PORT script.py [args...]" >&2
  exit 2
fi
# One OpenMP thread per rank unless told otherwise: N ranks x all cores oversubscribes the CPU.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every output line prefixed with its global rank (torchrun applies it to teed output).
prefix='[rank${rank}]:'  # torchrun fills in ${rank}, not bash
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-$prefix}"
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options on purpose
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "$nnodes" --nproc-per-node "$nproc" \
  --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$rdzv_id" \
  --tee 3 ${TORCHRUN_ARGS:-} "$@"
