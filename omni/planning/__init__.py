"""One memory budget per device for the whole pipeline (`omni plan`).

    weights.py        a stage's weights from its safetensors headers (nothing loaded)
    needs.py          what one copy of a stage needs: fixed bytes + bytes per KV block
    profile.py        the measured part: a profile step's peak and the per-token outputs it reveals
    profile_store.py  measurements kept for the plans made without loading anything
    budget.py         the devices, their budgets, which copy lands where
    plan.py           the split, the verdict, MemoryPlanError, the planned config
    report.py         the plan as text

Imported by the CLI and the API only when a plan is asked for (it imports the stage model classes).
"""
