"""`_lightning_compat` answers each Fabric release the way it calls: before 2.6 and from 2.6 on."""

import torch
from torch import nn

from lightning_bagua._lightning_compat import (
    SCHEDULER_NOT_PASSED,
    fabric_load_checkpoint_keywords,
    fabric_setup_result,
)


def test_setup_returns_two_values_to_fabric_before_2_6_and_three_from_2_6():
    module = nn.Linear(2, 2)
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1)
    assert fabric_setup_result(module, optimizers, SCHEDULER_NOT_PASSED) == (module, optimizers)
    assert fabric_setup_result(module, optimizers, None) == (module, optimizers, None)
    assert fabric_setup_result(module, optimizers, scheduler) == (module, optimizers, scheduler)


def test_load_checkpoint_forwards_weights_only_only_when_given():
    assert fabric_load_checkpoint_keywords(None) == {}
    assert fabric_load_checkpoint_keywords(True) == {"weights_only": True}
    assert fabric_load_checkpoint_keywords(False) == {"weights_only": False}
