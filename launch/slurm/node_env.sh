# Sourced by launch/slurm/train.sbatch and launch/slurm/task.sh: the settings a job at scale needs on each node.
#
#   megamemo_node_caches     TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, where unset, on node-local storage:
#                            $MEGAMEMO_NODE_CACHE (default $TMPDIR, else /tmp)/megamemo-cache-<user>/{inductor,triton}.
#                            Their defaults (/tmp/torchinductor_<user>, ~/.triton) put the Triton cache in a home
#                            directory shared by every rank of every node: 32 ranks compiling into one network file
#                            system at each requeue. Per user, not per job, so a requeue on the same node finds its
#                            kernels (both caches take concurrent writers on one node).
#   megamemo_socket_ifnames  NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, each where unset, from the route to
#                            MASTER_ADDR on this node (`ip route get`; on the node that holds MASTER_ADDR the route is
#                            the loopback, so the interface that holds the address): a rendezvous on the wrong
#                            interface hangs start-up for the whole collective timeout at every requeue. Run on each
#                            node (interface names differ between nodes). Prints one line: what it chose, or why not.

megamemo_node_caches() {
  local base
  base="${MEGAMEMO_NODE_CACHE:-${TMPDIR:-/tmp}}/megamemo-cache-$(id -un 2>/dev/null || id -u)"
  export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$base/inductor}"
  export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$base/triton}"
}

# megamemo_route_ifname ADDR: the interface this node reaches ADDR (an address or a host name) through; empty if
# it has no route to it.
megamemo_route_ifname() {
  local addr="$1" dev
  if ! [[ "$addr" =~ ^[0-9.]+$ || "$addr" == *:* ]]; then
    addr="$(getent ahostsv4 "$addr" 2>/dev/null | awk 'NR == 1 {print $1}')"
  fi
  [ -n "$addr" ] || return 0
  dev="$(ip -o route get "$addr" 2>/dev/null | grep -oP '(^|\s)dev \K\S+' | head -n 1)"
  if [ "$dev" = lo ]; then                 # this node's own address: the interface that holds it
    dev="$(ip -o addr show to "$addr" 2>/dev/null | awk '$2 != "lo" {print $2; exit}')"
    dev="${dev:-lo}"                       # a loopback MASTER_ADDR (one node)
  fi
  echo "${dev%%@*}"
}

megamemo_socket_ifnames() {
  local dev name how=()
  if [ -z "${NCCL_SOCKET_IFNAME:-}" ] || [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
    dev="$(megamemo_route_ifname "${MASTER_ADDR:-}")"
    if [ -z "$dev" ]; then
      echo "network: no route to MASTER_ADDR=${MASTER_ADDR:-} (ip route get): NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME left unset"
      return 0
    fi
  fi
  for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
    if [ -n "${!name:-}" ]; then
      how+=("$name=${!name} (set)")
    else
      export "$name=$dev"
      how+=("$name=$dev (the route to $MASTER_ADDR)")
    fi
  done
  echo "network on $(hostname): ${how[*]}"
}
