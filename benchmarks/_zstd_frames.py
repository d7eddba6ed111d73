"""The zstd test data of the nvCOMP probes: ``n`` zstd-1 frames of ``piece`` bytes each
(uint16 smooth field plus 3 bits of noise, 16 distinct frames repeated)."""

import numpy as np


def zstd_frames(n: int = 512, piece: int = 8 << 20) -> list[bytes]:
    import numcodecs

    rng = np.random.default_rng(0)
    base = (np.sin(np.linspace(0, 2000, piece // 2)) * 1000 + 2000).astype(np.uint16)
    z = numcodecs.Zstd(level=1)
    uniq = [z.encode(base + rng.integers(0, 8, piece // 2, dtype=np.uint16)) for _ in range(16)]
    return [uniq[i % 16] for i in range(n)]
