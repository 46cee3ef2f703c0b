# Sourced by launch/slurm/train.sbatch: what to do when the training step failed (no SIGUSR1 asked it to stop).
#
#   megamemo_after_failure RC STARTED START_NO
#       RC: srun's exit code; STARTED: when the step started (epoch seconds); START_NO: restarts before it (Slurm's
#       requeues plus restarts inside the allocation). Uses the batch script's use_nodes, job_nodes, logdir and log.
#       1. The rank at fault and its node: scripts/slurm_failure.py (megamemo/runtime/interruptions.py) reads what
#          launch/slurm/task.sh wrote when each task ended ($MEGAMEMO_TASK_EXITS: the first failure that is not a
#          consequence of another) and the ranks' heartbeats (a hang named by a watchdog).
#       2. The nodes at fault: any node of the step that Slurm reports DOWN, DRAINED, FAILED, NOT_RESPONDING (a lost
#          node), and the failed rank's node when MEGAMEMO_NODE_CHECK (a command run there with srun, e.g. a GPU
#          or DCGM check) fails on it. A rank that crashed or hung on a healthy node puts no node at fault.
#       3. The record in <run_dir>/interruptions.jsonl and the verdict: stop after exit 2, after the same step
#          failed 3 times in a row, or after MEGAMEMO_MAX_FAILURES failures of this job (default 10; preemptions
#          do not count: MEGAMEMO_MAX_REQUEUES).
#       4. Exit 5 (node-suspect: the data-parallel replicas disagreed, kind node): the nodes of the ranks the replica
#          check named (their heartbeats) are at fault too - unless MEGAMEMO_REPLAY_SUSPECT=1 and the replay of the
#          suspect step in other processes reproduced the run's recorded numbers (megamemo/runtime/suspect.py,
#          run from step 3's helper on this host: MEGAMEMO_REPLAY_CMD, MEGAMEMO_REPLAY_TIMEOUT_S).
#       Sets `action`: stop | here (restart inside the allocation without the nodes at fault: MEGAMEMO_SPARE_NODES
#       allows that many to drop out; the run resumes under the smaller world size through the checkpoint's
#       relayout) | requeue (with the nodes at fault in `exclude`); `healthy`: the nodes left for `here`.
#   megamemo_lost_start   at the start of a requeued job: when job.txt's last start has no end, that start died
#       with its batch script (its node was lost, and Slurm requeued the job itself): record it (kind node)
#   megamemo_requeue [NODE...]   requeue this job, adding the NODEs to its ExcNodeList, and release it at once
#                                (Slurm holds a requeued job for about two minutes otherwise)

megamemo_python() { command -v python3 || command -v python; }

megamemo_node_state() {
  scontrol show node -o "$1" 2>/dev/null | grep -oP '(^|\s)State=\K\S+' || true
}

megamemo_bad_state() {      # DOWN, DRAIN(ED|ING), FAIL(ING), NOT_RESPONDING ('*'), powered off: not to be trained on
  case "$1" in *DOWN*|*DRAIN*|*FAIL*|*NOT_RESPONDING*|*'*'*|*POWER*) return 0 ;; esac
  return 1
}

megamemo_node_check() {     # MEGAMEMO_NODE_CHECK on node $1 (a job step of one task there); 0: healthy
  timeout "${MEGAMEMO_NODE_CHECK_TIMEOUT:-120}" srun --nodes=1 --ntasks=1 --nodelist="$1" --kill-on-bad-exit=1 \
    bash -c "$MEGAMEMO_NODE_CHECK" >>"$logdir/node-check.log" 2>&1
}

