"""`AsyncLLM` as vLLM's docs use it: `async for out in engine.generate(prompt, params, id)` over
the engine-core process the server uses; concurrent streams, output kinds, abort, cancellation
and shutdown. Greedy tokens are checked against transformers' own greedy decode."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from executor_harness import COMMON, WORDS, build_tiny_llama, save_word_tokenizer

from atomrt import AsyncEngineArgs, AsyncLLM, SamplingParams
from atomrt.runtime.driver.prompt_logprobs import Logprob
from atomrt.runtime.sampling_params import RequestOutputKind

PROMPTS = [[5, 9, 17, 3], [7, 1, 20], [11, 12, 13, 14, 15], [50, 51]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_word_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def hf_greedy(model: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


def _run(coro):
    return asyncio.run(coro)


def test_concurrent_streams_match_transformers(model: Path, hf_greedy: list[list[int]]) -> None:
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model), **COMMON))

    async def one(i: int, prompt: list[int], kind: RequestOutputKind) -> list:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate({"prompt_token_ids": prompt}, sp, f"r{i}")]

    async def main() -> list[list]:
        kinds = list(RequestOutputKind)
        return await asyncio.gather(*(one(i, p, kinds[i % 3]) for i, p in enumerate(PROMPTS * 3)))

    try:
        streams = _run(main())
    finally:
        engine.shutdown()
    assert not engine.client._proc.is_alive(), "shutdown() left the engine core running"
    for i, outs in enumerate(streams):
        want = hf_greedy[i % len(PROMPTS)]
        kind = list(RequestOutputKind)[i % 3]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].prompt_token_ids == PROMPTS[i % len(PROMPTS)]
        if kind is RequestOutputKind.DELTA:
            assert [t for o in outs for t in o.outputs[0].token_ids] == want
        else:
            assert outs[-1].outputs[0].token_ids == want
            special = {0, 1, 2}  # the word tokenizer's bos, eos and unk: skipped in the text
            assert outs[-1].outputs[0].text.split() == [WORDS[t] for t in want if t not in special]
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        if kind is RequestOutputKind.CUMULATIVE:
            assert len(outs) > 1
            assert all(want[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in outs)
        m = outs[-1].metrics  # wall-clock, as vLLM's
        assert abs(m.arrival_time - time.time()) < 600
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_abort_cancel_logprobs_and_refusals(model: Path) -> None:
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model), **COMMON))
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def abort_after(n: int) -> list:
        outs = []
        async for out in engine.generate(PROMPTS[0], long, "to-abort"):
            outs.append(out)
            if len(outs) == n:
                await engine.abort("to-abort")
        return outs

    async def cancelled() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[1], long, "to-cancel"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def idle_after_cancel() -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = engine.client.stats
            if stats is not None and stats.num_running == 0 and stats.num_waiting == 0:
                return True
            await asyncio.sleep(0.2)
        return False

    async def main() -> None:
        outs = await abort_after(3)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(outs[-1].outputs[0].token_ids) < 200
        await cancelled()
        assert "to-cancel" not in engine.client.streams
        assert await idle_after_cancel(), "the cancelled request still runs in the engine core"
        # sample logprobs as {id: Logprob}
        sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
        final = [o async for o in engine.generate(f"{WORDS[5]} {WORDS[9]}", sp, "lp")][-1]
        c = final.outputs[0]
        assert final.prompt == f"{WORDS[5]} {WORDS[9]}" and final.prompt_token_ids == [5, 9]
        assert len(c.logprobs) == 3
        assert all(isinstance(row[t], Logprob) for row, t in zip(c.logprobs, c.token_ids))
        assert all(row[t].rank == 1 for row, t in zip(c.logprobs, c.token_ids))  # greedy
        # refusals name the field
        with pytest.raises(ValueError, match="logprobs"):
            bad = SamplingParams(max_tokens=2, logprobs=10_000)
            async for _ in engine.generate(PROMPTS[0], bad, "too-long"):
                pass
        with pytest.raises(ValueError, match="prompt.prompt_ids"):
            async for _ in engine.generate({"prompt_ids": [1]}, long, "bad-prompt"):
                pass
        with pytest.raises(ValueError, match="priority"):
            async for _ in engine.generate(PROMPTS[0], long, "p", priority=2):
                pass
        await engine.check_health()

    try:
        _run(main())
    finally:
        engine.shutdown()
    assert engine.is_stopped and not engine.client._proc.is_alive()


def test_arrival_wall_time_is_the_streams_arrival() -> None:
    """The request's wall-clock arrival is its stream's arrival (the core may schedule it before
    the client's state for it exists), so arrival <= first scheduled <= first token holds."""
    from atomrt.runtime.entrypoints.async_llm import _RequestState
    from atomrt.runtime.entrypoints.engine_client import RequestStream

    stream = RequestStream("r", arrival_time=time.monotonic() - 5.0)
    state = _RequestState("r", None, [1], SamplingParams(max_tokens=1), stream, None)
    assert abs(state.arrival_wall - (time.time() - 5.0)) < 0.5
    assert state._wall(stream.arrival_time + 0.001) >= state.arrival_wall
