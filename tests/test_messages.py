"""Codec round trips for every step message (hypothesis), empty and large batches, bad bytes."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from atomrt.distributed.messages import (
    CoreRequest,
    Flush,
    GrammarBitmask,
    Hello,
    MessageError,
    NewRequest,
    PromptLogprobs,
    RankBatch,
    Ready,
    StepPlan,
    StepResult,
    WorkerSamplingParams,
    decode,
    encode,
    wire_prefix,
)
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.sampling_params import SamplingParams, StructuredOutputsParams

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
f32 = st.floats(width=32, allow_nan=False)


def new_blocks(updates: dict[int, tuple[int, list[int]]]) -> dict[str, np.ndarray]:
    """RankBatch's new_block_* fields (as keyword arguments) for `seq_id -> (start, new block ids)`."""
    return dict(
        new_block_seq_ids=np.asarray(list(updates), dtype=np.int64),
        new_block_starts=np.asarray([start for start, _ in updates.values()], dtype=np.int32),
        num_new_blocks=np.asarray([len(blocks) for _, blocks in updates.values()], dtype=np.int32),
        new_block_ids=np.asarray(
            [b for _, blocks in updates.values() for b in blocks], dtype=np.int32
        ),
    )


def block_table_updates(rb: RankBatch) -> dict[int, tuple[int, list[int]]]:
    """The inverse of `new_blocks`: `seq_id -> (start, new block ids)` of a RankBatch."""
    bounds = np.cumsum(rb.num_new_blocks.tolist(), dtype=np.int64)
    blocks = np.split(rb.new_block_ids, bounds[:-1]) if len(bounds) else []
    return {
        s: (start, b.tolist())
        for s, start, b in zip(rb.new_block_seq_ids.tolist(), rb.new_block_starts.tolist(), blocks)
    }


def arrays(dtype, elements, max_size=40, shape=None):
    if shape is not None:
        return shape.flatmap(
            lambda s: st.lists(elements, min_size=int(np.prod(s)), max_size=int(np.prod(s))).map(
                lambda xs: np.array(xs, dtype=dtype).reshape(s)
            )
        )
    return st.lists(elements, max_size=max_size).map(lambda xs: np.array(xs, dtype=dtype))


worker_sampling_params = st.builds(
    WorkerSamplingParams,
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**63 - 1),
    repetition_penalty=st.floats(0.5, 2),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    logit_bias=st.none()
    | st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100), min_size=1, max_size=5),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5),
    bad_words_token_ids=st.none()
    | st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=3), min_size=1),
)

new_requests = st.builds(
    NewRequest,
    seq_id=i64,
    token_ids=arrays(np.int32, i32, max_size=300),
    output_token_ids=arrays(np.int32, i32, max_size=30),
    sampling_params=worker_sampling_params,
)

forward_decisions = st.builds(
    ForwardDecision,
    kind=st.sampled_from(list(ForwardKind)),
    running_bs=st.integers(0, 512),
    running_tokens=st.integers(0, 8192),
    is_prefill=st.booleans(),
    draft_num=st.integers(0, 8),
    req_key=st.none() | st.tuples(st.integers(1, 512), st.integers(0, 8)),
    token_bucket=st.none() | st.integers(1, 8192),
    ubatch_split_bs=st.none() | st.integers(1, 512),
    dp_num_tokens=st.lists(st.integers(0, 8192), max_size=8).map(tuple),
    dp_padded_tokens=st.lists(st.integers(0, 8192), max_size=8).map(tuple),
)


@st.composite
def rank_batches(draw, max_bs=20):
    bs = draw(st.integers(0, max_bs))
    seq_ids = np.array(draw(st.lists(i64, min_size=bs, max_size=bs, unique=True)), dtype=np.int64)
    num_new = np.array(draw(st.lists(st.integers(1, 8), min_size=bs, max_size=bs)), dtype=np.int32)
    updates = {
        int(s): (draw(st.integers(0, 1000)), draw(st.lists(st.integers(0, 2**31 - 1), max_size=5)))
        for s in seq_ids
        if draw(st.booleans())
    }
    return RankBatch(
        new_requests=draw(st.lists(new_requests, max_size=3)),
        seq_ids=seq_ids,
        num_new_tokens=num_new,
        num_computed_tokens=np.array(
            draw(st.lists(st.integers(0, 10**6), min_size=bs, max_size=bs)), np.int32
        ),
        input_ids=np.array(
            draw(st.lists(i32, min_size=int(num_new.sum()), max_size=int(num_new.sum()))), np.int32
        ),
        **new_blocks(updates),
        sample_mask=np.array(
            draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), dtype=np.bool_
        ),
        finished_seq_ids=draw(arrays(np.int64, i64, max_size=5)),
        reset=draw(st.booleans()),
        num_draft_tokens=np.array(
            draw(st.lists(st.integers(0, 8), min_size=bs, max_size=bs))
            if draw(st.booleans())
            else [],
            dtype=np.int32,
        ),
        next_token_ids=np.array(
            draw(st.lists(st.integers(-1, 2**31 - 1), min_size=bs, max_size=bs))
            if draw(st.booleans())
            else [],
            dtype=np.int32,
        ),
        grammar_rows=np.array(
            sorted(draw(st.sets(st.integers(0, 4 * bs), max_size=bs))), dtype=np.int32
        ),
    )


