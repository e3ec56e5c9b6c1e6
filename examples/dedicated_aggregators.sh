#!/usr/bin/env bash
# A job whose gradients are summed by aggregators running as processes of their own, as they
# would on servers of their own (here two of them on this host, on loopback):
#
#   bash examples/dedicated_aggregators.sh [STEPS]
#
# On a cluster, run each `hvd-sparse aggregator` on its server with --bind 0.0.0.0:PORT, copy
# the secret to the servers and to the host of rank 0 (only rank 0 reads it), and list the
# servers in HVD_SPARSE_AGGREGATORS (docs: Running on a cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-100}
WORK=$(mktemp -d)
trap 'kill $AGG1 $AGG2 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT

# The deployment's secret: every packet between the job and the aggregators is authenticated
# with a key derived from it (a file only its owner reads, at least 16 bytes).
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/secret")

# Two aggregators for a 2-rank job; --port-file says which port each took (0: any free one),
# --stats 0 prints their counters once, at exit.
hvd-sparse aggregator --bind 127.0.0.1:0 --workers 2 --secret-file "$WORK/secret" \
  --port-file "$WORK/agg1.port" --stats 0 > "$WORK/agg1.log" 2>&1 & AGG1=$!
hvd-sparse aggregator --bind 127.0.0.1:0 --workers 2 --secret-file "$WORK/secret" \
  --port-file "$WORK/agg2.port" --stats 0 > "$WORK/agg2.log" 2>&1 & AGG2=$!
for f in agg1 agg2; do
  for _ in $(seq 100); do [ -s "$WORK/$f.port" ] && break; sleep 0.1; done
done
AGGREGATORS="127.0.0.1:$(cat "$WORK/agg1.port"),127.0.0.1:$(cat "$WORK/agg2.port")"
echo "aggregators: $AGGREGATORS"

# The job: the omnireduce scheme for every tensor, summed at the two aggregators. horovodrun
# forwards HVD_SPARSE_* variables set here to every rank.
HVD_SPARSE_AGGREGATORS=$AGGREGATORS HVD_SPARSE_SECRET_FILE=$WORK/secret \
  horovodrun -np 2 python examples/horovod_embedding.py --steps "$STEPS" --scheme omnireduce

# Stop the aggregators; each prints what it summed.
kill -TERM $AGG1 $AGG2
wait $AGG1 $AGG2 || true
echo "aggregator 1: $(tail -n 1 "$WORK/agg1.log")"
echo "aggregator 2: $(tail -n 1 "$WORK/agg2.log")"
