"""Stage replicas on a real two-node Ray cluster started by this module: placement over both nodes,
multi-turn conversations keeping their hit rate, and a replica killed mid-run losing no request.

The cluster: `ray start --head --block` plus a second `ray start --address HEAD --block` on this machine
with its own CPUs and temp dir, both on loopback and free ports, auth disabled, each in its own process
group. They are stopped by killing those process groups and the processes they spawned (as in
test_ray_job.py: never `ray stop`, which would stop every Ray cluster of this user on the machine).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from omni import Omni  # noqa: E402
from tests.fakes import chain_config, expected_tokens, fake_factory, text_ids  # noqa: E402
from tests.procs import free_ports, stop_tree, tail  # noqa: E402
from tests.pipeline.test_replicas import TINY, conversations  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.slow]

REPO = str(Path(__file__).resolve().parents[2])
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1",
                                 "--num-cpus", "2", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=log.parent, start_new_session=True)


def _node_ports() -> list[str]:
    agent_http, agent_grpc, env_agent, metrics, node_manager, object_manager = free_ports(6)
    return ["--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
            "--runtime-env-agent-port", str(env_agent), "--metrics-export-port", str(metrics),
            "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager)]


@pytest.fixture(scope="module")
def cluster(own_ray):
    """Two nodes (2 CPUs each); the driver connected to them (`own_ray`: not to the session's shared
    cluster, which is shut down first). Yields the two node ids (head first)."""
    if not (BIN / "ray").exists():
        pytest.skip("the `ray` command is not installed in this environment")
    root = Path(tempfile.mkdtemp(prefix="omni-rr-", dir="/tmp"))  # short: Ray's socket paths
    (root / "head").mkdir()
    (root / "node2").mkdir()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": REPO}
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(var, None)
    gcs, client = free_ports(2)
    procs = [_start(["--head", "--port", str(gcs), "--ray-client-server-port", str(client), "--include-dashboard=false",
                     "--object-store-memory", str(200 * 2**20), "--temp-dir", str(root / "head"),
                     "--resources", '{"head_node": 1}', *_node_ports()], root / "head.log", env)]
    try:
        address = f"127.0.0.1:{gcs}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (root / "head.log").read_text(errors="replace").count("Ray runtime started"):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the head node did not start:\n{tail(root / 'head.log')}")
            time.sleep(0.5)
        procs.append(_start(["--address", address, "--object-store-memory", str(200 * 2**20),
                             "--temp-dir", str(root / "node2"), "--resources", '{"second_node": 1}', *_node_ports()],
                            root / "node2.log", env))
        ray.init(address=address, log_to_driver=False)  # the nodes hand their workers PYTHONPATH (env)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if procs[1].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the second node did not join:\n{tail(root / 'node2.log')}")
            time.sleep(0.5)
        # A node is alive in the GCS before the scheduler's view of the cluster's resources has its CPUs:
        # an actor placed then (SPREAD is best effort) goes to the nodes it sees, all on one when loaded.
        # A condition wait: returns once the scheduler sees both nodes' CPUs free.
        while not (ray.available_resources().get("CPU", 0) >= 4 and
                   {"head_node", "second_node"} <= set(ray.available_resources())):
            if time.monotonic() > deadline:
                pytest.fail(f"the scheduler never saw both nodes' CPUs: {ray.available_resources()}")
            time.sleep(0.1)
        nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: "head_node" not in n["Resources"])
        yield [n["NodeID"] for n in nodes]
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        for proc in reversed(procs):
            stop_tree(proc)
        shutil.rmtree(root, ignore_errors=True)


def test_replicas_spread_over_both_nodes_and_conversations_keep_their_hit_rate(cluster):
    over = {s: {"replicas": 2} for s in ("thinker", "talker")}
    with Omni(TINY, stage_overrides=over) as o:
        stats = o.stats()["stages"]
        for name in ("thinker", "talker"):
            placed = [r["node_id"] for r in stats[name]["replicas"]]
            assert sorted(placed) == sorted(cluster), (name, placed)  # one replica on each node (SPREAD)
        convs = conversations(o, num=4, turns=3)
        stats = o.stats()["stages"]
    block = 4  # tiny_chain's block size
    for conv in convs:
        for prev, turn in zip(conv, conv[1:]):
            # Every follow-up turn found the whole previous prompt in the cache of the replica it went to.
            prompt = len(prev.outputs["thinker"].prompt_token_ids)
            assert turn.outputs["thinker"].num_cached_tokens >= prompt // block * block
    assert all(r["finished"] > 0 for r in stats["thinker"]["replicas"])  # both replicas served
    for name in ("thinker", "talker"):  # the talker routed by the conversation's lineage
        router = stats[name]["router"]
        assert router["decisions"]["affinity"] == 8, (name, router)
        # Predicted from finished turns only (tests/pipeline/test_router.py): exactly the hits obtained,
        # whenever turn 1's requests sharing the system prompt reached their replica.
        assert router["obtained_hit_blocks"] == router["predicted_hit_blocks"] > 0, (name, router)
        assert router["shortfalls"] == 0, (name, router)


def test_killing_a_replica_mid_run_loses_no_request(cluster):
    data = chain_config(request_timeout_s=120)
    data["runtime"]["backend"] = "ray"
    th, tk = data["stages"]
    th.update(replicas=2, max_restarts=1, model_kwargs={"step_delay_s": 0.05}, sampling={"max_tokens": 20})
    tk.update(replicas=2, max_restarts=1)
    prompts = [f"request {i}" for i in range(12)]
    with Omni(data, engine_factory=fake_factory) as o:
        victim = o._backend.replica_actors["thinker"][1]
        pid_before = o.stats()["stages"]["thinker"]["replicas"][1]["pid"]
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(outs=o.generate(prompts, use_tqdm=False)))
        t.start()
        deadline = time.monotonic() + 60  # a condition wait: ends once both replicas run requests
        while time.monotonic() < deadline:
            running = [r.get("running", 0) for r in o.stats()["stages"]["thinker"]["replicas"]]
            if all(running):
                break
            time.sleep(0.05)
        assert all(running), running
        ray.kill(victim, no_restart=False)
        t.join(90)
        assert not t.is_alive()
        outs = results["outs"]
        # Every request answered once, correctly: those the killed replica held were retried on the other.
        assert [o_.error for o_ in outs] == [None] * len(prompts)
        for p, out in zip(prompts, outs):
            assert out.outputs["thinker"].token_ids == expected_tokens("thinker", text_ids(p), 20)
        stats = o.stats()
        assert stats["requests"]["finished"] == len(prompts) and stats["requests"]["in_flight"] == 0
        assert stats["stages"]["thinker"]["orchestrator"]["retried"] >= 1
        # Ray restarted the replica; the router sends to it again once it serves.
        deadline = time.monotonic() + 60
        while o._backend.replica_states("thinker") != ["up", "up"] and time.monotonic() < deadline:
            o.generate(["probe"], use_tqdm=False)
        assert o._backend.replica_states("thinker") == ["up", "up"]
        later = o.generate([f"later {i}" for i in range(6)], use_tqdm=False)
        assert all(x.error is None for x in later)
        replica1 = o.stats()["stages"]["thinker"]["replicas"][1]
        assert replica1["pid"] != pid_before and replica1["finished"] > 0