step_plans = st.builds(
    StepPlan,
    step=st.integers(0, 2**62),
    decision=st.none() | forward_decisions,
    ranks=st.lists(rank_batches(), max_size=3),
    shutdown=st.booleans(),
)


@st.composite
def prompt_logprobs(draw):
    m = draw(st.integers(0, 4))
    counts = draw(st.lists(st.integers(1, 6), min_size=m, max_size=m))
    rows, k = sum(counts), draw(st.integers(0, 5))
    return PromptLogprobs(
        seq_ids=draw(arrays(np.int64, i64, shape=st.just((m,)))),
        num_positions=np.asarray(counts, dtype=np.int32),
        token_logprobs=draw(arrays(np.float32, f32, shape=st.just((rows,)))),
        token_ranks=draw(arrays(np.int32, st.integers(1, 2**31 - 1), shape=st.just((rows,)))),
        top_token_ids=draw(arrays(np.int32, i32, shape=st.just((rows, k)))),
        top_logprobs=draw(arrays(np.float32, f32, shape=st.just((rows, k)))),
    )


@st.composite
def step_results(draw):
    n = draw(st.integers(0, 30))
    k = draw(st.integers(0, 5))
    with_lp = draw(st.booleans())
    spec = draw(st.booleans())
    return StepResult(
        step=draw(st.integers(0, 2**62)),
        dp_rank=draw(st.integers(0, 63)),
        seq_ids=draw(arrays(np.int64, i64, shape=st.just((n,)))),
        sampled_token_ids=draw(arrays(np.int32, i32, shape=st.just((n,)))),
        logprobs=draw(arrays(np.float32, f32, shape=st.just((n,)))) if with_lp else None,
        top_logprob_ids=draw(arrays(np.int32, i32, shape=st.just((n, k)))) if with_lp else None,
        top_logprobs=draw(arrays(np.float32, f32, shape=st.just((n, k)))) if with_lp else None,
        error=draw(st.none() | st.text(max_size=50)),
        num_accepted=np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), np.int32)
        if spec
        else np.zeros(0, np.int32),
        more_token_ids=draw(arrays(np.int32, i32, max_size=20)) if spec else np.zeros(0, np.int32),
        num_eager_draft_passes=draw(st.integers(0, 100)),
        prompt_logprobs=draw(st.none() | prompt_logprobs()),
        draft_token_ids=draw(arrays(np.int32, i32, shape=st.just((n * k,))))
        if spec
        else np.zeros(0, np.int32),
        draft_seconds=draw(st.floats(0, 10, allow_nan=False)),
    )


