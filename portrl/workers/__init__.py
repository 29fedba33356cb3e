"""Workers: what one process of a run holds and does.

``ActorRolloutWorker`` (policy, optimizer, rollout engine, reference), ``CriticWorker`` (value model),
``RolloutWorker`` (a separated rollout engine), the reward scorers, and ``WorkerGroup`` (the same worker
class in-process or as Ray actors, ``portrl.workers.group``). Modules are imported by name where they are
used; importing the package does no work.
"""
