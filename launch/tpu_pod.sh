#!/usr/bin/env bash
# Run pdm_jax.train on a Cloud TPU VM pod: create (or reuse) -> copy code -> install -> train on
# every worker (multi-host, jax.distributed) with streamed logs -> delete.
#
#   launch/tpu_pod.sh --name=pdm-8b --project=my-proj --zone=us-east5-a --accelerator=v5p-128 \
#       --config=configs/qwen3_dapo.py:size=8b,hf_path=/mnt/ckpt/Qwen3-8B-Base,data_path=/mnt/data/dapo.parquet \
#       --bucket=gs://my-bucket/pdm_runs
#
#   launch/tpu_pod.sh --dry-run ...    prints every command instead of running it
#
# The workdir is <bucket>/<name> (gs://my-bucket/pdm_runs/pdm-8b): every host writes its own
# shards of the orbax checkpoints there and process 0 the metrics, summary and TensorBoard
# events, so the run outlives its VMs. Re-running the same command (after a preemption, a
# failure or the VM's deletion) resumes from the newest intact checkpoint in the bucket.
# The TPU VMs' service account needs read/write access to the bucket.
#
# Flags (all --key=value):
#   --name          TPU VM name (required)
#   --project       GCP project (required)
#   --zone          zone, e.g. us-central2-b (required)
#   --accelerator   accelerator type, e.g. v5p-128 (64 chips: the Qwen3 recipes' slice), v4-32, v5litepod-16
#                   (required)
#   --version       TPU VM runtime image (default by generation, as Cloud TPU's software-versions page lists
#                   them: tpu-ubuntu2204-base for v2-v4, v2-alpha-tpuv5-lite for v5litepod, v2-alpha-tpuv5
#                   for v5p, v2-alpha-tpuv6e for v6e; required for any other accelerator type)
#   --config        config spec passed to --config= of pdm_jax.train (default configs/tiny.py)
#   --bucket        gs://bucket[/prefix] for the run's workdir <bucket>/<name> (default: $PDM_BUCKET)
#   --workdir       the run directory itself, instead of <bucket>/<name>: a gs:// URL, or an absolute
#                   local path on each host (not resumable once the VMs are gone: its checkpoints hold
#                   only worker 0's shards; copied back from worker 0 at the end, as --results says)
#   --results       local directory for pod.log (default runs/<name>); with a local --workdir, where
#                   worker 0's workdir is copied (its files land directly in it: <results>/summary.json,
#                   and its log as <results>/<workdir name>.log): a local directory (scp) or gs://...
#                   (gsutil; pod.log is written on this machine as /tmp/<name>_pod.log, then uploaded as
#                   <results>/pod.log with this machine's gsutil)
#   --repo          git URL to clone on the workers; default: the local checkout, packed with
#                   `git archive HEAD` and copied to every worker
#   --branch        branch/tag for --repo (default main)
#   --install       install command run in the code directory on every worker
#                   (default: pip install -e . && pip install 'jax[tpu]==<pinned jax version>')
#   --flag          extra argument for pdm_jax.train (repeatable), e.g. --flag=--config.rl.steps=10;
#                   the run starts with --config.sampler.mode=colocated (the sampler in the trainer's
#                   processes, weights synced in memory), which a --flag can override
#   --spot          create a spot TPU VM
#   --keep          do not delete the TPU VM at the end (also skipped on failure with --keep)
#   --dry-run       print the commands, run nothing
#
# Every worker runs the same command with --config.distributed=True, so pdm_jax.train calls
# jax.distributed.initialize() (the TPU runtime provides the coordinator); `--worker=all`
# streams every worker's output (prefixed by gcloud) to this terminal and to <results>/pod.log
# (/tmp/<name>_pod.log when --results is a gs:// URL, uploaded to <results>/pod.log at the end).
# An existing TPU VM of that name is reused when READY, recreated otherwise (e.g. preempted).
set -euo pipefail

NAME="" PROJECT="" ZONE="" ACCEL="" VERSION="" BUCKET="${PDM_BUCKET:-}"
CONFIG="configs/tiny.py" WORKDIR="" RESULTS="" REPO="" BRANCH="main" INSTALL=""
SPOT=0 KEEP=0 DRY=0 TRAINED=0
EXTRA=()
CODE_DIR="pdm_jax_src"

die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

for arg in "$@"; do
  case "$arg" in
    --name=*) NAME="${arg#*=}" ;;
    --project=*) PROJECT="${arg#*=}" ;;
    --zone=*) ZONE="${arg#*=}" ;;
    --accelerator=*) ACCEL="${arg#*=}" ;;
    --version=*) VERSION="${arg#*=}" ;;
    --config=*) CONFIG="${arg#*=}" ;;
    --bucket=*) BUCKET="${arg#*=}" ;;
    --workdir=*) WORKDIR="${arg#*=}" ;;
    --results=*) RESULTS="${arg#*=}" ;;
    --repo=*) REPO="${arg#*=}" ;;
    --branch=*) BRANCH="${arg#*=}" ;;
    --install=*) INSTALL="${arg#*=}" ;;
    --flag=*) EXTRA+=("${arg#*=}") ;;
    --spot) SPOT=1 ;;
    --keep) KEEP=1 ;;
    --dry-run|--dry_run) DRY=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$PROJECT" ]] || die "--project is required"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ -n "$ACCEL" ]] || die "--accelerator is required (e.g. v5p-128)"
