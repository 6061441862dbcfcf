"""Train with the Fabric BaguaStrategy (and, for comparison, the Trainer's) on two CPU processes; tests run this.

Run as ``python tests/strategies/scripts/fabric_script.py --out DIR --mode MODE[,MODE...]`` with the repository on
PYTHONPATH: the first ``Fabric(strategy="bagua", devices=2).launch()`` starts the second process, exactly as in a
user's script, and creates the process group every later Fabric and Trainer in the script joins. Each rank writes
``DIR/rank{r}.pt``.

Modes:

* ``compare``: for each case of ``--cases``, four optimizer steps through the Trainer strategy and through the
  Fabric strategy on the same data (the Trainer's shuffling ``DistributedSampler``, seed 0) from the same start.
* ``checkpoint``: train, ``fabric.save``, train on; then restore into a fresh model and optimizer with
  ``fabric.load`` and train on again, for a stateful test algorithm and for ``qadam`` in its compressed phase
  (whose 8-bit chunks follow the gradient buckets: the resumed wrapper replays the saved ones on its first step).
* ``setup``: module and optimizers set up apart in either order, the ``qadam`` optimizer check, ``all_reduce``,
  ``broadcast`` and ``teardown``.
* ``telemetry``: the strategy's ``telemetry`` flag on (``gradient_allreduce``, logged through a Fabric
  ``CSVLogger``; ``bytegrad``) and off, each step's record read after ``optimizer.step()``; then ``BAGUA_AUTOTUNE=1``
  tuning the bucket size over the first steps, against the same run with ``autotune=False``.
"""

import argparse
import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from tests.strategies.scripts.fit_script import BATCH, make_dataset, make_network, make_optimizer

STEPS = 4

# name: (algorithm, algorithm keywords, optimizer, batches per optimizer step)
CASES: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "gradient_allreduce": ("gradient_allreduce", {}, "sgd", 1),
    "gradient_allreduce_accumulate": ("gradient_allreduce", {}, "sgd", 3),
    "bytegrad": ("bytegrad", {"hierarchical": False}, "sgd", 1),
    "decentralized": ("decentralized", {"hierarchical": False}, "sgd", 1),
    "decentralized_shift_one": ("decentralized", {"hierarchical": False, "peer_selection_mode": "shift_one"}, "sgd", 1),
    "low_precision_decentralized": ("low_precision_decentralized", {"hierarchical": False}, "sgd", 1),
    "qadam": ("qadam", {"hierarchical": False}, "qadam", 1),
    "low_rank": ("low_rank", {"hierarchical": False, "warmup_steps": 1}, "sgd", 1),
    # Within its warm-up async all-reduces gradients; both strategies start it with the run and abort it at the end.
    "async_warmup": ("async", {"warmup_steps": STEPS}, "sgd", 1),
    # Figures given in place of measurements: the pick, made when the model is wrapped, is the same in both loops.
    "auto": ("auto", {"figures": "low_rank_wins"}, "sgd", 1),
    "diloco": ("diloco", {"sync_every": 2, "hierarchical": False, "quantization": "uint4"}, "sgd", 2),
}


def algorithm_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The case's keywords, with auto's named figures built (the engine's figures object is no command-line text)."""
    if kwargs.get("figures") != "low_rank_wins":
        return kwargs
    from lightning_bagua.engine import AutoFigures

    step_ms = {
        "gradient_allreduce": 10.0,
        "bytegrad(hierarchical=False)": 9.0,
        "low_rank(rank=16, hierarchical=False)": 5.0,
    }
    return {**kwargs, "figures": AutoFigures(step_s={label: ms / 1e3 for label, ms in step_ms.items()})}


def build_optimizer(kind: str, parameters) -> torch.optim.Optimizer:
    if kind == "qadam":
        from lightning_bagua import QAdamOptimizer

        return QAdamOptimizer(parameters, lr=0.01, warmup_steps=2)
    return make_optimizer(parameters)


def rank_loader(world_size: int, rank: int) -> DataLoader:
    # What Lightning's Trainer deals a rank: a shuffling DistributedSampler with seed 0.
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def fabric_strategy(algorithm, **kwargs):
    from lightning_bagua.strategies.fabric import BaguaStrategy

    return BaguaStrategy(algorithm=algorithm, **kwargs)


def new_fabric(strategy, loggers=None):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, loggers=loggers)
    fabric.launch()  # joins the process group the first Fabric created
    return fabric