def assert_same(a, b) -> None:
    """Deep equality: same types, and arrays equal in dtype, shape and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


def roundtrip(msg):
    out = decode(encode(msg))
    assert_same(msg, out)
    return out


@_SETTINGS
@given(new_requests)
def test_new_request_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(rank_batches())
def test_rank_batch_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(step_plans)
def test_step_plan_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(step_results())
def test_step_result_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(
    st.builds(Hello, step=st.just(-1), instance=st.text(max_size=20), nonce=st.integers(0, 2**32))
)
def test_hello_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(
    st.builds(
        Ready, rank=st.integers(0, 1023), nonce=st.integers(0, 2**32), pid=st.integers(0, 2**22)
    )
)
def test_ready_roundtrip(msg):
    roundtrip(msg)


@_SETTINGS
@given(
    st.integers(0, 127),
    st.integers(0, 2**62),
    st.integers(0, 6),
    st.integers(0, 50),
    st.integers(-(2**31), 2**31 - 1),
)
def test_grammar_bitmask_roundtrip_and_its_subscription_prefix(dp_rank, step, rows, words, fill):
    msg = GrammarBitmask(dp_rank, step, np.full((rows, words), fill, dtype=np.int32))
    data = encode(msg)
    assert data.startswith(wire_prefix(GrammarBitmask, dp_rank))
    assert not data.startswith(wire_prefix(GrammarBitmask, (dp_rank + 1) % 128))
    roundtrip(msg)


def test_the_plan_channel_prefixes_tell_its_messages_apart():
    plan, flush, hello = StepPlan(step=7), Flush(3), Hello()
    for msg in (plan, flush, hello):
        prefixes = [wire_prefix(c) for c in (StepPlan, Flush, Hello) if c is not type(msg)]
        assert encode(msg).startswith(wire_prefix(type(msg)))
        assert not any(encode(msg).startswith(p) for p in prefixes)


@pytest.mark.parametrize(
    "so",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json": '{"type": "string"}', "max_whitespace": None},
        {"regex": "[a-z]+", "disable_any_whitespace": True},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a"'},
        {"json_object": True},
        {
            "structural_tag": {
                "type": "structural_tag",
                "format": {"type": "const_string", "value": "x"},
            }
        },
    ],
)
def test_a_request_with_structured_outputs_crosses_to_the_engine_core(so):
    msg = CoreRequest("r", np.asarray([1, 2], np.int32), SamplingParams(structured_outputs=so))
    out = roundtrip(msg)
    assert isinstance(out.sampling_params.structured_outputs, StructuredOutputsParams)


def test_empty_messages_roundtrip():
    for msg in (
        RankBatch(),
        StepPlan(step=0),
        StepPlan(step=0, ranks=[RankBatch(), RankBatch()]),
        StepResult(step=0, dp_rank=0),
        NewRequest(seq_id=0),
    ):
        roundtrip(msg)


def _decode_batch(bs: int) -> RankBatch:
    rng = np.random.default_rng(0)
    return RankBatch(
        seq_ids=np.arange(bs, dtype=np.int64),
        num_new_tokens=np.ones(bs, np.int32),
        num_computed_tokens=rng.integers(1, 4096, bs).astype(np.int32),
        input_ids=rng.integers(0, 50000, bs).astype(np.int32),
        **new_blocks({s: (100, [s]) for s in range(0, bs, 16)}),
        sample_mask=np.ones(bs, np.bool_),
    )


def test_large_batches_roundtrip():
    rng = np.random.default_rng(1)
    prefill = RankBatch(
        new_requests=[
            NewRequest(
                seq_id=i,
                token_ids=rng.integers(0, 50000, 2048).astype(np.int32),
                sampling_params=WorkerSamplingParams(seed=i),
            )
            for i in range(300)
        ],
        seq_ids=np.arange(300, dtype=np.int64),
        num_new_tokens=np.full(300, 2048, np.int32),
        num_computed_tokens=np.zeros(300, np.int32),
        input_ids=rng.integers(0, 50000, 300 * 2048).astype(np.int32),
        **new_blocks({i: (0, range(128 * i, 128 * (i + 1))) for i in range(300)}),
        sample_mask=np.ones(300, np.bool_),
    )
    decision = ForwardDecision(
        ForwardKind.EAGER,
        running_bs=300,
        running_tokens=300 * 2048,
        is_prefill=True,
        dp_num_tokens=(300 * 2048, 256),
        dp_padded_tokens=(300 * 2048, 300 * 2048),
    )
    plan = StepPlan(step=9, decision=decision, ranks=[prefill, _decode_batch(256)])
    out = roundtrip(plan)
    assert out.ranks[0].new_requests[299].token_ids.shape == (2048,)


def test_decode_step_ships_only_new_rows():
    """A 256-sequence decode step is a few KB: one token, one length, and rare new blocks per row."""
    decision = ForwardDecision(
        ForwardKind.REQ_GRAPH,
        running_bs=256,
        running_tokens=256,
        is_prefill=False,
        req_key=(256, 0),
        dp_num_tokens=(256,),
        dp_padded_tokens=(256,),
    )
    data = encode(StepPlan(step=1, decision=decision, ranks=[_decode_batch(256)]))
    assert len(data) < 8 * 1024


def test_decoded_arrays_are_views_with_wire_dtypes():
    rb = decode(encode(RankBatch(seq_ids=np.array([5, 6]), input_ids=np.array([1, 2], np.int32))))
    assert rb.seq_ids.dtype == np.int64 and not rb.seq_ids.flags.writeable


@pytest.mark.parametrize("data", [b"", b"\x93\x01\x02\x03", encode(Hello())[:-1], b"\x92\x63\x00"])
def test_bad_bytes_raise_message_error(data):
    with pytest.raises(MessageError):
        decode(data)


updates_dicts = st.dictionaries(
    i64,
    st.tuples(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 2**31 - 1), max_size=70)),
    max_size=300,
)


@_SETTINGS
@given(updates_dicts)
def test_block_table_updates_roundtrip(updates):
    """The flat new_block_* arrays travel as bytes and come back as the same updates, in order."""
    rb = decode(encode(RankBatch(**new_blocks(updates))))
    assert [(f, getattr(rb, f).dtype) for f in new_blocks({})] == [
        ("new_block_seq_ids", np.int64),
        ("new_block_starts", np.int32),
        ("num_new_blocks", np.int32),
        ("new_block_ids", np.int32),
    ]
    out = block_table_updates(rb)
    assert list(out) == list(updates)  # update order kept
    assert out == {s: (start, list(blocks)) for s, (start, blocks) in updates.items()}


def test_block_table_updates_empty_and_large():
    empty = decode(encode(RankBatch()))
    assert (
        all(getattr(empty, f).shape == (0,) for f in new_blocks({}))
        and block_table_updates(empty) == {}
    )
    rng = np.random.default_rng(2)
    big = {
        s: (
            int(rng.integers(0, 100)),
            rng.integers(0, 2**31 - 1, int(rng.integers(0, 600))).tolist(),
        )
        for s in range(-5000, 5000, 3)
    }
    out = roundtrip(RankBatch(**new_blocks(big)))
    assert block_table_updates(out) == big


def test_new_block_fields_travel_as_bare_bytes():
    """No ext, no Python per update: each new_block_* array is one msgpack bin of its raw bytes."""
    import msgpack

    fields = new_blocks({5: (3, [40, 41]), 9: (0, [7])})
    wire = msgpack.unpackb(encode(RankBatch(**fields)))
    names = [f.name for f in dataclasses.fields(RankBatch)]
    for name, a in fields.items():
        assert wire[1 + names.index(name)] == a.tobytes(), name


any_arrays = hnp.arrays(
    dtype=st.sampled_from(
        [
            np.int8,
            np.uint16,
            np.int32,
            np.int64,
            np.float16,
            np.float32,
            np.float64,
            np.bool_,
            np.dtype(">i4"),
            np.dtype(">f8"),
        ]
    ),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
)


@_SETTINGS
@given(any_arrays, st.booleans(), st.sampled_from(["logprobs", "seq_ids"]))
def test_arrays_of_any_dtype_and_shape_roundtrip(a, strided, field):
    """Whatever the field declares (seq_ids: int64 [n]; logprobs: nothing), the array comes back as sent:
    as bin in its declared dtype, as the compact ext for the step dtypes, else the ext with a header."""
    if strided and a.ndim:
        a = a[::2]  # not contiguous: sent in C order
    out = getattr(decode(encode(StepResult(step=0, dp_rank=0, **{field: a}))), field)
    assert out.dtype == a.dtype and out.shape == a.shape and not out.flags.writeable
    assert np.array_equal(out, a, equal_nan=a.dtype.kind == "f")


def test_declared_arrays_travel_as_bare_bytes():
    """A 1-D array of its field's declared dtype is msgpack bin of its bytes; another dtype, an ext."""
    import msgpack

    wire = msgpack.unpackb(
        encode(
            StepResult(
                step=0,
                dp_rank=0,
                seq_ids=np.arange(3, dtype=np.int64),
                sampled_token_ids=np.arange(3, dtype=np.int64),
            )
        )
    )
    assert wire[3] == np.arange(3, dtype=np.int64).tobytes()  # seq_ids: int64, as declared
    assert isinstance(wire[4], msgpack.ExtType)  # sampled_token_ids: int32 declared, int64 sent


