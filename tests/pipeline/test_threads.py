"""Torch threads that fit the cores a stage reserves (omni/pipeline/threads.py): the rule, the local
backend's polling thread, a Ray stage actor's step thread (where its forward passes run)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from omni import Omni
from omni.config.loader import load_config
from omni.pipeline.threads import ThreadsPerCaller, available_cores, local_threads, stage_threads
from tests.fakes import chain_config
from tests.pipeline.lazy_torch_engine import ThreadsEngine, lazy_threads_factory


def threads_factory(stage) -> ThreadsEngine:
    """The engine of lazy_threads_factory, from this module, which imports torch: the actor has it from the start."""
    return ThreadsEngine(stage)


def with_cpus(data: dict, thinker: float, talker: float) -> dict:
    data["stages"][0]["resources"] = {"num_cpus": thinker}
    data["stages"][1]["resources"] = {"num_cpus": talker}
    return data


def test_stage_threads_are_its_whole_cpus_at_least_one_at_most_the_cores():
    assert stage_threads(0, cores=8) == 1
    assert stage_threads(0.5, cores=8) == 1
    assert stage_threads(2, cores=8) == 2
    assert stage_threads(3.7, cores=8) == 3
    assert stage_threads(16, cores=4) == 4


def test_local_threads_are_the_pipelines_cpus_at_most_the_cores():
    cfg = load_config(with_cpus(chain_config(), 1.5, 2))
    assert local_threads(cfg.stages, cores=16) == 3
    assert local_threads(cfg.stages, cores=2) == 2
    cfg = load_config(with_cpus(chain_config(), 0, 0.5))
    assert local_threads(cfg.stages, cores=16) == 1
    data = with_cpus(chain_config(), 1, 1)
    data["stages"][1]["replicas"] = 3
    assert local_threads(load_config(data).stages, cores=16) == 4


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_actor_without_torch_yet_gives_it_the_stages_threads_for_when_it_comes():
    """set_process_torch_threads in a fresh interpreter (a stage actor's process): no torch imported, so none is; the
    torch imported later runs every thread with the stage's count."""
    import subprocess
    import sys

    code = ("import sys, threading\n"
            "from omni.pipeline.threads import set_process_torch_threads\n"
            "set_process_torch_threads(1)\n"
            "assert 'torch' not in sys.modules\n"
            "import torch\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(torch.get_num_threads())); t.start(); t.join()\n"
            "print(torch.get_num_threads(), seen[0])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1"]  # torch caps a larger count at the cores


def test_available_cores_keep_to_the_environments_thread_budget(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = available_cores()
    assert cores >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. one pytest-xdist worker's share
    assert available_cores() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 8))  # a budget past the cores gives the cores
    assert available_cores() == cores
    for unset in ("", "0", "auto"):  # no budget
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert available_cores() == cores


def test_threads_per_caller_sets_each_thread_once_and_restores_the_closing_thread():
    before = torch.get_num_threads()
    target = 2 if before != 2 else 3
    per_caller = ThreadsPerCaller(target)
    seen = {}

    def other():
        per_caller.apply()
        seen["other"] = torch.get_num_threads()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["other"] == target
    assert torch.get_num_threads() == before  # another thread's count is its own
    per_caller.apply()
    assert torch.get_num_threads() == target
    per_caller.restore()
    assert torch.get_num_threads() == before


def test_local_backend_steps_stages_with_the_pipelines_cpus_and_gives_the_callers_back():
    before = torch.get_num_threads()
    data = with_cpus(chain_config(), 1, 1)
    expected = local_threads(load_config(data).stages)
    assert expected == min(2, available_cores())
    with Omni(data, engine_factory=threads_factory) as o:
        o.generate(["hello"])
        stats = o.stats()["stages"]
        assert stats["thinker"]["step_threads"] == expected
        assert stats["talker"]["step_threads"] == expected
    assert torch.get_num_threads() == before


@pytest.mark.ray
@pytest.mark.slow
# torch imported with the factory's module (before the actor's constructor), or only by the engine's first step
@pytest.mark.parametrize("factory", [threads_factory, lazy_threads_factory], ids=["torch-at-start", "torch-later"])
def test_ray_stage_actor_steps_with_its_num_cpus(ray_cluster, factory):
    data = with_cpus(chain_config(), 2, 0.5)
    data["runtime"]["backend"] = "ray"
    with Omni(data, engine_factory=factory) as o:
        o.generate(["hello"])
        stats = o.stats()["stages"]
    # num_cpus 2 -> 2 threads (1 on a one-CPU machine), 0.5 -> 1: whatever OMP_NUM_THREADS the actor
    # process inherited (the suite sets 1).
    assert stats["thinker"]["step_threads"] == min(2, os.cpu_count() or 1)
    assert stats["talker"]["step_threads"] == 1
