#!/bin/sh
# Entrypoint of every testbed container: caps this host's link at $RATE (default 1gbit) in both
# directions, as the netns testbed does, provides the cluster's shared secret, then runs the
# command. Egress is shaped with tbf (a queue, like a switch port); ingress is redirected to an
# ifb device and shaped there the same way, or, where the kernel has no ifb, policed (excess
# dropped). Needs NET_ADMIN.
set -eu
RATE=${RATE:-1gbit}
DEV=${NET_DEV:-eth0}
tc qdisc replace dev "$DEV" root tbf rate "$RATE" burst 256kb latency 50ms
tc qdisc del dev "$DEV" ingress 2>/dev/null || true
tc qdisc add dev "$DEV" handle ffff: ingress
if ip link add ifb0 type ifb 2>/dev/null || ip link show ifb0 > /dev/null 2>&1; then
  ip link set ifb0 up
  tc qdisc replace dev ifb0 root tbf rate "$RATE" burst 256kb latency 50ms
  tc filter add dev "$DEV" parent ffff: protocol all u32 match u32 0 0 \
    action mirred egress redirect dev ifb0
  how="ingress tbf on ifb0"
else
  tc filter add dev "$DEV" parent ffff: protocol all u32 match u32 0 0 \
    police rate "$RATE" burst 256kb drop flowid :1
  how="ingress police"
fi
echo "netcap: $DEV capped at $RATE (egress tbf, $how)" >&2

# The secret aggregators and rank 0 authenticate with (docs/PROTOCOL.md, Authentication), on a
# volume the cluster shares: the container with SECRET_MAKE=1 writes it once (64 hex digits,
# mode 0600, renamed into place whole), the others wait for it.
if [ -n "${SECRET_FILE:-}" ]; then
  if [ "${SECRET_MAKE:-0}" = 1 ] && [ ! -s "$SECRET_FILE" ]; then
    tmp="$SECRET_FILE.$$"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp")
    mv "$tmp" "$SECRET_FILE"
    echo "netcap: made the cluster's secret $SECRET_FILE" >&2
  fi
  i=0
  until [ -s "$SECRET_FILE" ]; do
    i=$((i + 1))
    [ "$i" -le 120 ] || { echo "netcap: no secret at $SECRET_FILE after 60 s" >&2; exit 1; }
    sleep 0.5
  done
fi

# The compose testbed's ssh key for horovodrun (the dev image: no key is made at build time).
# The container with SSH_KEY_MAKE=1 (the launcher) makes one in the volume at SSH_KEY_DIR, the
# others wait for it; each then installs it for root and makes its own sshd host keys.
if [ -n "${SSH_KEY_DIR:-}" ]; then
  if [ "${SSH_KEY_MAKE:-0}" = 1 ] && [ ! -s "$SSH_KEY_DIR/id_ed25519.pub" ]; then
    tmp=$(mktemp -d "$SSH_KEY_DIR/.new.XXXXXX")
    ssh-keygen -q -t ed25519 -N "" -C hvd-sparse-compose -f "$tmp/id_ed25519"
    # the public half last: the others take its presence for a whole key pair
    mv "$tmp/id_ed25519" "$SSH_KEY_DIR/id_ed25519"
    mv "$tmp/id_ed25519.pub" "$SSH_KEY_DIR/id_ed25519.pub"
    rmdir "$tmp"
    echo "netcap: made the cluster's ssh key in $SSH_KEY_DIR" >&2
  fi
  i=0
  until [ -s "$SSH_KEY_DIR/id_ed25519.pub" ]; do
    i=$((i + 1))
    [ "$i" -le 120 ] || { echo "netcap: no ssh key in $SSH_KEY_DIR after 60 s" >&2; exit 1; }
    sleep 0.5
  done
  mkdir -p -m 700 /root/.ssh
  install -m 600 "$SSH_KEY_DIR/id_ed25519" /root/.ssh/id_ed25519
  install -m 600 "$SSH_KEY_DIR/id_ed25519.pub" /root/.ssh/authorized_keys
  ssh-keygen -A > /dev/null
fi
exec "$@"
