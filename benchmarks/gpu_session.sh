#!/usr/bin/env bash
# The one command for a lent GPU machine (about 15 minutes of it in all): gpu-check --quick, then
# make bench-peers, each under a timeout, their outputs gathered into $OUT (default /tmp/gpu-session).
# PARTS picks what runs (default "check peers"); PARTS=memory runs benchmarks/memory.py alone (about
# 5 minutes: the largest batch and images/s with and without activation checkpointing, and FSDP2 on
# one GPU), whose table lands in benchmarks/RESULTS.md.
#
# Before the checkout travels (it carries no .venv), put beside it, git-ignored:
#   mkdir -p .whl && cp ../shared/device-wheels/*.whl .whl/                 # hydra-core and the rest
#   mkdir -p .peers/timm && git -C <pytorch-image-models checkout> archive HEAD timm train.py benchmark.py \
#       | tar -x -C .peers/timm                                              # timm's scripts, an outside reference
# then run `bash benchmarks/gpu_session.sh` in the checkout on the GPU machine, with .whl and .peers carried
# (`DEADLINE_S=570 PARTS="check peers memory"` fits all three in one 600-second call, memory last and cut short).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpu-session}
PARTS=" ${PARTS:-check peers} "
# DEADLINE_S: seconds from now by which every part has ended; a part gets what is left, at most its own limit.
END=$(( $(date +%s) + ${DEADLINE_S:-1200} ))
left() { local rest=$(( END - $(date +%s) - 10 )); (( rest < $1 )) && echo "$rest" || echo "$1"; }
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [[ $PARTS == *" check "* ]]; then
    timeout "$(left 300)" python3 -m benchmarks.gpu_check --quick > "$OUT/gpu_check.txt" 2>&1
    echo "gpu_check --quick: exit $?" | tee -a "$OUT/summary.txt"
fi
if [[ $PARTS == *" peers "* ]]; then
    timeout "$(left 420)" python3 -m benchmarks.peers --timm .peers/timm --out /tmp/bench-peers > "$OUT/peers.txt" 2>&1
    echo "bench-peers: exit $?" | tee -a "$OUT/summary.txt"
    (cd /tmp/bench-peers && tar -czf "$OUT/peers-logs.tgz" ./*.log ./*/tensorboard/metrics.jsonl 2>/dev/null)
fi
if [[ $PARTS == *" memory "* ]]; then
    timeout "$(left 480)" python3 -m benchmarks.run --only memory > "$OUT/memory.txt" 2>&1
    echo "memory: exit $?" | tee -a "$OUT/summary.txt"
fi
cp -f benchmarks/RESULTS.md benchmarks/gpu_check.json /tmp/bench-peers/peers.json "$OUT/" 2>/dev/null
tail -n 40 "$OUT"/gpu_check.txt "$OUT"/peers.txt "$OUT"/memory.txt 2>/dev/null
