"""Activation-aware quantization and its widget keep every tensor on the device of the model they measure."""
import pytest
import torch

from llminfer.quant import activation_aware


def _layer(device):
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 32, generator=gen)
    inputs[:, 3] *= 20                                      # one salient channel, as real activations have
    weight = torch.randn(48, 32, generator=gen) * 0.02
    return inputs.to(device), weight.to(device)


def test_awq_scaling_lowers_the_error_against_no_scaling_on_the_cpu():
    inputs, weight = _layer("cpu")
    rows = dict(activation_aware.awq_search(inputs, weight, 3, None))
    assert min(rows.values()) <= rows[0.0]                  # alpha = 0 is no scaling: the search can only help
    plain = activation_aware.weight_only_error(inputs, weight, 3, None)
    assert plain == pytest.approx(rows[0.0], rel=1e-6)
    assert activation_aware.smoothquant_error(inputs, weight, 0.5) < activation_aware.smoothquant_error(
        inputs, weight, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_errors_are_the_same_on_cuda_as_on_the_cpu():
    cpu, cuda = _layer("cpu"), _layer("cuda")
    for fn, args in ((activation_aware.weight_only_error, (3, None)), (activation_aware.smoothquant_error, (0.5,)),
                     (activation_aware.smoothquant_error, (None,))):
        assert fn(*cuda, *args) == pytest.approx(fn(*cpu, *args), rel=1e-4)
    rows_cpu, rows_cuda = activation_aware.awq_search(*cpu, 3, 32), activation_aware.awq_search(*cuda, 3, 32)
    assert [a for a, _ in rows_cuda] == [a for a, _ in rows_cpu]
