"""``FlatWeights``: one dtype group's parameters and the flat buffer they are exchanged through."""

import pytest
import torch
from torch import nn

from lightning_bagua.engine.algorithms.weights import FlatWeights, group_by_dtype


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False), nn.LayerNorm(3))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def test_aliased_parameters_live_in_the_buffer_and_keep_their_values():
    model = make_model()
    before = flat(model).clone()
    (weights,) = group_by_dtype(list(model.parameters()), alias=True)
    assert weights.aliased
    torch.testing.assert_close(weights.buffer, before, rtol=0, atol=0)
    offset = 0
    for parameter in model.parameters():
        assert parameter.data_ptr() == weights.buffer.data_ptr() + offset * weights.buffer.element_size()
        offset += parameter.numel()
    # An optimizer step writes the buffer, and gather returns it as it is: nothing to copy.
    model(torch.ones(2, 5)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert weights.gather() is weights.buffer
    torch.testing.assert_close(weights.buffer, flat(model), rtol=0, atol=0)
    assert not torch.equal(weights.buffer, before)


def test_scatter_into_aliased_parameters_is_one_copy_and_scattering_the_buffer_is_free():
    model = make_model()
    (weights,) = group_by_dtype(list(model.parameters()), alias=True)
    new = torch.arange(weights.buffer.numel(), dtype=torch.float32)
    weights.scatter(new)
    torch.testing.assert_close(flat(model), new, rtol=0, atol=0)
    assert weights.aliased  # written through, not re-pointed
    weights.scatter(weights.buffer)
    torch.testing.assert_close(flat(model), new, rtol=0, atol=0)


def test_a_parameter_given_new_storage_is_laid_out_again_with_its_new_values():
    model = make_model()
    (weights,) = group_by_dtype(list(model.parameters()), alias=True)
    first = model[0].weight
    first.data = torch.full_like(first, 2.5)  # as module.to() or load_state_dict(assign=True) would
    assert not weights.aliased
    gathered = weights.gather()
    assert weights.aliased
    torch.testing.assert_close(gathered, flat(model), rtol=0, atol=0)
    assert torch.all(gathered[: first.numel()] == 2.5)
    # Through a copy, scatter would still reach the parameters; laid out again it writes the new buffer.
    weights.scatter(torch.zeros_like(gathered))
    assert torch.count_nonzero(flat(model)) == 0


def test_a_parameter_cast_after_grouping_is_refused_with_the_fix():
    model = make_model()
    (weights,) = group_by_dtype(list(model.parameters()), alias=True)
    model.double()
    with pytest.raises(RuntimeError, match=r"grouped as torch\.float32 on cpu.*torch\.float64.*before wrapping"):
        weights.gather()


def test_without_alias_the_buffer_is_a_copy():
    model = make_model()
    weights = FlatWeights(list(model.parameters()), needs_receive_buffer=True)
    assert not weights.aliased
    gathered = weights.gather()
    torch.testing.assert_close(gathered, flat(model), rtol=0, atol=0)
    gathered.zero_()
    assert torch.count_nonzero(flat(model)) > 0  # the parameters are untouched
    weights.scatter(torch.ones_like(gathered))
    assert torch.all(flat(model) == 1)
    assert weights.received is not None
    assert weights.received.shape == gathered.shape


def test_parameters_in_someone_elses_flat_storage_are_copied_not_moved():
    # A fused optimizer's flat buffer (or any larger storage) holds these parameters: moving them out would cut
    # its owner off from them.
    model = make_model()
    parameters = list(model.parameters())
    theirs = torch.cat([parameter.detach().reshape(-1) for parameter in parameters])
    offset = 0
    for parameter in parameters:
        parameter.data = theirs[offset : offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
    (weights,) = group_by_dtype(parameters, alias=True)
    assert not weights.aliased
    assert all(p.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr() for p in parameters)
    gathered = weights.gather()
    assert gathered.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()
    torch.testing.assert_close(gathered, theirs, rtol=0, atol=0)
    weights.scatter(torch.zeros_like(gathered))
    assert torch.count_nonzero(theirs) == 0  # written through to where the parameters live


def test_a_channels_last_parameter_keeps_its_memory_format():
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    (weights,) = group_by_dtype(list(conv.parameters()), alias=True)
    assert not weights.aliased
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(weights.gather(), flat(conv), rtol=0, atol=0)
