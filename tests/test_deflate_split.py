"""Which pieces of a Deflate batch nvCOMP decodes and which the host's cores do (``codecs._split``).

Pure functions of rates, piece sizes and core count, checked by hypothesis against the two
ways the split must never lose to: everything on the host and everything on nvCOMP.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulazy.codecs import _split
from gpulazy.codecs._split import Rates, gpu_seconds, host_seconds, makespan, plan
from gpulazy.spec import Codec

MiB = 1 << 20

sizes_st = st.lists(st.integers(0, 8 * MiB), min_size=1, max_size=60)
rates_st = st.builds(
    Rates,
    host_per_core=st.floats(1e7, 2e9),
    gpu_per_stream=st.floats(1e5, 1e9),
    gpu_streams=st.integers(1, 4096),
    gpu_call=st.floats(0, 0.01),
    link=st.floats(1e9, 1e11),
    overlap=st.sampled_from([0.0, 0.5, 1.0]),
)


def time_of(gpu: list[int], decoded: list[int], stored: list[int], cores: int, r: Rates) -> float:
    on_gpu = set(gpu)
    host = [i for i in range(len(decoded)) if i not in on_gpu]
    return makespan(host_seconds([decoded[i] for i in host], [stored[i] for i in host], cores, r),
                    gpu_seconds([decoded[i] for i in gpu], r), r.overlap)


@settings(max_examples=80, deadline=None)
@given(sizes_st, st.integers(1, 64), rates_st, st.floats(1.0, 3.0))
def test_the_plan_is_a_subset_never_slower_than_either_side_alone(decoded, cores, r, ratio):
    stored = [int(n / ratio) for n in decoded]
    gpu = plan(decoded, stored, cores, r)
    assert gpu == sorted(set(gpu)) and all(0 <= i < len(decoded) for i in gpu)
    t = time_of(gpu, decoded, stored, cores, r)
    everything = list(range(len(decoded)))
    assert t <= time_of([], decoded, stored, cores, r) * (1 + 1e-9)
    assert t <= time_of(everything, decoded, stored, cores, r) * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(sizes_st, st.integers(1, 64), rates_st)
def test_a_gpu_share_that_cannot_beat_the_host_alone_is_none(decoded, cores, r):
    # No GPU share, however small, finishes before the host has decoded everything: all on the host.
    smallest = min(decoded)
    host_all = host_seconds(decoded, decoded, cores, r)
    if host_all <= r.gpu_call + smallest / r.gpu_per_stream:
        assert plan(decoded, decoded, cores, r) == []


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.integers(1, 64), st.integers(1, 8 * MiB))
def test_equal_pieces_with_no_gpu_cost_go_where_they_finish_first(n, cores, size):
    # A GPU far faster than the host takes all; one far slower takes none.
    fast = Rates(host_per_core=1e6, gpu_per_stream=1e12, gpu_call=0.0, gpu_streams=4096)
    slow = Rates(host_per_core=1e9, gpu_per_stream=1.0)
    assert plan([size] * n, [size] * n, cores, fast) == list(range(n))
    assert plan([size] * n, [size] * n, cores, slow) == []


def test_the_measured_workloads_of_issue_21():
    r = Rates()
    # bench_codecs --chunks 256: 256 pieces of 2 MiB. nvCOMP alone took 0.34 s; 16 cores take
    # about a third of that: no piece goes to the GPU.
    assert plan([2 * MiB] * 256, [int(2 * MiB / 1.16)] * 256, 16, r) == []
    # A single piece never goes to nvCOMP (one stream: 6 MB/s).
    assert plan([4 * MiB], [3 * MiB], 16, r) == []
    # 4096 HDF5 chunks of 4 MiB: the host alone would take 2.4 s, one nvCOMP stream 0.7 s: both decode.
    gpu = plan([4 * MiB] * 4096, [int(4 * MiB / 1.16)] * 4096, 16, r)
    assert 0 < len(gpu) < 4096
    host = [4 * MiB] * (4096 - len(gpu))
    h, g = host_seconds(host, host, 16, r), gpu_seconds([4 * MiB] * len(gpu), r)
    assert abs(h - g) < 0.1 * max(h, g)  # both sides finish together


def test_mixed_sizes_give_the_gpu_the_pieces_that_cost_it_least():
    # nvCOMP's time follows its largest piece: small edge tiles go to it, not the big ones.
    r = Rates(host_per_core=1e8, gpu_per_stream=1e7, gpu_call=0.0, link=1e12)
    decoded = [4 * MiB] * 8 + [64 << 10] * 200
    gpu = plan(decoded, decoded, 4, r)
    assert gpu and all(decoded[i] == 64 << 10 for i in gpu)


@pytest.mark.parametrize("n", [256, 1024, 2048])
def test_when_the_host_stalls_behind_nvcomp_a_batch_goes_to_one_side(n):
    # overlap 0: the two sides take the sum of their times. A share of nvCOMP costs its
    # largest piece's time whatever its size, so a split only adds the host's time to it.
    decoded = [4 * MiB] * n
    serial = plan(decoded, decoded, 16, Rates(overlap=0.0))
    assert serial in ([], list(range(n)))
    both = plan(decoded, decoded, 16, Rates())
    assert time_of(serial, decoded, decoded, 16, Rates(overlap=0.0)) >= time_of(both, decoded, decoded, 16, Rates())


def test_empty_batch_and_zero_sized_pieces():
    assert plan([], [], 16, Rates()) == []
    assert host_seconds([], [], 16, Rates()) == 0.0 and gpu_seconds([], Rates()) == 0.0
    assert plan([0, 0, 0], [0, 0, 0], 4, Rates()) == []


# -- measuring --------------------------------------------------------------------------------

def test_per_stream_rate_from_a_call():
    r = Rates(gpu_call=0.0, gpu_streams=100)
    # 50 streams of 2 MB in 0.5 s: the largest stream set the time, 4 MB/s per stream.
    assert _split.per_stream([2_000_000] * 50, 0.5, r) == pytest.approx(4e6)
    # 400 streams on 100 slots: four rounds of 2 MB in 0.5 s is 16 MB/s per stream.
    assert _split.per_stream([2_000_000] * 400, 0.5, r) == pytest.approx(16e6)
    assert _split.per_stream([], 0.5, r) is None and _split.per_stream([10], 0.0, r) is None


@pytest.mark.parametrize("host, gpu, wall, want", [
    (1.0, 1.0, 1.0, 1.0),   # side by side
    (1.0, 1.0, 2.0, 0.0),   # one after the other
    (1.0, 3.0, 3.5, 0.5),
    (1.0, 1.0, 0.5, 1.0),   # faster than predicted: clamped
    (1.0, 1.0, 9.0, 0.0),
])
def test_overlap_from_a_batchs_wall_time(host, gpu, wall, want):
    assert _split.overlap(host, gpu, wall) == pytest.approx(want)


def test_overlap_needs_both_sides():
    assert _split.overlap(0.0, 1.0, 1.0) is None and _split.overlap(1.0, 1.0, 0.0) is None


def test_the_record_folds_measures_per_device():
    rec = _split.RateRecord(weight=0.5)
    assert rec.rates("cuda:0") == Rates()
    new = rec.fold("cuda:0", host_per_core=1.45e9, gpu_per_stream=None)
    assert new.host_per_core == pytest.approx(0.95e9) and new.gpu_per_stream == Rates().gpu_per_stream
    assert rec.rates("cuda:1") == Rates()  # each device its own
    rec.count("cuda:0", batches=1, host_pieces=3)
    rec.count("cuda:0", batches=1, host_pieces=2)
    snap = rec.snapshot()["cuda:0"]
    assert snap["counts"] == {"batches": 2, "host_pieces": 5}
    assert snap["rates"]["host_per_core"] == pytest.approx(0.95e9)
    rec.reset()
    assert rec.snapshot() == {}


def test_a_calibration_replaces_the_prior_once_and_later_measures_fold_in():
    rec = _split.RateRecord(weight=0.5)
    assert not rec.calibrated("cuda:0")
    assert rec.calibrate("cuda:0", host_per_core=0.15e9).host_per_core == pytest.approx(0.15e9)  # not averaged
    assert rec.calibrated("cuda:0") and not rec.calibrated("cuda:0", "zstd") and not rec.calibrated("cuda:1")
    assert rec.fold("cuda:0", host_per_core=0.25e9).host_per_core == pytest.approx(0.2e9)
    rec.reset()
    assert not rec.calibrated("cuda:0") and rec.rates("cuda:0") == Rates()


def test_the_host_rate_is_measured_on_pieces_of_the_first_batch(monkeypatch):
    # Before the first plan, a few middling pieces of the batch are decoded on this host and
    # timed: the rate per core the plan starts from is this host's, once per device and family.
    import zlib

    from gpulazy.codecs import _beside

    rec = _split.RateRecord()
    monkeypatch.setattr(_split, "RECORD", rec)
    rng = np.random.default_rng(0)
    raw = [np.cumsum(rng.integers(0, 3, n)).astype("<u2").tobytes() for n in (1000, 300_000, 600_000, 900_000)]
    pieces = [np.frombuffer(zlib.compress(r, 1), np.uint8) for r in raw]
    zl = Codec.of("zlib", level=1)
    decoded = []
    real = _beside._host_one
    monkeypatch.setattr(_beside, "_host_one", lambda piece, *a: decoded.append(piece.size) or real(piece, *a))
    _beside.calibrate_host(pieces, zl, [len(r) for r in raw], [None] * 4, "cuda:7", "deflate")
    assert rec.calibrated("cuda:7")
    assert rec.rates("cuda:7").host_per_core != Rates().host_per_core and rec.rates("cuda:7").host_per_core > 0
    assert decoded == [pieces[2].size, pieces[3].size]  # the middling ones, about CALIBRATE_BYTES
    _beside.calibrate_host(pieces, zl, [len(r) for r in raw], [None] * 4, "cuda:7", "deflate")
    assert len(decoded) == 2  # once per process
    garbled = [np.frombuffer(b"\x78\x01garbage" * 100, np.uint8)] * 3
    _beside.calibrate_host(garbled, zl, [5000] * 3, [None] * 3, "cuda:8", "deflate")  # the batch will say why
    assert not rec.calibrated("cuda:8")


@given(decoded=sizes_st, cores=st.integers(1, 64), r=rates_st, backlog=st.floats(0, 100))
@settings(max_examples=150, deadline=None)
def test_host_work_queued_ahead_shrinks_the_host_share(decoded, cores, r, backlog):
    # A host share queued behind other batches' host work ends that much later: counted so, the
    # plan never loses to nvCOMP alone by the model.
    busy = plan(decoded, decoded, cores, r, backlog)
    host = [d for i, d in enumerate(decoded) if i not in set(busy)]
    h = host_seconds(host, host, cores, r)
    took = makespan(h + (backlog if h > 0 else 0.0),
                    gpu_seconds([decoded[i] for i in busy], r), r.overlap)
    assert took <= max(r.margin, 1.0) * gpu_seconds(decoded, r) * (1 + 1e-9) + 1e-12


def test_a_busy_host_gets_a_smaller_share_and_a_long_backlog_none():
    pieces, r = [4 * MiB] * 256, Rates(host_per_core=0.15e9, gpu_per_stream=12e6, gpu_streams=1100)
    idle, some, long = (256 - len(plan(pieces, pieces, 16, r, b)) for b in (0.0, 0.2, 10.0))
    assert idle > some > long == 0


def test_a_batch_plans_behind_the_host_work_of_the_batches_in_flight(monkeypatch):
    # Deflate batches decode side by side; each plan counts on every host core, so a batch
    # planned while another's host share is queued sees that share's predicted seconds.
    from gpulazy.codecs import _beside
    from gpulazy.device import get_device

    monkeypatch.setattr(_beside, "calibrate_host", lambda *a: None)
    seen: list[float] = []

    def share(decoded, stored, cores, device, kind="deflate", backlog=0.0):
        seen.append(backlog)
        return [] if len(seen) == 1 else list(range(len(decoded)))  # the first batch: all to the host

    decoding, release = threading.Event(), threading.Event()

    def decode(pieces, *args):
        decoding.set()
        release.wait(30)
        return ["done"] * len(pieces)

    monkeypatch.setattr(_split, "gpu_share", share)
    monkeypatch.setattr(_beside, "_decode", decode)
    zl, dev = Codec.of("zlib", level=1), get_device("cpu")
    pieces = [np.zeros(8, np.uint8)] * 3

    def batch():
        return _beside.beside_host(pieces, zl, [4 << 20] * 3, dev, [None] * 3, None)

    t = threading.Thread(target=batch)
    t.start()
    assert decoding.wait(30)
    batch()
    assert seen[0] == 0.0 and seen[1] > 0  # 12 MiB for the host, queued ahead of the second plan
    release.set()
    t.join(30)
    assert _beside._BACKLOG.seconds(dev.name) == 0.0
    batch()
    assert seen[2] == 0.0


def test_the_record_is_safe_across_threads():
    rec = _split.RateRecord(weight=0.1)

    def work():
        for _ in range(200):
            rec.fold("cuda:0", overlap=0.0)
            rec.count("cuda:0", batches=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.snapshot()["cuda:0"]["counts"]["batches"] == 800
    assert rec.rates("cuda:0").overlap == pytest.approx(0.9 ** 800, abs=1e-12)


# -- the knobs ---------------------------------------------------------------------------------

def test_force_picks_the_share_and_nests():
    sizes = [MiB] * 5
    with _split.force("gpu"):
        assert _split.gpu_share(sizes, sizes, 16, "cuda:9") == [0, 1, 2, 3, 4]
        with _split.force("alternate"):
            assert _split.gpu_share(sizes, sizes, 16, "cuda:9") == [1, 3]
        with _split.force("host"):
            assert _split.gpu_share(sizes, sizes, 16, "cuda:9") == []
    assert _split.gpu_share(sizes, sizes, 16, "cuda:9") == plan(sizes, sizes, 16, Rates())
    with pytest.raises(ValueError, match="expected one of auto, host, gpu, alternate"), _split.force("half"):
        pass


def test_only_the_deflate_and_zstd_families_are_split():
    assert {_split.family(Codec.of(i)) for i in ("zlib", "gzip", "imagecodecs_zlib", "imagecodecs_deflate")} \
        == {"deflate"}
    assert {_split.family(Codec.of(i)) for i in ("zstd", "imagecodecs_zstd")} == {"zstd"}
    assert not any(_split.applies(Codec.of(i)) for i in ("lz4", "blosc", "shuffle", "bitshuffle_lz4"))


def test_zstd_frames_too_few_for_nvcomp_go_to_the_host_and_big_batches_stay_on_the_gpu():
    zstd = _split.PRIORS["zstd"]
    # A napari plane of (32, 512, 512) uint16 chunks: 16 frames of 16 MiB. nvCOMP takes ~109 ms
    # (one thread block a frame), 16 host cores ~60: the host takes them.
    assert plan([16 * MiB] * 16, [15 * MiB] * 16, 16, zstd) == []
    # On 2 cores the host would take 8 times as long: nvCOMP keeps them.
    assert plan([16 * MiB] * 16, [15 * MiB] * 16, 2, zstd) == list(range(16))
    # A whole-array submission of 128 frames of 8 MiB: nvCOMP decodes them at ~20 GB/s; a split
    # would gain under the 10 % margin, so nvCOMP takes all.
    assert plan([8 * MiB] * 128, [7 * MiB] * 128, 16, zstd) == list(range(128))
    # Fewer pieces than min_pieces (a dask task's chunk) or fewer bytes than min_bytes: nvCOMP.
    assert plan([16 * MiB] * 4, [15 * MiB] * 4, 16, zstd) == list(range(4))
    assert plan([1 * MiB] * 32, [MiB] * 32, 16, zstd) == list(range(32))
    # Deflate keeps its own rule: the same small batch goes to the host.
    assert plan([1 * MiB] * 32, [MiB] * 32, 16, Rates()) == []


def test_the_rates_of_each_family_are_kept_apart():
    record = _split.RateRecord()
    record.fold("cuda:9", "zstd", host_per_core=1e9)
    assert record.rates("cuda:9", "zstd").host_per_core == pytest.approx(0.7 * 0.3e9 + 0.3 * 1e9)
    assert record.rates("cuda:9") == Rates()  # Deflate's figures untouched
    record.count("cuda:9", "zstd", batches=1)
    assert set(record.snapshot()) == {"cuda:9/zstd"}


def test_the_plan_is_fast_for_big_batches():
    import time

    decoded = np.random.default_rng(0).integers(1, 4 * MiB, 100_000).tolist()
    t = time.perf_counter()
    plan(decoded, decoded, 16, Rates())
    assert time.perf_counter() - t < 1.0  # vectorised: every batch of a read plans once
