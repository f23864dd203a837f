"""Devices: a model and the pools it makes are on one device however the device was named, and
a device this torch cannot compute on is refused before anything is built.

A CUDA model named ``cuda`` makes pools whose tensors report ``cuda:0``; ``cpu:0`` against
``cpu`` is the same naming difference on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.model.reference import same_device
from scheduler.model.select import load_model
from scheduler.runner import ForwardBatch, ForwardItem
from tests.test_checkpoint import IDS
from tests.test_own_checkpoint import refused, tiny_directory


def test_a_model_on_a_device_named_with_an_index_runs_over_the_pools_it_makes(tmp_path):
    directory = tiny_directory(tmp_path / "tiny")
    tokens = {}
    for device in ("cpu", "cpu:0"):
        served = load_model(str(directory), device=device)
        pool = served.make_pool(num_pages=4, page_size=16)
        assert (str(served.model.device), str(pool.device)) == (device, "cpu")
        runner = served.runner(served.model, pool)
        tokens[device] = runner.forward(ForwardBatch((ForwardItem("t", tuple(IDS), 0,
                                                                  (0, 1, 2, 3)),)))
    assert tokens["cpu:0"] == tokens["cpu"]


def _usable(kind: str) -> bool:
    backend = getattr(torch, kind, None)
    return kind != "meta" and bool(getattr(backend, "is_available", lambda: False)())


@pytest.mark.parametrize("device", ["mps", "xpu", "meta", "mps:0"])
def test_a_device_this_torch_cannot_compute_on_is_one_line_before_loading(capsys, device):
    """``--device mps`` on a torch without MPS (or ``meta``, which holds no data) failed in the
    model's constructor with a traceback; it is refused as ``--device cuda:abc`` is."""
    kind = device.split(":")[0]
    if _usable(kind):
        pytest.skip(f"this torch computes on {kind}")
    said = refused(capsys, "generate", "--model", "smollm2", "--prompt", "hi",
                   "--device", device)
    assert said.startswith(f"pdlife generate: --device: device {device!r}")
    assert said.endswith(": use 'cpu', 'cuda', 'cuda:N' or 'auto' (--device on the command "
                         "line)\n")
    assert refused(capsys, "serve", "--backend", "local", "--device", device) == said.replace(
        "pdlife generate: ", "pdlife serve: ", 1)


def test_a_cuda_device_past_the_machines_devices_is_refused() -> None:
    """Past the devices there are (none, on a torch without CUDA): refused by name, before
    anything loads; where there are some, ``cuda`` is the first of them."""
    from scheduler.model.decoder import resolve_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        assert same_device(resolve_device("cuda"), torch.empty(1, device="cuda").device)
        why = rf"has {count} CUDA device\(s\), numbered from 0"
    elif torch.version.cuda is None:
        why = r"has no CUDA build"
    else:
        why = r"finds no CUDA device"
    with pytest.raises(ValueError, match=why):
        resolve_device(f"cuda:{count}")