if [[ -z "$VERSION" ]]; then
  case "$ACCEL" in
    v2-*|v3-*|v4-*) VERSION="tpu-ubuntu2204-base" ;;
    v5litepod-*|v5e-*) VERSION="v2-alpha-tpuv5-lite" ;;
    v5p-*) VERSION="v2-alpha-tpuv5" ;;
    v6e-*) VERSION="v2-alpha-tpuv6e" ;;
    *) die "--accelerator='$ACCEL': no default runtime image for it; pass --version=IMAGE (gcloud compute tpus tpu-vm versions list --zone=$ZONE)" ;;
  esac
fi
[[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name='$NAME': lowercase letters, digits and hyphens, starting with a letter"
[[ -n "$RESULTS" ]] || RESULTS="runs/$NAME"
if [[ -z "$WORKDIR" ]]; then
  [[ -n "$BUCKET" ]] || die "a pod run needs a bucket for its workdir: --bucket=gs://BUCKET[/PREFIX] or PDM_BUCKET (or --workdir=...)"
  [[ "$BUCKET" == gs://* ]] || die "--bucket='$BUCKET': expected gs://BUCKET[/PREFIX]"
  WORKDIR="${BUCKET%/}/$NAME"
fi
# trailing slashes dropped: "$WORKDIR.log" is the worker's log beside the workdir, not a file inside it
while [[ "$WORKDIR" == */ && "$WORKDIR" != / ]]; do WORKDIR="${WORKDIR%/}"; done
while [[ "$RESULTS" == */ && "$RESULTS" != / ]]; do RESULTS="${RESULTS%/}"; done
REMOTE_WD=0
[[ "$WORKDIR" == gs://* ]] && REMOTE_WD=1
# A local workdir is copied back from worker 0's home directory, not from the code directory training runs in.
[[ $REMOTE_WD -eq 1 || "$WORKDIR" == /* ]] || die "--workdir='$WORKDIR': a local workdir must be an absolute path on the hosts (or gs://...)"
# The sampler mode that works on a pod: colocated (if this checkout's config knows it).
SAMPLER_FLAG=()
if grep -q '"colocated"' "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/pdm_jax/config.py"; then
  SAMPLER_FLAG=(--config.sampler.mode=colocated)
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "$INSTALL" ]]; then
  JAX_PIN="$(sed -n 's/^ *"jax==\([0-9.]*\)".*/\1/p' "$REPO_ROOT/pyproject.toml" | head -n1)"
  INSTALL="python3 -m pip install -q -e . && python3 -m pip install -q 'jax[tpu]==${JAX_PIN:-0.10.2}'"
fi

GC=(gcloud compute tpus tpu-vm)
LOC=(--project="$PROJECT" --zone="$ZONE")

# sq STRING: STRING quoted for a POSIX shell (bare if it only has safe characters, else '...').
sq() {
  if [[ "$1" =~ ^[-A-Za-z0-9_./:=,@%+]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

# show CMD...: the command line, each word quoted with sq.
show() { local out="+" w; for w in "$@"; do out+=" $(sq "$w")"; done; printf '%s' "$out"; }

# run CMD...: print it (always, prefixed with '+'), execute it unless --dry-run.
run() {
  show "$@"; printf '\n'
  if [[ $DRY -eq 0 ]]; then "$@"; fi
}

remote() {  # remote WORKER COMMAND: ssh into the pod and run COMMAND on WORKER (all | 0 | ...)
  run "${GC[@]}" ssh "$NAME" "${LOC[@]}" --worker="$1" --command="$2"
}

COPIED=0
copy_results() {  # local workdir: worker 0 holds metrics.jsonl, summary.json, curves.png, its checkpoint shards
  if [[ $REMOTE_WD -eq 1 ]]; then
    echo "# the run's files are in $WORKDIR"
  elif [[ "$RESULTS" == gs://* ]]; then  # the workdir's files (the worker's shell expands the *), not the folder
    remote 0 "gsutil -m cp -r $(sq "$WORKDIR")/* $(sq "$WORKDIR.log") $(sq "$RESULTS/")"
  else
    local base; base="$(basename "$WORKDIR")"
    run "${GC[@]}" scp --recurse "$NAME:$WORKDIR" "$NAME:$WORKDIR.log" "$RESULTS/" "${LOC[@]}" --worker=0
    # scp puts the folder inside <results> under its own name: its files move up, so <results> is the run directory
    if [[ $DRY -eq 1 || -d "$RESULTS/$base" ]]; then
      run cp -r "$RESULTS/$base/." "$RESULTS/"
      run rm -rf "${RESULTS:?}/$base"
    fi
  fi
  if [[ "$RESULTS" == gs://* ]]; then  # pod.log (every worker's output) from this machine, where it was written
    run gsutil cp "$LOGFILE" "$RESULTS/pod.log" || echo "# pod.log not uploaded (no gsutil here?): it stays in $LOGFILE"
  fi
  COPIED=1
}

cleanup() {
  local rc=$?
  if [[ $DRY -eq 0 && -n "${TARBALL:-}" ]]; then rm -f "$TARBALL"; fi
  if [[ $rc -ne 0 && $COPIED -eq 0 && $TRAINED -eq 1 ]]; then
    echo "# failed (exit $rc): copying what worker 0 has before deleting"
    copy_results || true
  fi
  if [[ $KEEP -eq 0 ]]; then
    echo "# deleting TPU VM $NAME"
    run "${GC[@]}" delete "$NAME" "${LOC[@]}" --quiet || true
  else
    echo "# --keep: TPU VM $NAME left running"
  fi
  exit $rc
}

# 1. create, or reuse a READY VM of that name (a re-run); one in another state (preempted) is recreated
CREATE=("${GC[@]}" create "$NAME" "${LOC[@]}" --accelerator-type="$ACCEL" --version="$VERSION")
[[ $SPOT -eq 1 ]] && CREATE+=(--spot)
STATE=""
if [[ $DRY -eq 0 ]]; then
  STATE="$("${GC[@]}" describe "$NAME" "${LOC[@]}" --format='value(state)' 2>/dev/null || true)"
fi
if [[ "$STATE" == READY ]]; then
  echo "# TPU VM $NAME exists and is READY: reusing it"
else
  if [[ -n "$STATE" ]]; then run "${GC[@]}" delete "$NAME" "${LOC[@]}" --quiet; fi
  run "${CREATE[@]}"
fi
trap cleanup EXIT

# 2. code on every worker
if [[ -n "$REPO" ]]; then
  remote all "rm -rf $CODE_DIR && git clone --depth 1 --branch $(sq "$BRANCH") $(sq "$REPO") $CODE_DIR"
else
  TARBALL="/tmp/${NAME}_src.tar.gz"
  run git -C "$REPO_ROOT" archive --format=tar.gz --prefix="$CODE_DIR/" -o "$TARBALL" HEAD
  run "${GC[@]}" scp "$TARBALL" "$NAME:~/src.tar.gz" "${LOC[@]}" --worker=all
  remote all "rm -rf $CODE_DIR && tar xzf src.tar.gz && rm src.tar.gz"
fi

# 3. install
remote all "cd $CODE_DIR && $INSTALL"

# 4. train on every worker (multi-host), streaming the logs here and into <results>/pod.log.
# The worker pipes the run into `tee`: it runs under `bash -o pipefail` so that a failed training
# is the exit status of the ssh (and of this script), not tee's 0 (the login shell may lack pipefail).
WORKER_LOG="$WORKDIR.log"
[[ $REMOTE_WD -eq 1 ]] && WORKER_LOG="/tmp/${NAME}_train.log"
TRAIN="cd $CODE_DIR && python3 -m pdm_jax.train --config=$(sq "$CONFIG") --workdir=$(sq "$WORKDIR") --config.distributed=True"
for f in "${SAMPLER_FLAG[@]+"${SAMPLER_FLAG[@]}"}" "${EXTRA[@]+"${EXTRA[@]}"}"; do TRAIN+=" $(sq "$f")"; done
TRAIN+=" 2>&1 | tee $(sq "$WORKER_LOG")"
TRAIN="bash -o pipefail -c $(sq "$TRAIN")"
if [[ "$RESULTS" != gs://* ]]; then run mkdir -p "$RESULTS"; fi
LOGFILE="/tmp/${NAME}_pod.log"
[[ "$RESULTS" != gs://* ]] && LOGFILE="$RESULTS/pod.log"
show "${GC[@]}" ssh "$NAME" "${LOC[@]}" --worker=all --command="$TRAIN"; printf ' 2>&1 | tee %s\n' "$(sq "$LOGFILE")"
TRAINED=1  # from here on a failure still copies worker 0's workdir back (local workdir)
if [[ $DRY -eq 0 ]]; then
  "${GC[@]}" ssh "$NAME" "${LOC[@]}" --worker=all --command="$TRAIN" 2>&1 | tee "$LOGFILE"
fi

# 5. results (also attempted by the exit trap when training failed)
copy_results

# 6. delete (trap)
if [[ $REMOTE_WD -eq 1 ]]; then echo "# done: results in $WORKDIR, log in $LOGFILE"; else echo "# done: results in $RESULTS, log in $LOGFILE"; fi
