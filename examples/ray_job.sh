#!/usr/bin/env bash
# Submit `omni run` to a running Ray cluster as a Ray job.
#
#   # once, on the head node, from the project's environment:
#   source .venv/bin/activate
#   RAY_AUTH_MODE=disabled ray start --head            # the job server listens on :8265
#   # then, from the repository root:
#   examples/ray_job.sh [CONFIG] [PROMPT...]
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
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"; else PYTHON=python; fi
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

# The working directory is uploaded to the cluster (without the virtualenv and
# caches); the job's Python must have omni's dependencies installed.
exec "$RAY" job submit --address "$ADDRESS" --working-dir . \
  --runtime-env-json '{"excludes": [".venv", ".git", "out", "*.egg-info", "__pycache__", ".pytest_cache"]}' \
  -- "$PYTHON" -m omni.cli run "$CONFIG" "${PROMPT_ARGS[@]}" --json
