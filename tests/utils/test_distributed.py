import torch

from minisparse.utils import distributed


def test_barrier_names_the_rank_gpu_under_nccl_and_no_device_under_gloo(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    distributed.device_barrier()
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    distributed.device_barrier()
    assert calls == [{"device_ids": [3]}, {}]
