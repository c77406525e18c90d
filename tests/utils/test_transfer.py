"""minisparse/utils/transfer.py: host values onto a device (the page-locked, queued copy is the
CUDA path, run by every GPU test of the training passes and the engine)."""
import pytest
import torch

from minisparse.utils.transfer import to_device


def test_lists_and_tensors_arrive_with_their_values():
    cpu = torch.device("cpu")
    ids = to_device([3, 1, 2], cpu)
    assert ids.dtype == torch.long and ids.tolist() == [3, 1, 2]
    assert to_device([0.5], cpu, torch.float32).dtype == torch.float32
    rows = torch.arange(6.0).view(2, 3)
    assert torch.equal(to_device(rows[[1]], cpu), torch.tensor([[3.0, 4.0, 5.0]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_copy_is_read_after_the_kernels_before_it():
    device = torch.device("cuda")
    big = torch.randn(4096, 4096, device=device)
    for _ in range(8):
        big = big @ big / 64  # keeps the GPU busy while the host goes on
    index = to_device(list(range(10)), device)
    assert index.device.type == "cuda" and index.tolist() == list(range(10))
