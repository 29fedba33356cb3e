"""Workers: what one process of a run holds and does.

``ActorRolloutWorker`` (policy, optimizer, rollout engine, reference), ``CriticWorker`` (value model),
``RolloutWorker`` (a separated rollout engine), and ``WorkerGroup`` (the same worker class in-process or as Ray
actors, ``portrl.workers.group``; each worker class names the config sections it reads in ``config_sections``).
The actor and the critic train through one loop (``portrl.workers.update_loop``), each supplying its loss.
Modules are imported by name where they are used; importing the package does no work.
"""
