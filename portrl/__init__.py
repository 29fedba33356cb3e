"""portrl: RL post-training for language models on any accelerator, or the CPU.

Importing portrl does no work: no device runtime is initialised, no plugin is loaded.
"""

__version__ = "0.2.0"