def train_steps(fabric, model, optimizer, batches, steps: int, accumulate: int = 1) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        for index in range(accumulate):
            inputs, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=index < accumulate - 1):
                loss = nn.functional.mse_loss(model(inputs), targets)
                fabric.backward(loss / accumulate)
        optimizer.step()


class Steps:
    """Several optimizers stepped as one, for :func:`train_steps`."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def cpu_state(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


# --------------------------------------------------------------------------------------------------------- compare


def run_trainer(algorithm: str, kwargs: dict[str, Any], optimizer_kind: str, accumulate: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_bagua.strategies.bagua import BaguaStrategy

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network()

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self):
            return build_optimizer(optimizer_kind, self.parameters())

    seen: dict[str, Any] = {}

    class RunLength(pl.Callback):
        """What auto was told of the run's length, as training starts."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["run_steps"] = getattr(trainer.strategy.model.bagua_algorithm_impl, "run_steps", None)

    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=BaguaStrategy(algorithm=algorithm, **algorithm_keywords(kwargs)),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[RunLength()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_dataset(), batch_size=BATCH, shuffle=False))
    decision = trainer.strategy.auto_decision
    return {
        "state": cpu_state(model),
        "bytes_by_op": trainer.strategy.communication_counter.bytes_by_op,
        "auto_pick": None if decision is None else decision.label,
        "auto_run_steps": seen.get("run_steps"),
    }


def run_fabric(algorithm: str, kwargs: dict[str, Any], optimizer_kind: str, accumulate: int) -> dict[str, Any]:
    fabric = new_fabric(fabric_strategy(algorithm, **algorithm_keywords(kwargs)))
    network = make_network()
    model, optimizer = fabric.setup(network, build_optimizer(optimizer_kind, network.parameters()))
    batches = iter(
        fabric.setup_dataloaders(rank_loader(fabric.world_size, fabric.global_rank), use_distributed_sampler=False)
    )
    train_steps(fabric, model, optimizer, batches, STEPS, accumulate)
    result = {
        "state": cpu_state(network, prefix="net."),
        "bytes_by_op": fabric.strategy.communication_counter.bytes_by_op,
        "wrapped": type(model._forward_module).__name__,
    }
    fabric.strategy.teardown()
    decision = fabric.strategy.auto_decision
    result["auto_pick"] = None if decision is None else decision.label
    return result


