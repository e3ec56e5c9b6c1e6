#!/bin/sh
# Entrypoint of every testbed container: caps this host's link at $RATE (default 1gbit) in both
# directions, as the netns testbed does, then runs the command. Egress is shaped with tbf (a
# queue, like a switch port); ingress can only be policed from inside the container (excess is
# dropped). Needs NET_ADMIN.
set -eu
RATE=${RATE:-1gbit}
DEV=${NET_DEV:-eth0}
tc qdisc replace dev "$DEV" root tbf rate "$RATE" burst 256kb latency 50ms
tc qdisc del dev "$DEV" ingress 2>/dev/null || true
tc qdisc add dev "$DEV" handle ffff: ingress
tc filter add dev "$DEV" parent ffff: protocol all u32 match u32 0 0 \
  police rate "$RATE" burst 256kb drop flowid :1
echo "netcap: $DEV capped at $RATE (egress tbf, ingress police)" >&2
exec "$@"