def test_bad_declared_array_bytes_raise_message_error():
    import msgpack

    wire = msgpack.packb(
        [4, 0, 0, b"\x00" * 12, b"", None, None, None, None, b"", b"", 0, None, b"", 0.0, None],
        use_bin_type=True,
    )  # 12 B: not int64s
    with pytest.raises(MessageError, match="malformed StepResult"):
        decode(wire)


def test_encode_from_many_threads():
    """Each thread packs with its own Packer: concurrent encodes never mix their bytes."""
    import threading

    msgs = [
        StepResult(
            step=i,
            dp_rank=0,
            seq_ids=np.arange(i, dtype=np.int64),
            logprobs=np.full((i, 2), i, np.float64),
        )
        for i in range(40)
    ]
    expected = [encode(m) for m in msgs]
    bad: list[int] = []

    def run() -> None:
        for _ in range(50):
            bad.extend(i for i, m in enumerate(msgs) if encode(m) != expected[i])

    threads = [threading.Thread(target=run) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(
        1e-6
    )  # switch threads inside `_default` (a shared Packer fails this test)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not bad


def test_numpy_scalars_travel_as_python_scalars():
    decision = ForwardDecision(
        ForwardKind.TOKEN_GRAPH,
        running_bs=np.int32(8),
        running_tokens=np.int32(8),
        is_prefill=np.bool_(True),
        token_bucket=np.int64(8),
        dp_num_tokens=(np.int64(5),),
    )
    out = decode(encode(StepPlan(step=np.int64(3), decision=decision)))
    assert out.step == 3 and type(out.step) is int
    assert out.decision.is_prefill is True and out.decision.dp_num_tokens == (5,)
    assert out.decision.kind is ForwardKind.TOKEN_GRAPH and type(out.decision.token_bucket) is int


def _rank_batch_wire(**fields) -> bytes:
    """A RankBatch's bytes with some fields replaced by raw wire values."""
    import msgpack

    names = [f.name for f in dataclasses.fields(RankBatch)]
    wire = msgpack.unpackb(encode(RankBatch(**new_blocks({5: (0, [1, 2]), 6: (4, [3])}))))
    for name, value in fields.items():
        wire[1 + names.index(name)] = value
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize(
    "fields, match",
    [
        # counts say 4 ids, 3 follow; then 2, 3 follow
        ({"num_new_blocks": np.array([2, 2], np.int32).tobytes()}, "add up to 4 block ids, but 3"),
        ({"new_block_ids": np.array([1, 2], np.int32).tobytes()}, "add up to 3 block ids, but 2"),
        # counts (-1, 4) add up to the 3 ids that follow, but one is negative
        ({"num_new_blocks": np.array([-1, 4], np.int32).tobytes()}, "negative count"),
        # 2 updates, but 1 start / 3 counts / 3 seq ids
        (
            {"new_block_starts": np.array([0], np.int32).tobytes()},
            "2 new_block_seq_ids, 1 new_block_starts and 2",
        ),
        (
            {"num_new_blocks": np.array([1, 1, 1], np.int32).tobytes()},
            "2 new_block_seq_ids, 2 new_block_starts and 3",
        ),
        (
            {"new_block_seq_ids": np.arange(3, dtype=np.int64).tobytes()},
            "3 new_block_seq_ids, 2 new_block_starts",
        ),
        # not arrays at all
        ({"new_block_ids": None}, "malformed RankBatch"),
        ({"num_new_blocks": 7}, "malformed RankBatch"),
    ],
)
def test_bad_new_blocks_raise_message_error(fields, match):
    with pytest.raises(MessageError, match=match):
        decode(_rank_batch_wire(**fields))


def test_retired_ext_2_is_unknown():
    """Ext 2 carried the block-table updates as a dict; it is retired, and never reused."""
    import msgpack

    with pytest.raises(MessageError, match="unknown msgpack ext type 2"):
        decode(_rank_batch_wire(new_block_ids=msgpack.ExtType(2, b"\x00\x00\x00\x00")))


def test_unknown_ext_type_raises_message_error():
    import msgpack

    with pytest.raises(MessageError, match="unknown msgpack ext type 99"):
        decode(msgpack.packb([4, 0, 0, msgpack.ExtType(99, b""), None, None, None, None, None]))


def test_object_arrays_are_refused():
    with pytest.raises(MessageError, match="object array"):
        encode(StepResult(step=0, dp_rank=0, seq_ids=np.array([object()])))
    roundtrip(StepResult(step=1, dp_rank=0))  # the failed encode left nothing in the reused Packer


def test_malformed_nested_fields_raise_message_error():
    import msgpack

    wire = msgpack.packb([2, 7] + [None] * 11)  # RankBatch, bad fields
    with pytest.raises(MessageError, match="RankBatch"):
        decode(wire)
