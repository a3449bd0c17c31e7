"""The plan as text (one table per device, then the verdict: `omni plan`, `omni validate`) and as data
(`omni plan --json`)."""
from __future__ import annotations

from typing import Any

from omni.planning.plan import MemoryPlan, size


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def render(plan: MemoryPlan) -> str:
    lines = [f"memory plan for {plan.pipeline!r}" + (
        f": {plan.workload['concurrent_conversations']} conversations x {plan.workload['context_tokens']} tokens"
        if plan.workload else "")]
    head = ["stage", "copies", "weights", "activations", "KV blocks", "KV", "tensor cache", "encoder",
            "allocator",
            "total", "share", "convs", "verdict"]
    for d, dev in plan.devices.items():
        rows = []
        for name, copies in dev.copies.items():
            p = plan.stages[name]
            n = p.needs
            gpu_side_elsewhere = d == "cpu" and n.device != "cpu"
            count = len(p.devices) if gpu_side_elsewhere else copies
            mine = p.on(d)
            if mine == 0 or count == 0:
                continue
            blocks = f"{p.num_blocks:,}" + ("" if p.auto else " (set)") if n.autoregressive else "-"
            conv = p.conversations
            rows.append([
                name, str(count),
                "-" if gpu_side_elsewhere else size(n.weights),
                "-" if gpu_side_elsewhere else size(n.activations + n.working)
                + {"estimated": " est", "not measured": " ?"}.get(n.activations_source, ""),
                "-" if gpu_side_elsewhere else blocks,
                "-" if gpu_side_elsewhere or not n.autoregressive else size(p.kv_bytes),
                size(p.rows_bytes) if (d == "cpu") and n.autoregressive else "-",
                size(n.encoder_cache) if n.encoder_cache and not gpu_side_elsewhere else "-",
                size(n.allocator) if n.allocator and not gpu_side_elsewhere else "-",
                size(count * mine), f"{count * mine / dev.budget.budget:.0%}" if dev.budget.budget else "-",
                "-" if conv is None else str(conv), p.verdict])
        lines.append("")
        lines.append(f"device {d}: budget {size(dev.budget.budget)} ({dev.budget.source}), planned "
                     f"{size(dev.used)} ({dev.share:.0%}) - {'fits' if dev.fits else 'DOES NOT FIT'}")
        if rows:
            widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
            lines += ["  " + _row(head, widths)] + ["  " + _row(r, widths) for r in rows]
    notes = sorted({f"{n}: activations {p.needs.activations_source}" for n, p in plan.stages.items()
                    if p.needs.activations_source in ("estimated", "not measured")})
    if notes:
        lines += ["", "not measured yet (run `omni plan CONFIG` to profile them): " + "; ".join(notes)]
    lines += ["", ("OK: the plan fits" if plan.fits else "REFUSED: " + str(plan.errors[0]))
              + f" (planned in {plan.seconds * 1000:.0f} ms)"]
    return "\n".join(lines)


def as_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan for tools (`omni plan --json`)."""
    stages = {}
    for name, p in plan.stages.items():
        n = p.needs
        stages[name] = {
            "device": p.device, "copies": len(p.devices), "devices": p.devices, "auto": p.auto,
            "weights_bytes": n.weights, "weights_source": n.weights_source,
            "activations_bytes": n.activations, "activations_source": n.activations_source,
            "encoder_cache_bytes": n.encoder_cache, "working_bytes": n.working,
            "allocator_bytes": n.allocator,
            "kv_blocks": p.num_blocks, "block_size": n.block_size, "kv_bytes_per_block": n.kv_per_block,
            "kv_bytes": p.kv_bytes, "tensor_cache_bytes_per_token": n.rows_per_token,
            "tensor_cache_bytes": p.rows_bytes, "block_pool_bytes": p.pool_bytes,
            "total_bytes": p.total, "tokens_per_conversation": p.tokens_per_conversation,
            "conversations": p.conversations, "wanted_blocks": p.wanted_blocks, "verdict": p.verdict,
        }
    devices = {d: {"budget_bytes": dp.budget.budget, "budget_source": dp.budget.source, "used_bytes": dp.used,
                   "share": round(dp.share, 4), "fits": dp.fits, "copies": dp.copies}
               for d, dp in plan.devices.items()}
    return {"pipeline": plan.pipeline, "fits": plan.fits, "workload": plan.workload, "devices": devices,
            "stages": stages, "errors": [str(e) for e in plan.errors], "planning_seconds": round(plan.seconds, 4)}
