"""The fixed bash of the rendered sbatch script (see `slurm.render_sbatch`).

Kept apart from the Python that fills in the per-run lines so each reads on its
own; the functions here are what the batch shell runs around the job steps.
"""

from moerl.launchers.stage_render import count_announced

PREAMBLE = """
# Rendered by moerl.launchers.slurm.render_sbatch. Each stage is one job step of
# this heterogeneous job: servers in the background, each replica writing
# host:port to $MOERL_RENDEZVOUS_DIR/<stage>/<i>.addr once healthy; the trainer
# (torchrun per node, master = first node of group 0) runs once all have
# announced. USR1 before the time limit: the trainer checkpoints and exits with
# REQUEUE_EXIT_CODE, then the job requeues itself. The EXIT trap stops all steps.
"""

FUNCTIONS = r"""
SERVER_PIDS=() SERVER_NAMES=() TRAINER_PID="" PREEMPTED=0

moerl_started() { SERVER_NAMES+=("$1"); SERVER_PIDS+=("$2"); }

moerl_check_servers() {  # fails, naming the stage, once any server step has ended
  local i rc
  for i in "${!SERVER_PIDS[@]}"; do
    if ! kill -0 "${SERVER_PIDS[$i]}" 2>/dev/null; then
      wait "${SERVER_PIDS[$i]}"; rc=$?
      echo "moerl: stage ${SERVER_NAMES[$i]} ended early (exit code $rc); logs in $LOG_DIR" >&2
      return 1
    fi
  done
}

moerl_wait_announced() {  # STAGE EXPECTED
  local deadline=$((SECONDS + STARTUP_TIMEOUT)) n
  while :; do
    n=$(@COUNT_ANNOUNCED@)
    [ "$n" -ge "$2" ] && return 0
    moerl_check_servers || return 1
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "moerl: stage $1: $n of $2 endpoints after ${STARTUP_TIMEOUT} s" >&2
      return 1
    fi
    sleep 1 & wait $!  # a bare `sleep` would hold back the traps until it ends
  done
}

moerl_cleanup() {  # TERM every step still running, KILL after GRACE seconds
  local pids=(${TRAINER_PID:+"$TRAINER_PID"} "${SERVER_PIDS[@]}") p t alive
  TRAINER_PID="" SERVER_PIDS=() SERVER_NAMES=()
  [ "${#pids[@]}" -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for ((t = 0; t < GRACE; t++)); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 1
  done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
  return 0
}

moerl_preempt() {
  PREEMPTED=1
  echo "moerl: USR1 (time limit near): trainer checkpoints, then the job requeues" >&2
  [ -n "$TRAINER_PID" ] && kill -USR1 "$TRAINER_PID" 2>/dev/null
  return 0
}

trap moerl_cleanup EXIT
trap 'exit 143' TERM INT
trap moerl_preempt USR1
"""

FUNCTIONS = FUNCTIONS.replace("@COUNT_ANNOUNCED@", count_announced('"$MOERL_RENDEZVOUS_DIR/$1"'))

FINISH = r"""
while kill -0 "$TRAINER_PID" 2>/dev/null; do
  moerl_check_servers || exit 1
  sleep 1 & wait $!
done
wait "$TRAINER_PID"; rc=$?
TRAINER_PID=""
echo "moerl: trainer exit code $rc" >&2
# torchrun reports a rank's exit code as 1, hence the marker and PREEMPTED.
if [ -e "$MOERL_RENDEZVOUS_DIR/requeue" ] || { [ "$PREEMPTED" -eq 1 ] && [ "$rc" -ne 0 ]; }; then
  rc=$REQUEUE_EXIT_CODE
fi
if [ "$REQUEUE" -eq 1 ] && [ "$rc" -eq "$REQUEUE_EXIT_CODE" ]; then
  moerl_cleanup
  echo "moerl: requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""
