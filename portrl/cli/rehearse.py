"""``portrl rehearse [--device D] [--preset P] [--config FILE] [key=value ...]``: a cluster run's meshes and
placement rehearsed here, as CPU processes over gloo (portrl.trainer.rehearsal), before cluster time is spent.

Give it the cluster run's own command line (its preset, config file and overrides, ``trainer.num_workers`` the
cluster's ranks). The config is composed and checked as ``portrl train`` would check it for the cluster's device,
then one RL step runs with the same meshes on a shrunk model. Exit status: 0 when every phase ran, 2 for bad input
(one line, before anything starts), 1 when a phase failed (its first error in one line).
"""

from __future__ import annotations

from portrl.cli.run_options import add_run_arguments, compose_from, options_parser, parse_run_options

PROG = "portrl rehearse"

REST_AFTER = 0  # everything after the command is parsed by this module


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Rehearse a cluster run's meshes and placement on this machine "
                                                  "(CPU processes over gloo, a shrunk model of the same family)."),
                             args.rest)
    cfg = compose_from(opts)  # the cluster's device is not checked against this machine: it is not the cluster
    from portrl.config.checks_mesh import mesh_roles, mesh_sizes  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.device import get_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.mesh_check import check_meshes  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.rehearsal import cluster_world, run_rehearsal  # noqa: PLC0415  (CLI start-up: loaded by the command)

    cluster_world(cfg)
    check_meshes(cfg, get_backend(str(cfg.device.name)))  # the cluster's sizes against the real model's config.json
    for role in mesh_roles(cfg):
        tp, sp, fsdp = mesh_sizes(cfg, role)
        print(f"{role}: tensor_parallel_size={tp} sequence_parallel_size={sp} fsdp_size={fsdp}")
    report = run_rehearsal(cfg)
    meshes = ", ".join(f"{role} {'x'.join(map(str, sizes))}" for role, sizes in report["meshes"].items())
    print(f"rehearsal passed: {report['world']} ranks (dp_replicate x dp_shard x sp x tp: {meshes}), "
          f"{report['steps']} step with validation, checkpoint and export")
    return 0
