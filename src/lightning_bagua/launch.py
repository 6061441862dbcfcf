"""Start distributed training the way ``python -m bagua.distributed.launch`` did, on torch's elastic agent.

Run it on every node::

    python -m lightning_bagua.launch --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr node0 train.py

It accepts the flags of Bagua's launcher and hands the work to ``torch.distributed.run`` (torchrun): static
rendezvous with ``--master_addr``/``--master_port``, or elastic with ``--rdzv_backend``/``--rdzv_endpoint`` and
``--max_restarts``. Each child gets ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``BAGUA_SERVICE_PORT``, so
:class:`~lightning_bagua.environments.bagua.BaguaEnvironment` is selected.

What became of Bagua's other flags:

- ``--default_bucket_size`` (bytes) sets ``BAGUA_DEFAULT_BUCKET_SIZE``, the engine's default bucket size.
- ``--enable_bagua_net`` asks NCCL for several sockets and threads per connection (``NCCL_SOCKET_NTHREADS``,
  ``NCCL_NSOCKS_PERTHREAD``), what Bagua-Net provided, unless those variables are set already.
- ``--autotune_level 1`` sets ``BAGUA_AUTOTUNE=1``: a :class:`~lightning_bagua.BaguaStrategy` built without an
  explicit ``autotune`` tunes the bucket size during the first steps (see the autotuning docs); ``0`` (the
  default) leaves the variable alone. Other levels are refused.
- ``--is_output_autotune_log``, ``--autotune_max_samples``, ``--autotune_sampling_confidence_time``,
  ``--autotune_warmup_time`` and ``--report_metrics`` are accepted; a non-default value is reported once as
  having no effect in this release.
- ``--host_list`` and ``--ssh_port`` (Bagua's ssh fan-out) are accepted with a warning: start the launcher on
  each host yourself, or through your scheduler.
"""

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "child_environment", "main", "torchrun_arguments"]

log = logging.getLogger(__name__)

