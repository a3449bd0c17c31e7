"""One budget per device, and which device each copy of a stage lands on.

Devices are "cpu" (the host's RAM: CPU stages, and every stage's tensor cache and block pool) and
"cuda:0", "cuda:1", ... Copies of CUDA stages are packed onto GPUs in config order by their
`resources.num_gpus` (first fit, as Ray packs fractional GPUs; a stage with num_gpus 0 or a local
backend shares GPU 0), so stages that split one GPU share its budget. Each replica is one copy.

A device's budget, first that applies:
    GPU    runtime.memory.gpu_memory_utilization x its total memory;  --memory-gb / budget_gb;
           else 90% of its free memory
    host   --memory-gb / budget_gb;  else 90% of the available RAM (omni/engine/memory.py: psutil,
           /proc/meminfo, a cgroup limit)

The machine is asked through `MachineProbe`, so tests fake both (no GPU needed to test GPU plans).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from omni.config.schema import PipelineConfig

from omni.planning.needs import StageNeeds

GiB = 2**30
FREE_FRACTION = 0.9  # of what a device has free, when no budget is given (room for the rest of the process)


@dataclass(frozen=True, slots=True)
class MachineProbe:
    host_available: Callable[[], tuple[int | None, str]]
    gpu_count: Callable[[], int]
    gpu_memory: Callable[[int], tuple[int, int]]  # (free, total) bytes of GPU i


def real_probe() -> MachineProbe:
    from omni.engine.memory import host_available

    def gpu_count() -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def gpu_memory(i: int) -> tuple[int, int]:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device("cuda", i))
        return int(free), int(total)

    return MachineProbe(host_available, gpu_count, gpu_memory)


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    name: str
    budget: int
    source: str


def place(needs: list[StageNeeds], num_gpus: dict[str, float], gpu_count: int) -> dict[str, list[str]]:
    """stage -> the device of each of its copies."""
    load = [0.0] * max(gpu_count, 1)
    out: dict[str, list[str]] = {}
    for n in needs:
        devices = []
        for _ in range(n.replicas):
            if n.device == "cpu":
                devices.append("cpu")
                continue
            g = num_gpus.get(n.stage, 0.0)
            slot = next((i for i, used in enumerate(load) if used + g <= 1.0 + 1e-9), 0)
            load[slot] += g
            devices.append(f"cuda:{slot}")
        out[n.stage] = devices
    return out


def device_budgets(config: PipelineConfig, devices: set[str], probe: MachineProbe,
                   memory_gb: float | None = None) -> dict[str, DeviceBudget]:
    mem = getattr(config.runtime, "memory", None)
    budget_gb = memory_gb if memory_gb is not None else (mem.budget_gb if mem is not None else None)
    given = "--memory-gb" if memory_gb is not None else "runtime.memory.budget_gb"
    util = mem.gpu_memory_utilization if mem is not None else None
    out = {}
    for d in sorted(devices | {"cpu"}):
        if d == "cpu":
            if budget_gb is not None:
                out[d] = DeviceBudget(d, int(budget_gb * GiB), f"{given} {budget_gb:g}")
            else:
                avail, source = probe.host_available()
                if avail is None:
                    raise ValueError("the host's available memory is unknown here: give a budget "
                                     "(--memory-gb or runtime.memory.budget_gb)")
                out[d] = DeviceBudget(d, int(avail * FREE_FRACTION), f"{FREE_FRACTION:.0%} of {source}")
            continue
        free, total = probe.gpu_memory(int(d.split(":")[1]))
        if util is not None:
            out[d] = DeviceBudget(d, int(util * total), f"gpu_memory_utilization {util:g} of {total / GiB:.1f} GiB")
        elif budget_gb is not None:
            out[d] = DeviceBudget(d, int(budget_gb * GiB), f"{given} {budget_gb:g}")
        else:
            out[d] = DeviceBudget(d, int(free * FREE_FRACTION), f"{FREE_FRACTION:.0%} of free GPU memory")
    return out
