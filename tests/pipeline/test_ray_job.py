"""`ray job submit -- omni run ...` against a real Ray cluster started for this test.

The cluster is private to the test: `ray start --head --block` on loopback, its own temp dir, free ports
(no default port that another cluster on this machine may hold), auth disabled, in its own process group.
It is stopped by killing that process group and the processes it spawned (never `ray stop`, which would
stop every cluster of this user on the machine).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.procs import free_ports, stop_tree, wait_until_up

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the project's environment: `ray`, `omni`
CONFIG = "stage_configs/tiny_chain.yaml"
PROMPT = "Hello from a Ray job"
# The working dir is uploaded to the cluster: leave out the virtualenv and caches (Ray refuses large
# packages, and the job imports omni's dependencies from the cluster's environment anyway).
EXCLUDES = [".venv", ".git", "out", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "build"]
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster():
    """A private head node; yields the job server's address (http://127.0.0.1:PORT)."""
    if not (BIN / "ray").exists():
        pytest.skip("the `ray` command is not installed in this environment")
    temp_dir = Path(tempfile.mkdtemp(prefix="omni-rj-", dir="/tmp"))  # short: Ray's socket paths
    log = temp_dir / "ray-start.log"
    gcs, dashboard, client, agent_http, agent_grpc, env_agent, metrics = free_ports(7)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(var, None)
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(gcs), "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dashboard), "--ray-client-server-port", str(client),
           "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--runtime-env-agent-port", str(env_agent), "--metrics-export-port", str(metrics),
           "--num-cpus", "2", "--object-store-memory", str(200 * 2**20), "--temp-dir", str(temp_dir),
           "--disable-usage-stats"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=temp_dir,
                                start_new_session=True)  # its own process group: stopped by killpg
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_until_up(proc, log, lambda: f"{address}/api/version", "the Ray cluster's job server", START_TIMEOUT_S, 1)
        yield address
    finally:
        stop_tree(proc)  # a graceful `ray start --block` shutdown can take 30 s: 5 s for this one
        shutil.rmtree(temp_dir, ignore_errors=True)


def client_env() -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(var, None)
    return env


def test_ray_job_submit_omni_run(cluster):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    submission_id = f"omni-test-{uuid.uuid4().hex[:8]}"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster, "--submission-id", submission_id,
           "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
           "--", "omni", "run", CONFIG, "--prompt", PROMPT, "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=client_env(), cwd=REPO)
    except subprocess.TimeoutExpired as e:
        JobSubmissionClient(cluster).stop_job(submission_id)
        pytest.fail(f"ray job submit did not finish within {JOB_TIMEOUT_S}s:\n{(e.stdout or '')[-4000:]}")
    client = JobSubmissionClient(cluster)
    status = client.get_job_status(submission_id)
    logs = client.get_job_logs(submission_id)
    assert r.returncode == 0 and status == JobStatus.SUCCEEDED, (
        f"rc={r.returncode} status={status}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\njob logs:\n{logs[-3000:]}")
    assert "succeeded" in r.stdout

    # `omni run --json` prints one JSON object on one line.
    lines = [ln for ln in logs.splitlines() if ln.startswith('{"pipeline"')]
    assert len(lines) == 1, logs[-3000:]
    res = json.loads(lines[0])
    assert res["pipeline"] == "tiny_chain"
    assert res["stats"]["backend"] == "ray"
    [out] = res["results"]
    assert out["prompt"] == PROMPT and out["error"] is None
    thinker, talker = out["outputs"]["thinker"], out["outputs"]["talker"]
    assert isinstance(thinker["text"], str) and 1 <= len(thinker["token_ids"]) <= 8
    assert len(talker["token_ids"]) == 8  # ignore_eos in the config
    assert talker["num_prompt_tokens"] == thinker["num_prompt_tokens"] + len(thinker["token_ids"]) - 1
    assert res["stats"]["requests"]["finished"] == 1

    # The stages ran as actors of this cluster (the job connected to it, no embedded Ray).
    actors = list_actors(address=cluster, filters=[("class_name", "=", "StageActor")], timeout=30,
                         raise_on_missing_output=False)
    names = sorted(a.name.split(".")[2] for a in actors if a.name.startswith("omni.tiny_chain."))
    assert names == ["talker", "thinker"], actors

    # Same outputs as the in-process backend.
    from omni import Omni

    with Omni(REPO / CONFIG, backend="local") as o:
        [want] = o.generate([PROMPT], use_tqdm=False)
    assert thinker["token_ids"] == want.outputs["thinker"].token_ids
    assert thinker["text"] == want.outputs["thinker"].text
    assert talker["token_ids"] == want.outputs["talker"].token_ids


def test_example_ray_job_script(cluster):
    """examples/ray_job.sh submits `python -m omni.cli run ...` the same way (repo as working dir)."""
    env = {**client_env(), "RAY_JOB_ADDRESS": cluster, "RAY": str(BIN / "ray")}
    try:
        r = subprocess.run(["bash", str(REPO / "examples" / "ray_job.sh"), CONFIG, "Hi", "Hi there"],
                           capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"examples/ray_job.sh did not finish within {JOB_TIMEOUT_S}s:\n{(e.stdout or '')[-4000:]}")
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{"pipeline"')]
    assert len(lines) == 1, r.stdout[-3000:]
    res = json.loads(lines[0])
    assert [x["prompt"] for x in res["results"]] == ["Hi", "Hi there"]
    assert all(x["error"] is None and len(x["outputs"]["talker"]["token_ids"]) == 8 for x in res["results"])
