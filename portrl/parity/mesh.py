"""``portrl parity mesh``: GRPO steps under each device mesh give the one-rank results (CPU processes over gloo).

Each case (:data:`CASES`) runs :func:`portrl.parity.mesh_step.run_steps` in ``world`` processes (started by a
fork server that has imported torch and the models once, so a case pays for its model load, not for the
imports), and once in this process with no process group. Compared, per case:

* ``logp``: the whole batch's response log-probs of every step, max absolute difference <= :data:`LOGP_ATOL`;
* ``loss`` and ``grad_norm`` of every step, relative difference <= :data:`REL_TOL`;
* ``param_norms``: the norm of every parameter after the last step, difference <= :data:`REL_TOL` of
  ``max(norm, 1)``.

Why these bounds (float32): a mesh computes the same sums in another order (a row-parallel layer adds ``tp``
partial products, FSDP2 and the sequence gather add ``dp x sp`` gradient pieces, the vocabulary-parallel log-prob
combines ``tp`` partial softmax sums), and reordering a float32 sum of ``k`` terms moves it by about
``k * 2^-24`` of its magnitude. The tiny model's log-probs are ~5 in magnitude and its gradient sums have ~10^3
terms, so agreement is expected to ~1e-6 relative (measured: 5e-7 absolute on log-probs, <= 1e-6 on gradient
norms); 1e-5 leaves a decade of room while a wrong split (a head or token in the wrong place, a missing or doubled
gradient reduction) moves results by 1e-2 or more.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.multiprocessing as torch_mp

from portrl.models.tiny import write_tiny_model
from portrl.parity.mesh_step import MeshCase, rank_main, run_steps
from portrl.workers.parallel import find_free_port

#: the meshes CI checks (issue 60's list, plus Ulysses with fewer key/value heads than ranks, and LoRA adapters
#: split with their layers against LoRA on one rank); the two 4-rank meshes of the list train with gradient
#: checkpointing, as the actor does by default (the one-rank reference without: recomputation changes no value)
CASES = (MeshCase("tp2", 2, tp=2), MeshCase("sp2", 2, sp=2), MeshCase("tp2_fsdp2", 4, tp=2, checkpointing=True),
         MeshCase("sp2_fsdp2", 4, sp=2, checkpointing=True), MeshCase("sp4_gqa", 4, sp=4),
         MeshCase("tp2_fsdp2_lora", 4, tp=2, lora_rank=4))
LOGP_ATOL = 1e-5
REL_TOL = 1e-5
STEPS = 3


def case_named(names: Optional[Iterable[str]]) -> list[MeshCase]:
    """The cases named (all when None); an unknown name is a ValueError listing the valid ones."""
    if not names:
        return list(CASES)
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown mesh case {unknown[0]!r}; valid: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _scaled(a: float, b: float) -> float:
    """``|a - b| / max(|b|, 1)``: relative for a large norm, absolute for a small one (a bias that starts at 0
    and moves ~1e-3 a step: Adam's ``g / sqrt(v)`` turns float32 noise in a near-zero gradient into a full step's
    sign, so its relative change says nothing about the mesh)."""
    return abs(a - b) / max(abs(b), 1.0)


def compare(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The differences of one case's result from the one-rank result, and its verdict."""
    if set(result["param_norms"]) != set(ref["param_norms"]):
        return {"verdict": "fail", "error": "the parameters differ from the one-rank model's: "
                f"{sorted(set(result['param_norms']) ^ set(ref['param_norms']))[:3]}"}
    logp = max(abs(x - y) for s, t in zip(result["logp"], ref["logp"]) for r, q in zip(s, t) for x, y in zip(r, q))
    diffs = {
        "logp_max_abs": logp,
        "loss_max_rel": max(_rel(a, b) for a, b in zip(result["loss"], ref["loss"])),
        "grad_norm_max_rel": max(_rel(a, b) for a, b in zip(result["grad_norm"], ref["grad_norm"])),
        "param_norm_max_diff": max(_scaled(result["param_norms"][k], v) for k, v in ref["param_norms"].items()),
    }
    ok = diffs["logp_max_abs"] <= LOGP_ATOL and all(v <= REL_TOL for k, v in diffs.items() if k != "logp_max_abs")
    return {**diffs, "verdict": "pass" if ok else "fail"}


def _run_case(case: MeshCase, model_dir: str, work: Path, ctx: Any) -> dict[str, Any]:
    out = work / case.name
    out.mkdir()
    try:
        torch_mp.start_processes(rank_main, args=(case, model_dir, find_free_port(), str(out), STEPS),
                                 nprocs=case.world, start_method=ctx)
    except torch_mp.ProcessRaisedException:
        pass  # the rank's own message is in its .error file
    errors = sorted(out.glob("*.error"))
    if errors:
        raise RuntimeError(f"mesh case {case.name}: {errors[0].read_text()}")
    return json.loads((out / f"{case.name}.json").read_text())


def run_mesh_parity(cases: Optional[Iterable[str]] = None, work_dir: Optional[str] = None) -> dict[str, Any]:
    """Run the named cases (all by default) against one rank; the report: ``{"cases": [...], "verdict"}``, each
    case with its mesh, its differences and its verdict, and the bounds."""
    chosen = case_named(cases)
    ctx = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if ctx == "forkserver":
        # the model's modeling module too: from_pretrained imports it lazily, ~5 s a rank on 2 cores
        multiprocessing.set_forkserver_preload(["portrl.parity.mesh_step", "transformers.models.qwen2.modeling_qwen2"])
    with tempfile.TemporaryDirectory(prefix="portrl-parity-mesh-", dir=work_dir) as tmp:
        work = Path(tmp)
        # 4 query heads over 2 key/value heads (GQA; sp=4 repeats them), vocabulary 112 (tp=2 splits it)
        model_dir = str(write_tiny_model(work / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
        refs = {r: run_steps(model_dir, None, 0, STEPS, lora_rank=r) for r in sorted({c.lora_rank for c in chosen})}
        rows = [{"case": case.name, "world": case.world, "tp": case.tp, "sp": case.sp, "fsdp_size": case.fsdp_size,
                 "lora_rank": case.lora_rank, **compare(_run_case(case, model_dir, work, ctx), refs[case.lora_rank])}
                for case in chosen]
    verdict = "pass" if all(r["verdict"] == "pass" for r in rows) else "fail"
    return {"tier": "mesh", "steps": STEPS, "bounds": {"logp_max_abs": LOGP_ATOL, "relative": REL_TOL},
            "cases": rows, "verdict": verdict}
