"""Multi-turn agentic rollouts: a trajectory alternates model turns and tool (or environment) turns, token in and
token out (the model's tokens are never decoded and re-encoded).

* :mod:`portrl.agent.trajectory`: what one trajectory returns and the meta keys it leaves in a rollout Batch;
* :mod:`portrl.agent.tools`: tools (OpenAI function schemas), the ``@tool`` decorator, the YAML tool config, the
  built-in tools (calculator, python on the code sandbox, BM25 search over a local corpus);
* :mod:`portrl.agent.parsers`: tool-call parsers per model family (``hermes`` first), a registry open to more;
* :mod:`portrl.agent.chat_delta`: the token ids the chat template adds for tool messages, and the strict check
  against a full-template tokenization;
* :mod:`portrl.agent.loop`: the agent loop, many trajectories at once on any rollout engine.

Engine-neutral: nothing here imports a vendor library; an engine is anything with ``generate``
(portrl/rollout/engine.py).
"""
