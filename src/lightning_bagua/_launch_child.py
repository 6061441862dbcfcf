"""Become the user's program in a child of ``lightning_bagua.launch``, with Bagua's environment completed.

torchrun gives each child ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and the
master address; Bagua's children also had ``NODE_RANK`` (torchrun's ``GROUP_RANK``, right after an elastic
restart too) and, on request, a ``--local_rank`` argument. This module adds them, then runs the script, module
or executable in this same process.
"""

import argparse
import os
import runpy
import sys

__all__ = ["main"]


def main() -> None:
    """Complete the environment and run the target given after ``--``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_bagua._launch_child")
    parser.add_argument("--set-local-rank-flag", action="store_true")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no-python", action="store_true")
    parser.add_argument("target")
    parser.add_argument("target_args", nargs=argparse.REMAINDER)
    argv = sys.argv[1:]
    if "--" in argv:
        argv.remove("--")
    args = parser.parse_args(argv)
    os.environ["NODE_RANK"] = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    extra = [f"--local_rank={os.environ['LOCAL_RANK']}"] if args.set_local_rank_flag else []
    target_argv = [args.target, *extra, *args.target_args]
    if args.no_python:
        os.execvp(args.target, target_argv)
    sys.argv = target_argv
    if args.module:
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)
    else:
        # The script's folder comes first on sys.path, as when it is run as `python script.py`.
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.target)))
        runpy.run_path(args.target, run_name="__main__")


if __name__ == "__main__":
    main()
