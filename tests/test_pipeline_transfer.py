"""Transfer helpers: exact values, padding, ring reuse and size errors (CPU tensors; CUDA path on GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.transfer import PAD_ID, DraftUploader, SampledDownloader, pad_drafts


def test_pad_drafts_hand_checked() -> None:
    got = pad_drafts([[5, 6, 7], [], [1, 2, 3, 4, 5]], 4)
    assert got.dtype == np.int32
    assert got.tolist() == [[5, 6, 7, -1], [-1, -1, -1, -1], [1, 2, 3, 4]]
    out = np.zeros((3, 5), np.int32)
    assert pad_drafts([[9]], 2, pad=0, out=out).tolist() == [[9, 0]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_uploader_values_and_ring(device: str) -> None:
    up = DraftUploader(4, 5, device)
    a = up.upload([[1, 2], [3, 4, 5, 6, 7, 8]], k=3)
    up.wait()
    assert a.shape == (2, 3) and a.dtype == torch.int32 and a.device.type == device
    assert a.cpu().tolist() == [[1, 2, PAD_ID], [3, 4, 5]]
    b = up.upload([[9]])  # the next slot: the first result stays intact
    up.wait()
    assert b.cpu().tolist() == [[9, PAD_ID, PAD_ID, PAD_ID, PAD_ID]]
    assert a.cpu().tolist() == [[1, 2, PAD_ID], [3, 4, 5]]
    c = up.upload([[7, 7]], k=2)  # the ring wraps around to slot 0
    up.wait()
    assert c.cpu().tolist() == [[7, 7]]
    with pytest.raises(ValueError, match="max_rows=4"):
        up.upload([[1]] * 5)
    with pytest.raises(ValueError, match="max_k=5"):
        up.upload([[1]], k=6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_downloader_values_and_ring(device: str) -> None:
    down = SampledDownloader(8, 4, device)
    with pytest.raises(RuntimeError, match="before start"):
        down.result()
    ids = torch.arange(6, device=device).reshape(3, 2)
    down.start(ids)
    first = down.result()
    assert first.tolist() == [[0, 1], [2, 3], [4, 5]] and down.ready()
    down.start(torch.full((1, 4), 7, device=device))
    assert down.result().tolist() == [[7, 7, 7, 7]]
    assert first.tolist() == [[0, 1], [2, 3], [4, 5]]  # results are copies
    with pytest.raises(ValueError, match="width=4"):
        down.start(torch.zeros((2, 5), dtype=torch.int64, device=device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpu_side_hedge_selection(device: str) -> None:
    from specdec.transfer import pack_hedges, select_drafts

    tables = [
        {(5, 6, 3): [7, 8, 9], (9,): [1]},  # row 0: full acceptance + bonus 3 was hedged
        {(4,): [2, 2]},  # row 1: the outcome will not be among the hedges
        {},  # row 2: no hedges at all
        {(1, 2): [3, 4, 5, 6, 7]},  # row 3: draft longer than k is cut
    ]
    keys, drafts = pack_hedges(tables, width=2, key_len=4, k=3)
    assert keys.shape == (4, 2, 4) and drafts.shape == (4, 2, 3)
    assert keys[0, 1].tolist() == [9, -1, -1, -1] and drafts[3, 0].tolist() == [3, 4, 5]
    sampled = torch.tensor([[5, 6, 3, -1, -1], [4, 1, -1, -1, -1], [7, -1, -1, -1, -1], [1, 2, -1, -1, -1]],
                           device=device)
    out, hit = select_drafts(sampled, torch.as_tensor(keys, device=device), torch.as_tensor(drafts, device=device))
    assert hit.cpu().tolist() == [True, False, False, True]
    assert out.cpu().tolist() == [[7, 8, 9], [-1, -1, -1], [-1, -1, -1], [3, 4, 5]]
    # an emission longer than every key never matches a key that is its prefix
    long = torch.tensor([[5, 6, 3, 4, 4]], device=device)
    out, hit = select_drafts(long, torch.as_tensor(keys[:1], device=device), torch.as_tensor(drafts[:1], device=device))
    assert hit.cpu().tolist() == [False] and out.cpu().tolist() == [[-1, -1, -1]]
