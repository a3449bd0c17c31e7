"""The Ray backend: one async actor per stage replica. With omni.serve.ray_serve, the only code of
omni that imports Ray (an import-linter contract checks it).

    actor.py        the stage actor's body (a StageWorker behind a step loop)
    client.py       RayBackend, the driver side: starting the actors, submissions, replica gating, failures
    cluster.py      connecting to / starting Ray, letting go of it, waiting for killed actors to die
    temp_reaper.py  removes an embedded Ray's temp dir when its driver dies without cleaning up
    failures.py     Ray's errors in one line

Nothing is imported here: `omni.pipeline.ray.temp_reaper` loads without Ray.
"""
