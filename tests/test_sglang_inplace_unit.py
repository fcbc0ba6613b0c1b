"""The in-place loader's CPU-side plumbing (sglang_inplace): the status reply it writes for the
caller, with its phase timings, and the flat-buffer layout it unpacks. The loader itself runs
inside SGLang's scheduler and is tested on the GPU (test_sglang_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from lorabench.engines import sglang_inplace as ip


def test_status_round_trip_with_phase_timings():
    status = ip.status_tensor("cpu")
    assert ip.read_status(status) == ""                       # the loader never ran
    ip._write_status(status, 'OK {"check": 1.5, "pool": 2.25}')
    accepted, phases = ip.parse_reply(ip.read_status(status))
    assert accepted and phases == {"check": 1.5, "pool": 2.25}
    ip._write_status(status, "refused: q_proj has shape (3, 3)")
    assert ip.parse_reply(ip.read_status(status)) == (False, {})
    assert ip.read_status(status) == "refused: q_proj has shape (3, 3)"   # no leftovers of the longer reply
    assert ip.parse_reply("OK") == (True, {})                # a loader without timings


def test_long_refusal_is_cut_to_the_buffer():
    status = ip.status_tensor("cpu")
    ip._write_status(status, "refused: " + "x" * 5000)
    assert len(ip.read_status(status)) == ip.STATUS_BYTES - 1


def test_flat_layout_round_trip_and_refusal():
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0).view(4, 1)
    layout = [["x.lora_A.weight", [2, 3]], ["x.lora_B.weight", [4, 1]]]
    name = ip.flat_name("id7", layout)
    assert name.startswith(ip.PREFIX + "id7/" + ip.FLAT)
    views = ip._unflatten(name.split(ip.FLAT, 1)[1], torch.cat([a.flatten(), b.flatten()]))
    assert torch.equal(views["x.lora_A.weight"], a) and torch.equal(views["x.lora_B.weight"], b)
    with pytest.raises(ip.InPlaceRefused, match="layout 10 elements"):
        ip._unflatten(name.split(ip.FLAT, 1)[1], torch.zeros(9))
    with pytest.raises(ip.InPlaceRefused, match="not JSON"):
        ip._unflatten("[[", torch.zeros(9))
