"""``start_method``: Lightning's spawning launcher starts the processes, and the algorithm still averages."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_bagua.strategies.bagua import BaguaStrategy
from lightning_bagua.strategies.fabric import BaguaStrategy as FabricBaguaStrategy
from tests.distributed import free_port


@pytest.mark.parametrize("strategy_class", [BaguaStrategy, FabricBaguaStrategy])
def test_an_unknown_start_method_fails_at_construction_naming_the_choices(strategy_class):
    with pytest.raises(ValueError, match=r"`start_method` must be one of 'popen', 'spawn', 'fork', 'forkserver', got"):
        strategy_class(start_method="thread")


@pytest.mark.parametrize("strategy_class", [BaguaStrategy, FabricBaguaStrategy])
def test_start_method_is_not_taken_for_an_algorithm_keyword(strategy_class):
    strategy = strategy_class(algorithm="bytegrad", start_method="spawn", hierarchical=False)
    assert strategy.bagua_kwargs == {"hierarchical": False}
    assert strategy._start_method == "spawn"


def train_two_steps(fabric: Fabric) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(2):
        # Different data on each rank: only averaged gradients keep the replicas equal.
        inputs = torch.full((2, 4), float(fabric.global_rank + 1 + step))
        optimizer.zero_grad()
        fabric.backward(model(inputs).sum())
        optimizer.step()
    weights = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
    return {
        # Plain lists: tensors would come back through shared memory the ended child no longer serves.
        "weights": fabric.all_gather(weights).tolist(),
        "bytes_sent": fabric.strategy.communication_counter.bytes_sent,
        "launcher": type(fabric.strategy.launcher).__name__,
    }


def test_fabric_spawns_its_processes_and_averages_gradients(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricBaguaStrategy(start_method="spawn"))
    result = fabric.launch(train_two_steps)
    assert result["launcher"] == "_MultiProcessingLauncher"
    assert result["bytes_sent"] > 0
    assert result["weights"][0] == result["weights"][1]


class TwoRankModule(LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.out = out

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        # Different data on each rank: only averaged gradients keep the replicas equal.
        return self.layer(batch[0] * (self.global_rank + 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        weights = torch.cat([parameter.detach().reshape(-1) for parameter in self.parameters()])
        gathered = self.all_gather(weights)
        if self.global_rank == 0:
            counter = self.trainer.strategy.communication_counter
            report = {"weights": gathered.tolist(), "bytes_sent": counter.bytes_sent}
            report["launcher"] = type(self.trainer.strategy.launcher).__name__
            self.out.write_text(json.dumps(report))


def test_trainer_spawns_its_processes_and_averages_gradients(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "report.json"
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=BaguaStrategy(start_method="spawn"),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.arange(32, dtype=torch.float32).reshape(8, 4)), batch_size=2)
    trainer.fit(TwoRankModule(out), data)
    report = json.loads(out.read_text())
    assert report["launcher"] == "_MultiProcessingLauncher"
    assert report["bytes_sent"] > 0
    assert report["weights"][0] == report["weights"][1]
