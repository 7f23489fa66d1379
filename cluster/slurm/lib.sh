# shellcheck shell=bash
# Shared by the cluster/slurm/*.sbatch files (sourced, not run). It makes a batch job
# pre-emptible: on USR1 (sent by SLURM before the time limit with --signal=B:USR1@N, or by
# `scancel --signal=USR1 --batch <job>`) the training finishes its step, writes a checkpoint
# and exits; then the job requeues itself and the requeued job resumes from the same run
# directory.
#
# Why it is written this way:
# * bash runs a trap only after the foreground command ends, so training runs in the
#   background and the script waits for it (`cmd & wait`); the trap can then act at once.
# * `scontrol requeue` on a running job SIGTERMs it and SIGKILLs it KillWait seconds later,
#   so the training must have checkpointed and exited before the script requeues (last).
# * torchrun dies on USR1 (leaving its workers behind) unless told to handle it; the sbatch
#   files start it through cluster/torchrun.py, which tells it to, so it forwards USR1 to every
#   worker and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (120 by default) for them to exit,
#   and exits 75 once they have checkpointed. srun forwards USR1 to its tasks but turns SIGTERM
#   into a step kill, so USR1 is what we forward.
# * The run directory is runs/<recipe>/slurm-<job id> unless name= or run_dir= is given; a
#   requeued job keeps its job id, so it finds its checkpoints.
# * Only a training that checkpointed and stopped (exit 75) is requeued: a run that diverged
#   (exit 3) or met a user error (exit 2) would do the same again, and one that hung (exit 4)
#   may hang again: the job ends FAILED with that code.

STOP_SIGNAL=""
TRAINING_PID=""
STAGED_DIR=""

log() {
    echo "[$(date '+%Y-%m-%d %H:%M:%S')] ${SLURM_JOB_ID:+job $SLURM_JOB_ID: }$*"
}

die() {
    echo "error: $*" >&2
    exit 2
}

on_stop_signal() {
    STOP_SIGNAL=$1
    if [[ -z $TRAINING_PID ]]; then
        log "got SIG$1 before training started"
    elif [[ $1 == USR1 ]]; then
        log "got SIGUSR1: asking the training to checkpoint and stop"
        kill -USR1 "$TRAINING_PID" 2>/dev/null || true
    else
        # SLURM signals every process of the job with SIGTERM (scancel, pre-emption): the
        # training got it too and is already checkpointing; wait for it, do not requeue.
        log "got SIG$1: waiting for the training to checkpoint and stop"
    fi
}

# Armed as soon as this file is sourced: a USR1 that came before the trap would kill the script.
trap 'on_stop_signal USR1' USR1
trap 'on_stop_signal TERM' TERM

# Run a command once on every node of the job (directly when there is one node).
on_each_node() {
    if [[ ${SLURM_NNODES:-1} -gt 1 ]]; then
        srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 bash -c "$1"
    else
        bash -c "$1"
    fi
}

