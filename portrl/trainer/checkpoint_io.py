"""The checkpoint file format: tensors in safetensors, everything else in JSON; loading never unpickles.

A checkpoint holds one file pair per state (``portrl/state_files.py``: ``save_state`` / ``load_state``):
``<name>.safetensors`` with every tensor under its dotted path and ``<name>.json`` with the tree. A state
trained by several FSDP2 workers is written sharded instead, one pair per rank with no gather
(``save_shard``: ``<name>/rank_<r>.safetensors`` + ``.json``, each sharded tensor's leaf saying where its rows
sit), and read back whole or for any number of ranks (``ShardedState``).

``FORMAT_VERSION`` is recorded in every manifest (``meta.format``); a checkpoint written before it
(``actor.pt`` / ``trainer.pt``, pickled) or by a newer format is refused with a message naming its version.
"""

from __future__ import annotations

from portrl.state_files import ShardedState, StateFormatError, is_sharded, load_state, save_shard, save_state

#: 1: safetensors + JSON (portrl 0.2.0), FSDP2 states sharded by rank. Before it: pickled ``*.pt`` files.
FORMAT_VERSION = 1
LEGACY_FILES = ("actor.pt", "critic.pt", "trainer.pt")

__all__ = ["FORMAT_VERSION", "LEGACY_FILES", "ShardedState", "StateFormatError", "is_sharded", "load_state",
           "save_shard", "save_state"]
