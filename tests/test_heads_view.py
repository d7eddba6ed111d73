"""The napari view's plane from zstd heads, without napari (``HostView`` imports neither napari nor Qt):
on the CPU and, where there is one, on a GPU, where the heads decode on the host and go up."""

from __future__ import annotations

import numpy as np
import pytest

import gpulazy
from test_cache import wait_idle


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("checksum", [False, True])
def test_a_view_s_plane_decodes_from_heads_and_its_chunks_are_warmed_behind(tmp_path, device, checksum):
    zarr = pytest.importorskip("zarr")
    from zarr.codecs import ZstdCodec

    from napari_gpulazy import read_layers

    data = np.random.default_rng(16).integers(0, 60000, (32, 64, 64), dtype="u2")
    p = str(tmp_path / "z.zarr")
    zarr.create_array(p, shape=data.shape, chunks=(16, 32, 32), dtype="u2",
                      compressors=ZstdCodec(level=1, checksum=checksum))[...] = data
    cache = gpulazy.DeviceCache("4 MiB", device=device)
    try:
        ((view, _, _),) = read_layers(p, device=device, cache=cache, contrast_limits=(0, 1), chunks=(16, 32, 32),
                                      prefetch=False)
        np.testing.assert_array_equal(np.asarray(view[18, 3:40]), data[18, 3:40])
        # A checksummed frame cannot be checked from a head: the engine reads its chunks whole instead.
        assert view.transfers.part_reads == 4
        wait_idle(cache)
        assert all(view.array.chunk_index.specs[(1, i, j)] in cache for i in (0, 1) for j in (0, 1))
        np.testing.assert_array_equal(np.asarray(view[30]), data[30])
    finally:
        cache.close()
