"""Float32 master weights for training in bfloat16 / float16.

A low-precision parameter cannot take a small update: AdamW's step is about ``lr`` per element, and a
bfloat16 weight of magnitude ``|w|`` only changes when the step exceeds half its spacing, ``|w| * 2**-8``.
At ``lr = 1e-6`` and ``|w| ~ 0.02`` that is 78x too small, so an optimizer that updates bfloat16 parameters
in place leaves almost every weight where it was. Mixed precision keeps two copies (as FSDP's
``MixedPrecisionPolicy`` and DeepSpeed's bf16 optimizer do)::

    forward / backward     on the model's parameters p (bfloat16: the compute copy)
    master.grad  = float32(p.grad)
    AdamW.step() on master (float32 weights, float32 moments)
    p            = round_to_bfloat16(master)

Parameters already in float32 are their own masters (no copy, no cost). Under FSDP2 the module is kept in
float32 and ``fully_shard``'s ``MixedPrecisionPolicy`` casts for compute instead
(``portrl.workers.parallel.wrap_model``), so :class:`MasterWeights` then has nothing to do.
"""

from __future__ import annotations

from typing import List, Mapping, Union

import torch

from portrl.workers.parallel import frozen_parameter_names, full_train_state, load_full_train_state, require_trainable

LOW_PRECISION = (torch.bfloat16, torch.float16)


def load_dtype(compute_dtype: str) -> str:
    """The dtype a worker loads its trained model in: float32 when computing in bfloat16 / float16, so that
    the masters start from the checkpoint's full-precision values (then :class:`MasterWeights` casts the
    module, or, under FSDP2, ``fully_shard``'s mixed precision policy casts for compute)."""
    return "float32" if compute_dtype in ("bfloat16", "float16") else compute_dtype


class MasterWeights:
    """The trainable parameters of a module and their float32 masters (``masters[i]`` is ``params[i]`` itself
    when that parameter computes in float32). Build the optimizer over :attr:`masters`.

    ``compute_dtype`` (bfloat16 / float16): the module was loaded in float32; the masters are copies of those
    full-precision values, then every floating parameter of the module is cast to ``compute_dtype`` in place
    (the Parameter objects stay; buffers such as rotary frequencies stay as they are). Without it, masters
    are taken from whatever precision the parameters already have.
    """

    def __init__(self, module: torch.nn.Module, compute_dtype: Union[str, torch.dtype, None] = None):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        compute = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
        self.names: List[str] = [n for n, _ in named]
        self.params: List[torch.nn.Parameter] = [p for _, p in named]
        if compute in LOW_PRECISION:
            self.masters: List[torch.Tensor] = [p.detach().float().clone().requires_grad_(True) for p in self.params]
            with torch.no_grad():
                for p in module.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(compute)
        else:
            self.masters = [p.detach().float().clone().requires_grad_(True) if p.dtype in LOW_PRECISION else p
                            for p in self.params]

    @property
    def active(self) -> bool:
        """True when at least one parameter has a separate float32 master."""
        return any(m is not p for m, p in zip(self.masters, self.params))

    def grads_to_masters(self) -> None:
        """``master.grad = float32(param.grad)`` (None stays None); the low-precision gradients are freed."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round every master into its compute parameter (after an optimizer step)."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    @torch.no_grad()
    def finite(self) -> bool:
        """Whether every trained weight is finite (checked before a checkpoint is written): the masters (what a
        checkpoint saves), one fused max-|w| per tensor (``torch._foreach_norm(masters, inf)``: NaN and inf
        propagate, huge finite values do not overflow) and one check over those norms. Under FSDP2 this rank's
        shards only (every rank checks its own)."""
        local = [m.to_local() if hasattr(m, "to_local") else m for m in self.masters]
        local = [t for t in local if t.numel() > 0]
        if not local:
            return True
        norms = torch._foreach_norm(local, float("inf"))
        return bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Masters from ``state`` (parameters missing from it are re-mastered from their compute copy, which a
        checkpoint written without masters restores), then rounded into the compute parameters."""
        for n, p, m in zip(self.names, self.params, self.masters):
            if m is p:
                continue
            m.copy_(state[n] if n in state else p.float())
        self.masters_to_params()


def train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, master: MasterWeights,
                sharded: bool = False) -> tuple:
    """``(model state, optimizer state)`` of a worker, in one format whatever the precision and strategy: model
    tensors keyed by parameter name at full precision (the float32 masters where there are some), optimizer
    state keyed by parameter name (``torch.distributed.checkpoint``'s full state dict layout), so a checkpoint
    loads into any number of workers and either precision path. Frozen parameters (a LoRA run's base model)
    are not part of it: every worker loads them from the model at start. Under FSDP2 a collective (every rank
    calls it); ``sharded``: under FSDP2, each rank's DTensor shards instead (nothing gathered; the layout of
    ``portrl.state_files.save_shard``)."""
    if not master.active:
        return full_train_state(module, optimizer, full=not sharded)
    masters = {id(p): m for p, m in zip(master.params, master.masters)}  # tied weights share one Parameter
    frozen = frozen_parameter_names(module)
    model_sd = {k: masters.get(id(v), v).detach().cpu() for k, v in module.state_dict(keep_vars=True).items()
                if k not in frozen}
    optim_sd = optimizer.state_dict()
    names = master.names
    state = {names[i]: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
             for i, s in optim_sd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]
    return model_sd, {"state": state, "param_groups": groups}


def load_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, master: MasterWeights,
                     model_sd: Mapping[str, torch.Tensor], optim_sd: Mapping, sharded: bool = False) -> None:
    """Load what :func:`train_state` returned (on any precision path and number of workers); ``sharded``: its
    FSDP2 shards (DTensors of this rank's rows)."""
    if not master.active:
        load_full_train_state(module, optimizer, dict(model_sd), dict(optim_sd), full=not sharded)
        return
    require_trainable(module, model_sd)
    # float32 tensors are rounded into the compute parameters; frozen ones absent from the state keep their values
    module.load_state_dict(model_sd, strict=False)
    master.load_state_dict(model_sd)
    index = {n: i for i, n in enumerate(master.names)}
    state = {index[n]: s for n, s in optim_sd.get("state", {}).items()}
    groups = [{**g, "params": [index[n] for n in g.get("params", ())]} for g in optim_sd.get("param_groups", [])]
    if not state:  # never stepped: copy the hyper-parameters only (the layout torch's loader would reject)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    optimizer.load_state_dict({"state": state, "param_groups": groups})