# slurm_repo_setup <recipe>
# Sets REPO (the repository, now the working directory), PYTHON and NPROC_PER_NODE.
#   PYTHON         the interpreter (default: <repo>/.venv/bin/python, else python3)
#   NPROC_PER_NODE processes per node (default: the GPUs SLURM gave the node, else 1)
slurm_repo_setup() {
    REPO=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    [[ -f $REPO/recipes/$1/train.py ]] ||
        die "$REPO/recipes/$1/train.py not found: submit from the repository root or set REPO_DIR"
    cd "$REPO" || die "cannot cd to $REPO"
    PYTHON=${PYTHON:-$REPO/.venv/bin/python}
    [[ -x $PYTHON ]] || PYTHON=$(command -v python3) || die "no Python found: run 'make setup' or set PYTHON"
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
    [[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] || NPROC_PER_NODE=1
    # srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05).
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
}

# slurm_job_setup <recipe> <data root> [hydra overrides...]
# slurm_repo_setup, then sets RECIPE, RUN_DIR and OVERRIDES (data.root first).
#   STAGE_DATA=1   copy the data root to node-local disk (${STAGE_DIR:-${TMPDIR:-/tmp}}) first;
#                  removed when the job ends or requeues. Checkpoints and logs stay in RUN_DIR.
slurm_job_setup() {
    RECIPE=$1
    local data_root=$2 arg name=""
    shift 2
    slurm_repo_setup "$RECIPE"

    OVERRIDES=()
    RUN_DIR=""
    for arg in "$@"; do
        case $arg in
            data.root=*) data_root=${arg#data.root=} ;;
            run_dir=*) RUN_DIR=${arg#run_dir=}; OVERRIDES+=("$arg") ;;
            name=*) name=${arg#name=}; OVERRIDES+=("$arg") ;;
            *) OVERRIDES+=("$arg") ;;
        esac
    done
    if [[ -z $RUN_DIR ]]; then
        if [[ -z $name ]]; then
            name=slurm-${SLURM_JOB_ID:-local}
            OVERRIDES+=("name=$name")
        fi
        RUN_DIR=runs/$RECIPE/$name
    fi

    if [[ ${STAGE_DATA:-0} == 1 ]]; then
        [[ -e $data_root ]] || die "data root $data_root does not exist (run 'make prep-$RECIPE' first)"
        STAGED_DIR=${STAGE_DIR:-${TMPDIR:-/tmp}}/recipes-${USER:-user}-${SLURM_JOB_ID:-$$}
        log "staging $data_root to node-local $STAGED_DIR on ${SLURM_NNODES:-1} node(s)"
        on_each_node "mkdir -p '$STAGED_DIR' && cp -a '$(realpath "$data_root")/.' '$STAGED_DIR/' &&
            echo \"staged \$(du -sh '$STAGED_DIR' | cut -f1) on \$(hostname)\"" ||
            die "staging $data_root to $STAGED_DIR failed"
        data_root=$STAGED_DIR
    fi
    OVERRIDES=("data.root=$data_root" "${OVERRIDES[@]}")

    log "start (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): $RECIPE, ${SLURM_NNODES:-1} node(s) x" \
        "$NPROC_PER_NODE process(es), run dir $RUN_DIR"
}

remove_staged_data() {
    if [[ -n $STAGED_DIR ]]; then
        on_each_node "rm -rf '$STAGED_DIR' && echo \"removed $STAGED_DIR on \$(hostname)\"" ||
            log "could not remove $STAGED_DIR"
        STAGED_DIR=""
    fi
}

# run_preemptible <command...>: run the training; on USR1 let it checkpoint, then requeue.
run_preemptible() {
    local status=0
    if [[ -n $STOP_SIGNAL ]]; then
        status=75
    else
        "$@" &
        TRAINING_PID=$!
        # `wait` also returns when a trap ran; keep waiting until the training has exited.
        while kill -0 "$TRAINING_PID" 2>/dev/null; do
            wait "$TRAINING_PID" || true
        done
        wait "$TRAINING_PID" || status=$?
    fi
    remove_staged_data
    if [[ $status -eq 0 ]]; then
        log "training finished${RUN_DIR:+; summary in $RUN_DIR/summary.json}"
        return 0
    fi
    if [[ $STOP_SIGNAL == USR1 && $status -eq 75 ]]; then
        # In a job array, $SLURM_JOB_ID of task 0 is also the array's id, and requeueing it would
        # requeue every task: name the task itself.
        local job=$SLURM_JOB_ID
        if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
            job=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
        fi
        log "training stopped (exit $status) after its checkpoint; requeueing $job"
        scontrol requeue "$job"
        exit 0
    fi
    log "training exited with code $status${STOP_SIGNAL:+ after SIG$STOP_SIGNAL}"
    exit "$status"
}
