# Sourced by launch/slurm/train.sbatch: the job's rendezvous port (MASTER_PORT, which srun passes to every rank).
#
#   megamemo_master_port JOB_ID RESTARTS ADDR
#       A candidate from the full job id: 10000 + (JOB_ID mod 2273) * 10 + RESTARTS mod 10, within 10000-32729 (below
#       the kernel's ephemeral ports, 32768 on). Two jobs whose ids differ by less than 2273 never get the same one
#       (the port used to be derived from JOB_ID mod 2000: jobs 2,000 apart on one first node collided), and a
#       requeued job moves to the next port, so a socket of its previous start lingering in TIME_WAIT cannot block
#       it. Then the candidate is probed at ADDR (the first node, where rank 0 listens): while something accepts
#       connections there (another job's rendezvous), the next slot (10 ports on) is tried, up to 200 of them.
#       Prints the port; says on stderr when it moved (returns 1 when no slot was free).
#   megamemo_port_in_use ADDR PORT   true when something accepts a TCP connection at ADDR:PORT (bash's /dev/tcp,
#       at most 2 s)

megamemo_port_in_use() {
  timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

megamemo_master_port() {
  local id="${1//[^0-9]/}" restarts="${2:-0}" addr="$3" slot first port tries
  slot=$(( 10#${id:-0} % 2273 ))
  first=$(( 10000 + slot * 10 + restarts % 10 ))
  for (( tries = 0; tries < 200; tries++ )); do
    port=$(( 10000 + ((slot + tries) % 2273) * 10 + restarts % 10 ))
    if ! megamemo_port_in_use "$addr" "$port"; then
      [ "$port" != "$first" ] && echo "port $first (from job id $1) is in use on $addr: using $port" >&2
      echo "$port"
      return 0
    fi
  done
  echo "no free rendezvous port on $addr: the 200 candidates from job id $1 ($first on) all accept connections" >&2
  return 1
}