_NCCL_MULTI_SOCKET = {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
# Flags kept for compatibility, with the value at which they do nothing.
_WITHOUT_EFFECT = {
    "is_output_autotune_log": False,
    "autotune_max_samples": 60,
    "autotune_sampling_confidence_time": 5.0,
    "autotune_warmup_time": 30.0,
    "report_metrics": False,
}


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for Bagua's launcher flags plus torch's elastic options."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_bagua.launch",
        description="Start one process per device on this node, for distributed training with lightning-bagua.",
    )
    add = parser.add_argument
    add("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic training (default: 1)")
    add("--node_rank", type=int, default=0, help="this node's rank, for static rendezvous (default: 0)")
    add("--nproc_per_node", type=int, default=1, help="processes on this node, one per device (default: 1)")
    add("--master_addr", default="127.0.0.1", help="address of node 0 (default: 127.0.0.1)")
    add("--master_port", type=int, default=29500, help="free port on node 0 (default: 29500)")
    add("--bagua_service_port", type=int, default=29501, help="passed to the children as BAGUA_SERVICE_PORT")
    add("--set_additional_flag", action="store_true", help="pass --local_rank=<local rank> to the script")
    add("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    add("--no_python", action="store_true", help="run the script as an executable, not with python")
    add("--logdir", default=None, help="write each process's output under this folder")
    add(
        "--default_bucket_size",
        type=int,
        default=None,
        help="gradient bucket size in bytes (default: the engine's, 100 MiB on CUDA and 10 MiB elsewhere)",
    )
    add("--enable_bagua_net", action="store_true", help="several sockets and threads per NCCL connection")
    add("--autotune_level", type=int, default=0, help="1: tune the bucket size in the first steps (BAGUA_AUTOTUNE=1)")
    add("--is_output_autotune_log", action="store_true", help="accepted; no effect in this release")
    add("--autotune_max_samples", type=int, default=60, help="accepted; no effect in this release")
    add("--autotune_sampling_confidence_time", type=float, default=5.0, help="accepted; no effect")
    add("--autotune_warmup_time", type=float, default=30.0, help="accepted; no effect in this release")
    add("--report_metrics", action="store_true", help="accepted; no effect in this release")
    add("--host_list", default=None, help="accepted; start the launcher on each host instead")
    add("--ssh_port", type=int, default=None, help="accepted; start the launcher on each host instead")
    add("--max_restarts", type=int, default=0, help="restart the worker group this many times after a failure")
    add("--rdzv_backend", default=None, help="elastic rendezvous backend, e.g. c10d (default: static)")
    add("--rdzv_endpoint", default=None, help="elastic rendezvous endpoint host:port")
    add("--rdzv_id", default=None, help="elastic rendezvous id, the same on every node")
    add("training_script", help="the script (or module, or executable) to run")
    add("training_script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def torchrun_arguments(args: argparse.Namespace) -> list[str]:
    """Translate parsed launcher flags into ``torch.distributed.run`` arguments.

    Args:
        args: what :func:`build_parser` parsed.

    Returns:
        The argument list for torchrun, ending with the child wrapper and the user's script and arguments.
    """
    torchrun = [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
    ]
    if args.rdzv_backend is None:
        torchrun += [f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}"]
        torchrun += [f"--master-port={args.master_port}"]
    else:
        torchrun += [f"--rdzv-backend={args.rdzv_backend}"]
        torchrun += [f"--rdzv-endpoint={args.rdzv_endpoint or f'{args.master_addr}:{args.master_port}'}"]
        torchrun += [f"--rdzv-id={args.rdzv_id or 'lightning-bagua'}"]
    if args.logdir:
        torchrun += [f"--log-dir={args.logdir}", "--redirects=3"]
    # Every child starts in the wrapper, which completes the environment and then becomes the user's program.
    child = ["-m", "lightning_bagua._launch_child"]
    if args.set_additional_flag:
        child.append("--set-local-rank-flag")
    if args.module:
        child.append("--module")
    if args.no_python:
        child.append("--no-python")
    return [*torchrun, *child, "--", args.training_script, *args.training_script_args]


def child_environment(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Return the variables the launcher adds to its children's environment.

    Args:
        args: what :func:`build_parser` parsed.
        environ: the current environment (``os.environ`` when ``None``), to keep variables the user set.

    Returns:
        Variable names and values to set.
    """
    environ = dict(os.environ if environ is None else environ)
    added = {"BAGUA_SERVICE_PORT": str(args.bagua_service_port)}
    if args.default_bucket_size is not None:
        added["BAGUA_DEFAULT_BUCKET_SIZE"] = str(args.default_bucket_size)
    if args.autotune_level == 1:
        added["BAGUA_AUTOTUNE"] = "1"
    if args.enable_bagua_net:
        added.update({name: value for name, value in _NCCL_MULTI_SOCKET.items() if name not in environ})
    return added


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the flags, prepare the environment and run torch's elastic agent (exits with its status).

    Args:
        argv: the arguments without the program name; ``sys.argv[1:]`` when ``None``.
    """
    args = build_parser().parse_args(argv)
    _check(args)
    _report_flags_without_effect(args)
    os.environ.update(child_environment(args))
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_arguments(args))


def _check(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise SystemExit(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}.")
    if args.module and args.no_python:
        raise SystemExit("--module and --no_python exclude each other: choose how the script is run.")
    if args.autotune_level not in (0, 1):
        raise SystemExit(
            f"--autotune_level must be 0 (off) or 1 (tune the bucket size during the first steps), got"
            f" {args.autotune_level}."
        )
    nodes = args.nnodes.split(":")
    if not all(part.isdigit() and int(part) >= 1 for part in nodes) or len(nodes) > 2 or int(nodes[0]) > int(nodes[-1]):
        raise SystemExit(
            f"--nnodes must be a positive number of nodes, or MIN:MAX with MIN <= MAX, got {args.nnodes!r}."
        )
    if args.rdzv_backend is None:
        # The static rendezvous cannot admit nodes as they come: torch's agent would wait without a word.
        if len(nodes) == 2:
            raise SystemExit(
                f"--nnodes {args.nnodes} asks for an elastic job, which needs a rendezvous nodes can join at any time:"
                " add --rdzv_backend c10d (with --rdzv_endpoint HOST:PORT of one node, master_addr:master_port by"
                " default), or give one number of nodes."
            )
        given = [flag for flag in ("rdzv_endpoint", "rdzv_id") if getattr(args, flag) is not None]
        if given:
            verb = "takes" if len(given) == 1 else "take"
            raise SystemExit(
                f"--{' and --'.join(given)} {verb} effect only with --rdzv_backend: add --rdzv_backend c10d, or drop"
                " them and name node 0 with --master_addr and --master_port."
            )
    for flag in ("master_port", "bagua_service_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            raise SystemExit(f"--{flag} must be a port number from 0 to 65535, got {getattr(args, flag)}.")
    if args.max_restarts < 0:
        raise SystemExit(f"--max_restarts must be 0 or more restarts after a failure, got {args.max_restarts}.")
    if len(nodes) == 1 and args.rdzv_backend is None and not 0 <= args.node_rank < int(nodes[0]):
        # Static rendezvous would wait (15 minutes) for a node rank that can never join.
        raise SystemExit(
            f"--node_rank must be in [0, {int(nodes[0])}) for --nnodes {nodes[0]}, got {args.node_rank}. Number the"
            " nodes 0 to nnodes - 1, one launcher each."
        )
    if args.default_bucket_size is not None and args.default_bucket_size <= 0:
        raise SystemExit(f"--default_bucket_size must be a positive number of bytes, got {args.default_bucket_size}.")
    _check_target(args)


def _check_target(args: argparse.Namespace) -> None:
    # torchrun starts the workers first and each one fails on its own: a typo would read as a crashed job.
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None:
            raise SystemExit(
                f"--no_python runs {script!r} as an executable, but it is neither on PATH nor an executable file:"
                " give its path, or drop --no_python to run a Python script."
            )
    elif not args.module and not os.path.isfile(script):
        raise SystemExit(
            f"The training script {script!r} does not exist (looked from {os.getcwd()}): give the path of a Python"
            " file, or pass -m to run a module."
        )


def _report_flags_without_effect(args: argparse.Namespace) -> None:
    changed = [name for name, default in _WITHOUT_EFFECT.items() if getattr(args, name) != default]
    if changed:
        flags = ", ".join(f"--{name}" for name in changed)
        has, are = ("has", "is") if len(changed) == 1 else ("have", "are")
        print(f"lightning_bagua.launch: {flags} {has} no effect in this release and {are} ignored.", file=sys.stderr)
    if args.host_list or args.ssh_port is not None:
        print(
            "lightning_bagua.launch: --host_list/--ssh_port are ignored; start the launcher on each host"
            " (with its --node_rank) yourself or through your scheduler.",
            file=sys.stderr,
        )
    if args.enable_bagua_net:
        print("lightning_bagua.launch: --enable_bagua_net: NCCL uses several sockets per connection.", file=sys.stderr)


if __name__ == "__main__":
    main()
