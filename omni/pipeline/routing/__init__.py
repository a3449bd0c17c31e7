"""Replica choice in the driver: which replica of a stage serves a request.

    policy.py   Router: one stage's policy (prefix affinity, least loaded, round robin)
    table.py    PipelineRouting: the orchestrator's table (a Router per stage, each request's lineage)
    keys.py     block-hash keys of a request, computed in the driver with the stages' own hashing

Plain Python: no Ray, no torch (an import-linter contract checks it).
"""