def compare(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for name in args.cases.split(","):
        algorithm, kwargs, optimizer_kind, accumulate = CASES[name]
        results[name] = {
            "trainer": run_trainer(algorithm, kwargs, optimizer_kind, accumulate),
            "fabric": run_fabric(algorithm, kwargs, optimizer_kind, accumulate),
        }
    return results


# ------------------------------------------------------------------------------------------------------ checkpoint


def counting_algorithm():
    """gradient_allreduce whose bound implementation counts training forward passes: state to carry in a checkpoint."""
    from lightning_bagua.engine.algorithms.gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceImpl

    class CountingImpl(GradientAllReduceImpl):
        forwards = 0

        def on_forward_start(self, synchronizing: bool) -> None:
            self.forwards += 1

        def state_dict(self) -> dict[str, Any]:
            return {"forwards": self.forwards, "rank": torch.distributed.get_rank()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            assert state["rank"] == torch.distributed.get_rank(), "a rank was handed another rank's state"
            self.forwards = state["forwards"]

    class CountingAlgorithm(GradientAllReduceAlgorithm):
        def reify(self, context):
            return CountingImpl(self, context)

    return CountingAlgorithm()


def checkpoint_round_trip(fabric, optimizer_kind: str, path: Path) -> dict[str, Any]:
    loader = rank_loader(fabric.world_size, fabric.global_rank)
    network = make_network()
    model, optimizer = fabric.setup(network, build_optimizer(optimizer_kind, network.parameters()))
    batches = iter(loader)
    train_steps(fabric, model, optimizer, batches, 2)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    saved_algorithm_state = model._forward_module.bagua_state_dict()
    saved_model, saved_optimizer = cpu_state(network), copy.deepcopy(optimizer.optimizer.state_dict())
    train_steps(fabric, model, optimizer, batches, 2)
    continued = cpu_state(network)

    restored_network = make_network()
    with torch.no_grad():  # a different start, so that only a working load can make the runs agree
        for parameter in restored_network.parameters():
            parameter.add_(0.5)
    restored_model, restored_optimizer = fabric.setup(
        restored_network, build_optimizer(optimizer_kind, restored_network.parameters())
    )
    state = {"model": restored_model, "optimizer": restored_optimizer, "step": 0}
    remainder = fabric.load(path, state)
    loaded_algorithm_state = restored_model._forward_module.bagua_state_dict()
    loaded_model, loaded_optimizer = (
        cpu_state(restored_network),
        copy.deepcopy(restored_optimizer.optimizer.state_dict()),
    )
    batches = iter(loader)
    for _ in range(2):  # the batches the first run consumed before saving
        next(batches)
    train_steps(fabric, restored_model, restored_optimizer, batches, 2)
    return {
        "resumed_bytes_by_op": restored_model._forward_module.communication_counter.bytes_by_op,
        "continued": continued,
        "resumed": cpu_state(restored_network),
        "step": state["step"],
        "remainder": sorted(remainder),
        "saved": {"model": saved_model, "optimizer": saved_optimizer, "algorithm": saved_algorithm_state},
        "loaded": {"model": loaded_model, "optimizer": loaded_optimizer, "algorithm": loaded_algorithm_state},
        "final_algorithm_states": [
            model._forward_module.bagua_state_dict(),
            restored_model._forward_module.bagua_state_dict(),
        ],
    }


def checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    fabric = new_fabric(fabric_strategy(counting_algorithm()))
    results = {"counting": checkpoint_round_trip(fabric, "sgd", out / "counting.ckpt")}
    fabric.strategy.teardown()
    fabric = new_fabric(fabric_strategy("qadam", hierarchical=False))
    results["qadam"] = checkpoint_round_trip(fabric, "qadam", out / "qadam.ckpt")
    fabric.strategy.teardown()
    return results


# ----------------------------------------------------------------------------------------------------------- setup


def setup_checks(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    fabric = new_fabric(fabric_strategy("low_precision_decentralized", hierarchical=False))
    # Module first, then its optimizer.
    network = make_network()
    model = fabric.setup_module(network)
    optimizer = fabric.setup_optimizers(make_optimizer(network.parameters()))
    results["module_first_bound"] = model._forward_module.bagua_optimizers == [optimizer.optimizer]
    train_steps(fabric, model, optimizer, iter(rank_loader(2, fabric.global_rank)), STEPS)
    results["module_first"] = cpu_state(network, prefix="net.")
    kept = [model]  # the strategy holds its modules weakly: teardown closes the ones still in use
    # Optimizer first, then the module it updates.
    network = make_network()
    optimizer = fabric.setup_optimizers(make_optimizer(network.parameters()))
    model = fabric.setup_module(network)
    results["optimizer_first_bound"] = model._forward_module.bagua_optimizers == [optimizer.optimizer]
    train_steps(fabric, model, optimizer, iter(rank_loader(2, fabric.global_rank)), STEPS)
    results["optimizer_first"] = cpu_state(network, prefix="net.")
    kept.append(model)
    # Two optimizers over disjoint halves, set up with the module or after it: bound once both are there (the
    # algorithm refuses optimizers that leave parameters out).
    for way in ("two_together", "two_apart"):
        network = make_network()
        parameters = list(network.parameters())
        optimizers = [make_optimizer(parameters[:2]), make_optimizer(parameters[2:])]
        if way == "two_together":
            model, *optimizers = fabric.setup(network, *optimizers)
        else:
            model = fabric.setup_module(network)
            optimizers = fabric.setup_optimizers(*optimizers)
        train_steps(fabric, model, Steps(optimizers), iter(rank_loader(2, fabric.global_rank)), STEPS)
        results[f"{way}_bound"] = len(model._forward_module.bagua_optimizers)
        results[way] = cpu_state(network, prefix="net.")
        kept.append(model)
    # One of the two never set up: the first forward pass names the parameters no optimizer updates.
    network = make_network()
    model = fabric.setup_module(network)
    half = fabric.setup_optimizers(make_optimizer(list(network.parameters())[:2]))  # noqa: F841 - held weakly
    try:
        model(next(iter(rank_loader(2, fabric.global_rank)))[0])
    except ValueError as error:
        results["one_of_two_error"] = str(error)
    kept.append(model)
    # Together.
    network = make_network()
    model, optimizer = fabric.setup(network, make_optimizer(network.parameters()))
    train_steps(fabric, model, optimizer, iter(rank_loader(2, fabric.global_rank)), STEPS)
    results["together"] = cpu_state(network, prefix="net.")

    engines = fabric.strategy.bagua_modules
    assert engines == [module._forward_module for module in [*kept, model]]
    fabric.strategy.teardown()
    results["after_teardown"] = {
        "modules": len(fabric.strategy.bagua_modules),
        "closed": [engine._bagua_closed for engine in engines],
    }

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    fabric = new_fabric(fabric_strategy("qadam", hierarchical=False))
    errors = {}
    network = make_network()
    try:
        fabric.setup(network, make_optimizer(network.parameters()))
    except MisconfigurationException as error:
        errors["together"] = str(error)
    network = make_network()
    model = fabric.setup_module(network)
    try:
        fabric.setup_optimizers(make_optimizer(network.parameters()))
    except MisconfigurationException as error:
        errors["apart"] = str(error)
    results["qadam_errors"] = errors
    fabric.strategy.teardown()

    rank = fabric.global_rank
    results["all_reduce"] = {
        str(op): fabric.all_reduce(torch.tensor([float(rank + 1)]), reduce_op=op).item()
        for op in [None, "mean", "avg", "sum", "max", "min", "product"]
    }
    in_place = torch.tensor([float(rank + 1)])
    fabric.all_reduce(in_place, reduce_op="sum")
    results["all_reduce_in_place"] = in_place.item()
    results["all_reduce_int_mean"] = fabric.all_reduce(torch.tensor([rank + 2])).tolist()
    results["broadcast"] = fabric.broadcast({"from": rank}, src=1)
    fabric.barrier()
    return results


# ------------------------------------------------------------------------------------------ telemetry, autotune


def endless_batches(world_size: int, rank: int) -> Iterator[Any]:
    # Autotuning takes more steps than an epoch has; each epoch reshuffles, as the Trainer's sampler does.
    loader = rank_loader(world_size, rank)
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def telemetry_run(algorithm: str, steps: int, loggers=None, compiled: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Train with the Fabric strategy, reading (and logging, if a logger is given) the telemetry after each step.

    ``compiled`` passes the network through ``torch.compile`` (eager backend) before ``fabric.setup``, which
    compiles the wrapper in turn.
    """
    from lightning_bagua.engine import telemetry as telemetry_module

    clock_reads = 0
    clock = telemetry_module._clock

    def counting_clock() -> float:
        nonlocal clock_reads
        clock_reads += 1
        return clock()

    telemetry_module._clock = counting_clock
    fabric = new_fabric(fabric_strategy(algorithm, **kwargs), loggers=loggers)
    strategy = fabric.strategy
    network = make_network()
    model, optimizer = fabric.setup(
        torch.compile(network, backend="eager") if compiled else network, make_optimizer(network.parameters())
    )

    def called_wrapper() -> Any:
        return model._forward_module._orig_mod if compiled else model._forward_module

    batches = endless_batches(fabric.world_size, fabric.global_rank)
    records, metrics, wrappers = [], [], []
    for step in range(steps):
        wrappers.append(id(called_wrapper()))
        train_steps(fabric, model, optimizer, batches, 1)
        records.append(None if strategy.telemetry is None else strategy.telemetry.last_step)
        metrics.append(strategy.telemetry_metrics)
        fabric.log_dict(strategy.telemetry_metrics, step=step)
    telemetry_module._clock = clock
    tuner = strategy.autotuner
    result = {
        "state": cpu_state(network, prefix="net."),
        "records": records,
        "metrics": metrics,
        "telemetry_is_none": strategy.telemetry is None,
        "clock_reads": clock_reads,
        "bytes_by_op": strategy.communication_counter.bytes_by_op,
        "wrappers": len(set(wrappers)),
        "calls_current_wrapper": called_wrapper() is strategy.bagua_modules[0],
        "bucket_cap_mb": called_wrapper().bucket_cap_mb,
        "decision": None if tuner is None else tuner.decision,
        "measurements": None if tuner is None else tuner.measurements,
        "steps_needed": None if tuner is None else tuner.steps_needed,
        "stopped_noting_holders": strategy._autotuning._hook is None,
    }
    for logger in fabric.loggers:
        logger.finalize("success")
    strategy.teardown()
    return result


def telemetry_checks(args: argparse.Namespace) -> dict[str, Any]:
    from lightning.fabric.loggers import CSVLogger

    from lightning_bagua.engine.autotune import DEFAULT_BUCKET_SIZES_MB

    logger = CSVLogger(Path(args.out) / "csv", name="gradient_allreduce", version=0)
    results = {
        "telemetry": {
            "gradient_allreduce": telemetry_run("gradient_allreduce", STEPS, loggers=[logger], telemetry=True),
            "bytegrad": telemetry_run("bytegrad", STEPS, telemetry=True, hierarchical=False),
        },
        "telemetry_off": telemetry_run("bytegrad", STEPS, hierarchical=False),
    }
    # Every default candidate (one warm-up and three timed steps each), then two steps with the choice.
    steps = len(DEFAULT_BUCKET_SIZES_MB) * 4 + 2
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    autotune_log = logging.getLogger("lightning_bagua.engine.autotune")
    autotune_log.addHandler(handler)
    autotune_log.setLevel(logging.INFO)
    os.environ["BAGUA_AUTOTUNE"] = "1"  # as the launcher's --autotune_level 1 sets it
    results["autotuned"] = telemetry_run("gradient_allreduce", steps, telemetry=True)
    del os.environ["BAGUA_AUTOTUNE"]
    autotune_log.removeHandler(handler)
    results["autotuned"]["log"] = messages
    results["autotuned_compiled"] = telemetry_run(
        "gradient_allreduce", steps, compiled=True, telemetry=True, autotune=True
    )
    results["untuned"] = telemetry_run("gradient_allreduce", steps, telemetry=True, autotune=False)
    return results


MODES = {"compare": compare, "checkpoint": checkpoint, "setup": setup_checks, "telemetry": telemetry_checks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--mode", required=True, help="compare, checkpoint, setup or telemetry; several, comma-separated"
    )
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    from lightning.fabric import Fabric

    # By name, as a user would: Fabric's own launcher starts rank 1 and the process group is created here.
    first = Fabric(accelerator="cpu", devices=2, strategy="bagua")
    first.launch()
    result: dict[str, Any] = {"strategy_class": f"{type(first.strategy).__module__}.{type(first.strategy).__name__}"}
    for mode in args.mode.split(","):
        result.update(MODES[mode](args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{first.global_rank}.pt")


if __name__ == "__main__":
    main()
