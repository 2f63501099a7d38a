#!/bin/bash
# A simulated two-node (or N-node) cluster on this machine: one network namespace per
# rank, all joined through a bridge in a namespace of their own by veth pairs, each
# link shaped with tc's token bucket (tbf) to RATE. Inside every namespace the link is
# called `simnet0` and has address 10.77.0.<i+1>.
#
#   benchmarks/simnet.sh up [N [RATE [MTU]]]   (N namespaces, default 2; RATE default
#                                        1gbit; MTU default 65000)
#   benchmarks/simnet.sh run I CMD...    run CMD in namespace I (as mpiexec's program)
#   benchmarks/simnet.sh down            remove everything `up` made
#   benchmarks/simnet.sh env             the environment MPICH needs to use the link
#
# The MTU stands in for a NIC's segmentation and receive offloads, which hand a node's
# kernel 64 KiB segments: here every frame is the kernel's work on the cores of this
# one machine, the receiving rank's stack included (veth peers are one kernel, and the
# sender's core runs the receive path). At 1500 that took a third of a core at 200mbit;
# at 9000 the communicator's thread of run.py's 2-rank MLP step still spent 0.06-0.14 s
# of its rank's one core per step (median 0.09, 11 runs), at 65000 0.05-0.08 s (4 runs).
#
# Needs root (ip netns, tc). benchmarks/run.py runs its overlap section on it.
set -euo pipefail
PREFIX=vjpsim
cmd=${1:-}
case "$cmd" in
  up)
    n=${2:-2}; rate=${3:-1gbit}; mtu=${4:-65000}
    "$0" down >/dev/null 2>&1 || true
    ip netns add ${PREFIX}br
    ip -n ${PREFIX}br link add br0 type bridge
    ip -n ${PREFIX}br link set br0 mtu $mtu up
    for ((i = 0; i < n; i++)); do
      ns=${PREFIX}$i
      ip netns add $ns
      ip link add ${PREFIX}a$i type veth peer name ${PREFIX}b$i
      ip link set ${PREFIX}a$i netns $ns
      ip link set ${PREFIX}b$i netns ${PREFIX}br
      ip -n $ns link set ${PREFIX}a$i name simnet0
      ip -n $ns addr add 10.77.0.$((i + 1))/24 dev simnet0
      ip -n $ns link set simnet0 mtu $mtu up
      ip -n $ns link set lo up
      ip -n ${PREFIX}br link set ${PREFIX}b$i master br0
      ip -n ${PREFIX}br link set ${PREFIX}b$i mtu $mtu up
      # both directions of each link: egress of the rank's end and of the bridge's end
      tc -n $ns qdisc add dev simnet0 root tbf rate $rate burst 64kb latency 50ms
      tc -n ${PREFIX}br qdisc add dev ${PREFIX}b$i root tbf rate $rate burst 64kb latency 50ms
    done
    ;;
  run)
    i=$2; shift 2
    exec ip netns exec ${PREFIX}$i "$@"
    ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}" || true); do
      ip netns delete $ns
    done
    ;;
  env)
    echo "MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=simnet0"
    ;;
  *)
    echo "usage: $0 up [N [RATE [MTU]]] | run I CMD... | down | env" >&2
    exit 2
    ;;
esac
