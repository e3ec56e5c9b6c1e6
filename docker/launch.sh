#!/bin/bash
# The launcher's command: waits for every worker's sshd (at most SSH_WAIT_S seconds), then runs
# $JOB with horovodrun, one rank per worker (Gloo; the environment, HVD_SPARSE_* included, goes
# to every rank). WORKERS: the worker hostnames, space-separated; START_TIMEOUT_S: how long
# horovodrun waits for the ranks to start.
set -euo pipefail
read -r -a hosts <<< "${WORKERS:?WORKERS: worker hostnames}"
deadline=$((SECONDS + ${SSH_WAIT_S:-120}))
for h in "${hosts[@]}"; do
  until ssh -o ConnectTimeout=2 -o BatchMode=yes "$h" true 2> /dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "launch: no sshd answered on $h within ${SSH_WAIT_S:-120} s" >&2
      exit 1
    fi
    sleep 1
  done
done
slots=$(printf '%s:1,' "${hosts[@]}")
echo "launch: ${#hosts[@]} workers up: horovodrun -np ${#hosts[@]} -H ${slots%,} --gloo $JOB" >&2
# JOB is a shell command line (quotes and all), as compose's string form of command: is.
# Horovod's 30 s default to start the tasks is too short on a loaded machine.
eval exec horovodrun -np "${#hosts[@]}" -H "${slots%,}" --gloo \
  --start-timeout "${START_TIMEOUT_S:-180}" "$JOB"
