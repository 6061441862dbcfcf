"""One case per algorithm for the scripts that run every algorithm through Lightning, and Lightning's DDP beside.

name: the algorithm's keywords (``None``: Lightning's own DDP). Each is the smallest setting that still runs the
algorithm's own path on two CPU processes in a few steps: flat where ``hierarchical`` would make one node's run a
full-precision all-reduce, and warm-ups of a step or none.
"""

from typing import Any

EVERY_ALGORITHM: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "gradient_allreduce": {},
    "bytegrad": {"hierarchical": False},
    "low_rank": {"hierarchical": False, "warmup_steps": 1},
    "qadam": {"hierarchical": False},
    "decentralized": {"hierarchical": False},
    "low_precision_decentralized": {"hierarchical": False},
    "async": {"sync_interval_ms": 5},
    "diloco": {"sync_every": 2, "hierarchical": False},
    "auto": {"trial_steps": 1, "max_trial_steps": 6},
}
