"""Bucket arithmetic: the capture ladder, request-bucket keys, bucket lookup, padding of static buffers."""

import pytest

from atomrt.graphs.buckets import (
    RequestBucket,
    bucket_for,
    capture_order,
    request_bucket,
    sorted_sizes,
)
from atomrt.runtime.config import CompilationConfig, Config, SchedulerConfig, capture_size_ladder


def test_ladder_default_512():
    ladder = capture_size_ladder(512)
    assert ladder[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    assert ladder[-2:] == [496, 512]
    assert len(ladder) == 8 + 32
    assert ladder == sorted(set(ladder))


@pytest.mark.parametrize(
    "max_size, expected",
    [
        (1, [1, 2, 3, 4, 5, 6, 7, 8]),
        (16, [1, 2, 3, 4, 5, 6, 7, 8, 16]),
        (40, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]),
    ],
)
def test_ladder_small(max_size, expected):
    assert capture_size_ladder(max_size) == expected


def test_config_ladder_capped_by_max_num_seqs():
    c = Config(
        scheduler_config=SchedulerConfig(max_num_seqs=48),
        compilation_config=CompilationConfig(level=3),
    )
    assert c.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48]
    assert c.compilation_config.max_capture_size == 48


def test_config_explicit_sizes():
    c = Config(compilation_config=CompilationConfig(cudagraph_capture_sizes=[8, 1, 4, 4]))
    assert c.capture_sizes == [1, 4, 8]


def test_request_bucket():
    assert request_bucket(8, 1) == (8, 0)
    assert request_bucket(8, 3) == RequestBucket(running_bs=8, draft_num=2)
    assert request_bucket(1, 1).draft_num == 0
    with pytest.raises(AssertionError):
        request_bucket(0, 1)
    with pytest.raises(AssertionError):
        request_bucket(4, 0)


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, 1),
        (1, 1),
        (2, 2),
        (3, 4),
        (4, 4),
        (5, 8),
        (8, 8),
        (9, 16),
        (16, 16),
        (17, None),
        (1000, None),
    ],
)
def test_bucket_for(n, expected):
    assert bucket_for(n, (1, 2, 4, 8, 16)) == expected


def test_bucket_for_default_ladder_every_count():
    ladder = capture_size_ladder(512)
    for n in range(1, 513):
        b = bucket_for(n, ladder)
        assert b is not None and b >= n
        smaller = [s for s in ladder if s < b]
        assert not smaller or smaller[-1] < n  # the smallest that holds n
    assert bucket_for(513, ladder) is None
    assert bucket_for(1, ()) is None


def test_capture_order_and_sizes():
    assert capture_order([1, 16, 4, 4, 2]) == [16, 4, 2, 1]
    assert sorted_sizes([4, 1, 4]) == (1, 4)
    with pytest.raises(AssertionError):
        sorted_sizes([0, 1])
