"""How many steps each method needs to reach DDP's loss, relative to DDP: the convergence side of ``auto``'s judgement.

``STEPS_TO_TARGET[method]`` is the largest ratio, over the project's measured tables, of the steps the method took
to reach DDP's target held-out loss to the steps DDP took. The largest, so that ``auto`` never counts on a method
converging faster than it did on the task where it did worst. The tables, and the commands that wrote them:

- ``benchmarks/results/time_to_accuracy_cpu.json`` (tasks ``digits`` and ``charlm``, layouts 2x1 and 2x2; the
  target is DDP's held-out loss two thirds into its run, reached where the method's loss curve first crosses it),
  written by ``python benchmarks/convergence.py --timed --tasks digits charlm --methods ddp ddp_fp16 ddp_powersgd_r1
  ddp_powersgd_r4 ddp_powersgd_r8 ddp_powersgd_r16 bytegrad low_rank_r8 low_rank_r16 low_rank_alt_r8 --layouts 2x1
  2x2 --rates 100mbit 1gbit unshaped --rounds 5 --lab-steps 10`` and rescored with ``--render``;
- ``benchmarks/results/gpu_network_lab.md`` (a GPT-2-small language model on two GPUs; the target is DDP's
  validation loss at step 200 of 300, reached at the first evaluation under it), written by
  ``python benchmarks/gpu_network_lab.py`` (its header lists the runs).

``gradient_allreduce`` is DDP's arithmetic, so its factor is 1 by definition (the GPU table's 225 against DDP's 200
is the spread of one evaluation interval, not a difference in method). ``tests/engine/algorithms/test_auto.py``
recomputes every other factor from those files.
"""

STEPS_TO_TARGET: dict[str, float] = {
    "gradient_allreduce": 1.0,
    # digits: 127.7 against 127.4; charlm: 276.9 against 260; GPU: 200 against 200.
    "bytegrad": 1.065,
    # digits: 127.6 against 127.4; charlm: 281.0 against 260; GPU: 225 against 200.
    "low_rank_r16": 1.125,
    # GPU: 225 against 200 (not measured on CPU).
    "low_rank_r32": 1.125,
}
"""Steps to DDP's target loss per method, as a multiple of DDP's steps."""

LOW_RANK_MIN_RANK = 16
"""The smallest ``low_rank`` rank whose final loss was within 1% of DDP's at equal steps in every table."""


def steps_to_target(name: str, rank: int | None = None) -> float:
    """Return the steps-to-target factor of an algorithm, by registry name (and rank, for ``low_rank``).

    Args:
        name: the algorithm's registry name.
        rank: ``low_rank``'s rank; ranks between the measured ones take the next lower measured rank's factor.

    Returns:
        The factor.

    Raises:
        KeyError: the method was never measured to its target.
    """
    if name != "low_rank":
        return STEPS_TO_TARGET[name]
    if rank is None or rank < LOW_RANK_MIN_RANK:
        raise KeyError(f"low_rank at rank {rank} did not reach DDP's loss within 1% in the measured tables")
    measured = sorted(int(key.removeprefix("low_rank_r")) for key in STEPS_TO_TARGET if key.startswith("low_rank_r"))
    return STEPS_TO_TARGET[f"low_rank_r{max(r for r in measured if r <= rank)}"]
