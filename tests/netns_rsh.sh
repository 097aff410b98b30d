#!/bin/sh
# Open MPI's remote-shell agent for tests/multinode.py: instead of `ssh HOST COMMAND...` it runs
# COMMAND (the orted of Open MPI 4, the prted of Open MPI 5) inside the network namespace that
# plays HOST, in a new UTS namespace with that node's host name, so that MPI sees two nodes.
#   usage (by mpirun): netns_rsh.sh HOST COMMAND...
# SEMZO_NETNS_HOSTS maps hosts: "IP=NAMESPACE=HOSTNAME IP=NAMESPACE=HOSTNAME"; mpirun passes its
# environment on to this agent, and the agent to the daemon, as ssh would not.
# The command words are joined and run by sh, as sshd runs them with the user's shell.
host=$1
shift
ns=
name=
for entry in $SEMZO_NETNS_HOSTS; do
  case "$entry" in
    "$host"=*)
      rest=${entry#*=}
      ns=${rest%%=*}
      name=${rest#*=}
      ;;
  esac
done
if [ -z "$ns" ]; then
  echo "netns_rsh.sh: unknown host '$host' (SEMZO_NETNS_HOSTS='$SEMZO_NETNS_HOSTS')" >&2
  exit 255
fi
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' \
  netns_rsh "$name" "$@"
