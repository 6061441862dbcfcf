"""The strategies' collectives take what Lightning's ``DDPStrategy`` takes and return what it returns.

Both the Trainer's and Fabric's ``BaguaStrategy`` run ``reduce``/``all_reduce``, ``all_gather``, ``broadcast`` and
``reduce_boolean_decision`` side by side with the ``DDPStrategy`` of the same package, on the same inputs, on two
Gloo processes. Whatever DDP accepts must be accepted, with an equal result (value, dtype, and whether the tensor
passed in is the one that comes back).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.distributed import run_processes

# What Lightning's DDP takes on Gloo: op names in any letter case ("mean" in lower case only) and ReduceOp members.
OPS: list[Any] = ["mean", "avg", "AVG", "Avg", "sum", "SUM", "Sum", "max", "MAX", "min", "Min", "product", "PRODUCT"]
OPS += [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
# Bitwise ops, for integer tensors only: Gloo fails them on floats in its worker, which breaks the group.
INTEGER_OPS: list[Any] = ["band", "BOR", "bxor", ReduceOp.BAND]
# Ours only (DDP raises): the mean in any letter case, None (lightning-bagua 0.1.0's default), ReduceOp.AVG on Gloo.
EXTRA_OPS: list[Any] = ["MEAN", None, ReduceOp.AVG]


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    return {
        "float": torch.tensor([rank + 1.5, -2.0 * rank]),
        "int": torch.tensor([rank + 2, 7 - rank]),
        "scalar": torch.tensor(rank + 3.0),
    }


def _outcome(call: Callable[..., Any], *args: Any, given: Any = None, **kwargs: Any) -> tuple:
    """What ``call(*args, **kwargs)`` returned, comparable across strategies: value, dtype, is it ``given``."""
    try:
        value = call(*args, **kwargs)
    except Exception as error:  # DDP refuses some inputs: recorded, and then ours may do as it likes
        return ("error", type(error).__name__)
    if isinstance(value, torch.Tensor):
        return ("ok", value.tolist(), str(value.dtype), value is given)
    return ("ok", value)


def _collectives(strategy: Any, reduce: Callable[..., Any], rank: int, group: Any, ops: list) -> dict[str, tuple]:
    results: dict[str, tuple] = {}
    for name, tensor in _inputs(rank).items():
        for op in [*ops, *(INTEGER_OPS if name == "int" else [])]:
            given = tensor.clone()
            results[f"reduce/{name}/{op}"] = _outcome(reduce, given, reduce_op=op, given=given)
            # Every rank must have left the collective (or refused the op) before the next one starts.
            dist.barrier()
        given = tensor.clone()
        results[f"reduce/{name}/group"] = _outcome(reduce, given, group=group, reduce_op="sum", given=given)
        results[f"reduce/{name}/default"] = _outcome(reduce, tensor.clone())
        for sync_grads in (False, True):
            results[f"all_gather/{name}/{sync_grads}"] = _outcome(
                strategy.all_gather, tensor.clone(), sync_grads=sync_grads
            )
        results[f"all_gather/{name}/group"] = _outcome(strategy.all_gather, tensor.clone(), group=group)
    results["reduce/not a tensor"] = _outcome(reduce, "text", reduce_op="SUM")
    for src in (0, 1):
        results[f"broadcast/object/{src}"] = _outcome(strategy.broadcast, {"from": rank, "list": [rank]}, src)
        results[f"broadcast/tensor/{src}"] = _outcome(strategy.broadcast, torch.tensor([rank]), src)
    for all_ranks in (True, False):
        for label, decision in (("true", True), ("false", False), ("rank 0 only", rank == 0)):
            results[f"decision/{label}/{all_ranks}"] = _outcome(
                strategy.reduce_boolean_decision, decision, all=all_ranks
            )
    return results


def _side_by_side(rank: int, world_size: int, framework: str) -> dict[str, dict[str, tuple]]:
    group = dist.new_group(ranks=list(range(world_size)))
    devices = [torch.device("cpu")]
    if framework == "trainer":
        from lightning.pytorch.strategies import DDPStrategy

        from lightning_bagua.strategies.bagua import BaguaStrategy

        ddp, ours = DDPStrategy(parallel_devices=devices), BaguaStrategy(parallel_devices=devices)
        return {
            "ddp": _collectives(ddp, ddp.reduce, rank, group, OPS),
            "bagua": _collectives(ours, ours.reduce, rank, group, [*OPS, *EXTRA_OPS]),
        }
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy

    fabric_ddp, fabric_ours = FabricDDPStrategy(parallel_devices=devices), FabricBaguaStrategy(parallel_devices=devices)
    return {
        "ddp": _collectives(fabric_ddp, fabric_ddp.all_reduce, rank, group, OPS),
        "bagua": _collectives(fabric_ours, fabric_ours.all_reduce, rank, group, [*OPS, *EXTRA_OPS]),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_collectives_accept_and_return_what_ddp_does(framework):
    results = run_processes(_side_by_side, 2, framework, timeout=200)
    for rank, result in enumerate(results):
        ddp, ours = result["ddp"], result["bagua"]
        # DDP takes every case given to both (so the comparison covers them all), and ours returns the same.
        assert [case for case, outcome in ddp.items() if outcome[0] != "ok"] == []
        for case, expected in ddp.items():
            assert ours[case] == expected, f"rank {rank}, {case}: bagua {ours[case]} != ddp {expected}"
        # Beyond DDP: the mean in any letter case, None (lightning-bagua 0.1.0's default) and ReduceOp.AVG on Gloo.
        for case in ("reduce/float/MEAN", "reduce/float/None", f"reduce/float/{ReduceOp.AVG}"):
            assert ours[case] == ("ok", [2.0, -1.0], "torch.float32", True), (case, ours[case])
