"""Vendor backends, installed as ``portrl.backends``. The only place vendor libraries are named.

Shared vendor code lives beside the per-vendor folders, in folders named for what it is
(``vllm/`` for the vLLM engine adapter, ``triton/`` for Triton kernels).
"""
