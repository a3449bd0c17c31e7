#!/usr/bin/env bash
# Submit `omni run` to a running Ray cluster as a Ray job.
#
#   # once, on the head node, from the project's environment:
#   source .venv/bin/activate
#   RAY_AUTH_MODE=disabled ray start --head            # the job server listens on :8265
#   # then, from the repository root:
#   examples/ray_job.sh [CONFIG] [PROMPT...]
#   # when done, on each node (it stops every Ray node this user started on the machine):
#   ray stop
#
# RAY_JOB_ADDRESS is the cluster's job server (default http://127.0.0.1:8265, where `ray start --head`
# puts it); set it for a cluster on another host or port. When nothing answers there the script says so in
# one line and exits 1, before submitting anything.
#
# The job's entrypoint runs `python` from the PATH the cluster was started with (a
# cluster started with .venv/bin/ray without activating the venv would find the system
# Python, without torch): this script names .venv/bin/python by its absolute path when
# there is one (or $PYTHON), and the stage actors start with the same interpreter.
#
# Inside the job, RAY_ADDRESS is set, so `omni run` connects to the cluster
# instead of starting an embedded Ray; each stage becomes an actor placed by
# its `resources` (num_cpus, num_gpus, custom) from the YAML.
#
# Ray 2.60 enables token auth by default: against a cluster started WITHOUT
# RAY_AUTH_MODE=disabled, run this with RAY_AUTH_MODE=token (and the cluster's token).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${1:-stage_configs/tiny_chain.yaml}
shift || true
if [ "$#" -eq 0 ]; then set -- "Hello from a Ray job" "Hello from a Ray job, again"; fi
PROMPT_ARGS=()
for p in "$@"; do PROMPT_ARGS+=(--prompt "$p"); done

RAY=${RAY:-ray}
if ! command -v "$RAY" >/dev/null 2>&1 && [ -x .venv/bin/ray ]; then RAY=.venv/bin/ray; fi
ADDRESS=${RAY_JOB_ADDRESS:-http://127.0.0.1:8265}
case "$ADDRESS" in *://*) ;; *) ADDRESS="http://$ADDRESS" ;; esac
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"; else PYTHON=python; fi
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

# Does a job server answer? (3 s; any HTTP answer counts, an auth refusal included.) Without this
# check `ray job submit` ends in a traceback when no cluster is there.
if ! "$PYTHON" - "$ADDRESS" 2>/dev/null <<'EOF'
import sys
import urllib.error
import urllib.request

try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/api/version", timeout=3)
except urllib.error.HTTPError:
    pass
EOF
then
  echo "examples/ray_job.sh: no Ray cluster answers at $ADDRESS: start one (ray start --head) or set RAY_JOB_ADDRESS=http://HOST:8265" >&2
  exit 1
fi

# The working directory is uploaded to the cluster (without the virtualenv and
# caches); the job's Python must have omni's dependencies installed.
exec "$RAY" job submit --address "$ADDRESS" --working-dir . \
  --runtime-env-json '{"excludes": [".venv", ".git", "out", "*.egg-info", "__pycache__", ".pytest_cache"]}' \
  -- "$PYTHON" -m omni.cli run "$CONFIG" "${PROMPT_ARGS[@]}" --json