megamemo_after_failure() {
  local rc="$1" started="$2" start_no="$3" py helper c_rank="" c_node="" c_suspects="" n st
  local -a faulty=() reasons=()
  py="$(megamemo_python)"
  helper="$MEGAMEMO_ROOT/scripts/slurm_failure.py"
  local common=(--exits "$MEGAMEMO_TASK_EXITS" --run-dir-file "$MEGAMEMO_RUN_DIR_FILE" --started "$started")
  if [ -n "$py" ]; then
    eval "$("$py" -I "$helper" slurm culprit "${common[@]}" 2>>"$logdir/job.txt")"
  fi
  for n in "${use_nodes[@]}"; do
    st="$(megamemo_node_state "$n")"
    if megamemo_bad_state "$st"; then faulty+=("$n"); reasons+=("$n: Slurm reports it $st"); fi
  done
  if [ -n "$c_node" ] && [ -n "${MEGAMEMO_NODE_CHECK:-}" ] && [[ " ${faulty[*]} " != *" $c_node "* ]]; then
    if ! megamemo_node_check "$c_node"; then
      faulty+=("$c_node"); reasons+=("$c_node: MEGAMEMO_NODE_CHECK failed there (see $logdir/node-check.log)")
    fi
  fi
  local fault_node="" fault_why="" i
  for i in "${!faulty[@]}"; do        # the failed rank's node first, else the first node at fault
    if [ "${faulty[$i]}" = "$c_node" ] || [ -z "$fault_node" ]; then fault_node="${faulty[$i]}"; fault_why="${reasons[$i]#*: }"; fi
  done
  local failures left verdict="retry" line="exit code $rc" why="" kind="" step="" recorded="" replay_decision=""
  local replay_verdict=""
  failures="$(grep -cE '^end .* rc=[1-9][0-9]* usr1=0' "$logdir/job.txt" || true)"
  left=$(( ${MEGAMEMO_MAX_FAILURES:-10} - failures + 1 ))
  if [ -n "$py" ]; then
    eval "$("$py" -I "$helper" slurm record "${common[@]}" --rc "$rc" --restart "$start_no" --restarts-left "$left" \
            --node "$fault_node" --node-fault "$fault_why" --job "$SLURM_JOB_ID" 2>>"$logdir/job.txt")"
  else
    log "warning: no python3 on $(hostname): the failure is not recorded in the run directory"
    [ "$rc" = 2 ] && { verdict=stop; why="exit code 2 (bad usage, config, data or checkpoint)"; }
    [ "$left" -le 0 ] && { verdict=stop; why="no restarts left"; }
  fi
  log "training failed (failure $failures of this job): $line${recorded:+; recorded in $recorded}"
  if [ "$kind" = node ] && [ -n "$c_suspects" ]; then     # exit 5: the replica check's suspects
    if [ "$replay_decision" = resume ]; then
      log "replay of step $step: $replay_verdict: not the device's computation; excluding none of $c_suspects"
    else
      for n in $c_suspects; do
        [[ " ${faulty[*]} " == *" $n "* ]] && continue
        faulty+=("$n")
        reasons+=("$n: replica mismatch (exit 5)${replay_verdict:+, replay: ${replay_verdict#replay: }}")
      done
    fi
  fi
  echo "failure restart=$start_no rc=$rc kind=${kind:-?} rank=${c_rank:-?} node=${c_node:-?} faulty=${faulty[*]:-none}" \
    >>"$logdir/job.txt"
  exclude=(); healthy=()
  if [ "$verdict" != retry ]; then
    [ "$why" = "no restarts left" ] && why="$failures failures (MEGAMEMO_MAX_FAILURES=${MEGAMEMO_MAX_FAILURES:-10})"
    log "not restarting: $why"
    action=stop
    return 0
  fi
  if [ "${#faulty[@]}" = 0 ]; then
    if [ -n "$c_node" ]; then
      log "rank $c_rank's node $c_node is healthy (Slurm: $(megamemo_node_state "$c_node")${MEGAMEMO_NODE_CHECK:+, MEGAMEMO_NODE_CHECK passed}): requeueing job $SLURM_JOB_ID, excluding no node"
    else
      log "no node at fault: requeueing job $SLURM_JOB_ID, excluding no node"
    fi
    action=requeue
    return 0
  fi
  for n in "${use_nodes[@]}"; do [[ " ${faulty[*]} " == *" $n "* ]] || healthy+=("$n"); done
  local dropped=$(( ${#job_nodes[@]} - ${#use_nodes[@]} + ${#faulty[@]} ))
  if [ "${MEGAMEMO_SPARE_NODES:-0}" -ge "$dropped" ] && [ "${#healthy[@]}" -gt 0 ]; then
    log "node(s) at fault: ${reasons[*]}; restarting inside the allocation on ${healthy[*]} ($dropped of" \
        "MEGAMEMO_SPARE_NODES=${MEGAMEMO_SPARE_NODES:-0} spare nodes used): the run resumes under the smaller world size"
    action=here
    return 0
  fi
  exclude=("${faulty[@]}")
  log "node(s) at fault: ${reasons[*]}; requeueing job $SLURM_JOB_ID with ${faulty[*]} excluded"
  action=requeue
}

megamemo_lost_start() {
  local last n iso started py
  last="$(grep -E '^(start|end) ' "$logdir/job.txt" 2>/dev/null | tail -n1)"
  [[ "$last" == start* ]] || return 0
  n="$(grep -oP 'restart=\K[0-9]+' <<<"$last" || echo 0)"
  iso="$(awk '{print $2}' <<<"$last")"
  started="$(date -d "$iso" +%s 2>/dev/null || echo 0)"
  echo "end unknown restart=$n rc=255 usr1=0 (no end written: the batch script died, its node lost)" >>"$logdir/job.txt"
  log "start $n of job $SLURM_JOB_ID ended without its batch script (its node lost?): recorded as an interruption"
  py="$(megamemo_python)"
  [ -n "$py" ] && "$py" -I "$MEGAMEMO_ROOT/scripts/slurm_failure.py" slurm record \
    --exits "$logdir/.exits-$n" --run-dir-file "$MEGAMEMO_RUN_DIR_FILE" --started "$started" --rc 255 \
    --restart "$n" --node-fault "start $n ended without its batch script (a lost node)" --job "$SLURM_JOB_ID" \
    >/dev/null 2>>"$logdir/job.txt"
  return 0
}

megamemo_requeue() {
  local upd=(StartTime=now) old
  if [ "$#" -gt 0 ]; then
    old="$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -oP '(^|\s)ExcNodeList=\K\S+' || true)"
    [ "$old" = "(null)" ] && old=""
    upd+=("ExcNodeList=${old:+$old,}$(IFS=,; echo "$*")")
  fi
  # Requeueing a running job sends TERM to this script and its children, then KILL after KillWait: ignore TERM so
  # the update (only a pending job's ExcNodeList can change) is not cut short.
  trap '' TERM
  scontrol requeue "$SLURM_JOB_ID" || { log "error: scontrol requeue $SLURM_JOB_ID failed"; return 1; }
  scontrol update JobId="$SLURM_JOB_ID" "${upd[@]}" || log "warning: scontrol update JobId=$SLURM_JOB_ID ${upd[*]} failed"
}
