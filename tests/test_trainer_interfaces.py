"""The trainer's helpers read a run through the narrow interface each declares (a Protocol of exactly what it reads
and calls), never ``Any`` and never the trainer's underscore members."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1] / "portrl" / "trainer"
HELPERS = ("value_pretrain.py", "prime_phase.py", "reference_update.py", "divergence.py", "run_end.py",
           "run_checkpoints.py")


@pytest.mark.parametrize("name", HELPERS)
def test_a_helper_reads_no_private_member_and_types_its_trainer(name):
    tree = ast.parse((TRAINER / name).read_text())
    private = [f"{node.value.id}.{node.attr} (line {node.lineno})" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "trainer" and node.attr.startswith("_")]
    assert not private, f"{name} reaches into the trainer: {private}"
    untyped = [f"{fn.name} (line {fn.lineno})" for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
               for arg in fn.args.args if arg.arg == "trainer"
               and (arg.annotation is None or ast.unparse(arg.annotation) == "Any")]
    assert not untyped, f"{name}: a trainer parameter without its interface: {untyped}"


def test_the_trainer_has_what_the_interfaces_name():
    """Every attribute and method a helper's Protocol names is one RLTrainer sets or defines (a renamed member of
    the trainer fails here, not in the middle of a run)."""
    import portrl.trainer.divergence as divergence
    import portrl.trainer.prime_phase as prime_phase
    import portrl.trainer.reference_update as reference_update
    import portrl.trainer.run_checkpoints as run_checkpoints
    import portrl.trainer.run_end as run_end

    source = (TRAINER / "rl_trainer.py").read_text()
    tree = ast.parse(source)
    members = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
               for t in (t.elts if isinstance(t, ast.Tuple) else [t])
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RLTrainer")
    members |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for proto in (divergence.TrainedRoles, prime_phase.PolicyRun, reference_update.ReferenceRun,
                  run_checkpoints.CheckpointedRun, run_end.EndingRun):
        named = set(proto.__annotations__) | {k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")}
        assert named and named <= members, f"{proto.__name__}: RLTrainer lacks {sorted(named - members)}"


def test_run_failure_needs_only_its_interface(tmp_path):
    """run_failure works on any object with the four members of EndingRun: no trainer, no private method."""
    from types import SimpleNamespace

    from portrl.config import compose
    from portrl.errors import RunStopped
    from portrl.trainer.checkpoint import CheckpointManager
    from portrl.trainer.run_end import run_failure

    class Run:
        cfg = compose(overrides=["trainer.total_steps=5", "trainer.resume=auto"])
        global_step = 2
        ckpt = CheckpointManager(tmp_path / "checkpoints")
        stopped = False

        def shutdown_workers(self) -> None:
            self.stopped = True

    run = Run()
    stop = SimpleNamespace(requested=True, name="SIGTERM", exit_code=143)
    err = run_failure(run, RuntimeError("a worker went away\nsecond line"), stop)
    assert isinstance(err, RunStopped) and err.exit_code == 143 and run.stopped
    assert str(err) == ("portrl: stopped by SIGTERM during step 3 of 5, which could not finish (a worker went away); "
                        "no checkpoint was written: rerun the same command to start again")
    assert run_failure(Run(), KeyError("internal"), None) is None  # an internal error stays itself
