"""Region graphs on a real GPU: a toy model whose host-dependent "attention" is an eager region.

Every bucket is recorded largest first into the one pool, then replayed in random order with new
inputs in the static buffers and new host metadata, and compared with eager execution each time:
pool-sharing corruption (a recording keeping, or another clobbering, memory it relies on) shows up
as a mismatch. The pool's size after all buckets must be about the largest recording's.
"""

import random
from dataclasses import dataclass

import pytest
import torch

from atomrt.graphs.markers import captured_token_sizes, eager_region, token_graph, token_graph_of
from atomrt.graphs.region_graph import RegionRequest, ReqGraph, graph_pool, graph_pool_bytes
from atomrt.runtime.forward_context import Context, get_forward_context, set_forward_context

pytestmark = pytest.mark.gpu

BUCKETS = [16, 8, 4, 2, 1]  # recorded largest first
HIDDEN = 128
REPEAT = 2048  # eager-region tensors are [rows, HIDDEN * REPEAT] fp32: 1 MiB per row
VOCAB = 64


@dataclass
class ToyMeta:
    """Host metadata of the toy attention: how the real rows split into sequences."""

    cu_seqlens_cpu: list  # host list, as a host-planned launch reads it
    scale_gpu: torch.Tensor  # [1] device scalar (the graph-safe path reads only this)
    graph_safe: bool = False


@eager_region
def toy_attention(x: torch.Tensor, output: torch.Tensor) -> None:
    """Per-sequence running mean over rows; the launch count follows the host's sequence list."""
    meta: ToyMeta = get_forward_context().attn_metadata
    if meta.graph_safe:  # FULL: launch fixed by the bucket, reads only device buffers
        output.copy_(x * meta.scale_gpu)
        return
    cu = meta.cu_seqlens_cpu
    output.zero_()
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if b > a:
            rows = torch.arange(1, b - a + 1, device=x.device, dtype=x.dtype)[:, None]
            output[a:b] = torch.cumsum(x[a:b], 0) / rows * meta.scale_gpu


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        wide = torch.tanh(self.inp(h)).repeat(1, REPEAT)  # [n, HIDDEN * REPEAT]
        attn = torch.empty_like(wide)
        toy_attention(wide, attn)
        return h + self.out(attn.view(n, -1, HIDDEN).mean(1))  # [n, HIDDEN]


@token_graph
class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + positions[:, None].to(torch.float32) * 0.01
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


class Runner:
    """The runner's side: static input buffers, the forward context, eager / record / replay."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = ToyModel().cuda().eval()
        self.input_ids = torch.zeros(max(BUCKETS), dtype=torch.int64, device="cuda")
        self.positions = torch.zeros(max(BUCKETS), dtype=torch.int64, device="cuda")
        self.scale = torch.ones(1, device="cuda")

    def fill(self, num_tokens: int, num_padded: int, rng: random.Random) -> ToyMeta:
        ids = torch.tensor([rng.randrange(VOCAB) for _ in range(num_tokens)], dtype=torch.int64)
        self.input_ids[:num_tokens].copy_(ids)
        self.input_ids[num_tokens:num_padded].zero_()
        self.positions[:num_padded].copy_(torch.arange(num_padded) % 7)
        self.scale.fill_(rng.uniform(0.5, 2.0))
        cuts = (
            sorted(rng.sample(range(1, num_tokens), k=min(num_tokens - 1, rng.randrange(0, 4))))
            if num_tokens > 1
            else []
        )
        return ToyMeta(cu_seqlens_cpu=[0, *cuts, num_tokens], scale_gpu=self.scale)

    def forward(
        self, meta: ToyMeta, num_padded: int, tr_graph=None, is_prefill=False
    ) -> torch.Tensor:
        ctx = Context(is_prefill=is_prefill, running_tokens=num_padded)
        with set_forward_context(meta, None, ctx, tr_graph=tr_graph):
            return self.model(self.input_ids[:num_padded], self.positions[:num_padded])


def capture_token_graphs(runner: Runner, rng: random.Random) -> list:
    pool_sizes = []
    for n in BUCKETS:
        meta = runner.fill(n, n, rng)
        runner.forward(meta, n)  # warm-up, eager
        runner.forward(meta, n, tr_graph="record")
        torch.cuda.synchronize()
        pool_sizes.append(graph_pool_bytes())
    return pool_sizes


@torch.inference_mode()
def test_token_graph_replay_matches_eager_in_random_order():
    rng = random.Random(0)
    runner = Runner()
    pool_sizes = capture_token_graphs(runner, rng)
    graph = token_graph_of(runner.model)
    assert (
        graph.captured_sizes("decode") == sorted(BUCKETS) and graph.captured_sizes("prefill") == []
    )
    assert captured_token_sizes(runner.model, "decode") == sorted(BUCKETS)
    assert graph.num_segments(16, "decode") == 4  # three eager regions break the forward

    largest, total = pool_sizes[0], pool_sizes[-1]
    print(
        f"pool after the largest recording: {largest / 2**20:.1f} MiB; after all: {total / 2**20:.1f} MiB"
    )
    # Without non-owning aliases the kept eager arguments alone would add ~ (8+4+2+1)/16 of the largest.
    assert total <= 1.2 * largest + (4 << 20), pool_sizes

    order = [n for _ in range(3) for n in BUCKETS]
    rng.shuffle(order)
    for n in order:
        real = rng.randint(max(1, n // 2 + 1) if n > 1 else 1, n)
        meta = runner.fill(real, n, rng)
        replayed = runner.forward(meta, n, tr_graph="replay").clone()
        eager = runner.forward(meta, n)
        torch.testing.assert_close(
            replayed, eager, rtol=1e-4, atol=1e-4, msg=f"bucket {n}, {real} real rows"
        )


@torch.inference_mode()
def test_req_graph_replay_matches_eager_and_shares_the_pool():
    # Run after the token-graph test, whose recordings have all died by now: the one pool lives on
    # and is recorded into again.
    rng = random.Random(1)
    runner = Runner(seed=1)
    req = ReqGraph()
    pool_sizes = []
    for bs in BUCKETS:
        meta = runner.fill(bs, bs, rng)
        meta.graph_safe = True
        runner.forward(meta, bs)  # warm-up
        with set_forward_context(meta, None, Context(running_tokens=bs, running_bs=bs)):
            req.record(
                (bs, 0), lambda bs=bs: runner.model(runner.input_ids[:bs], runner.positions[:bs])
            )
        torch.cuda.synchronize()
        pool_sizes.append(graph_pool_bytes())
    assert req.keys() == [(b, 0) for b in sorted(BUCKETS)] and (4, 0) in req and (3, 0) not in req
    largest, total = pool_sizes[0], pool_sizes[-1]
    print(
        f"request graphs: pool after the largest {largest / 2**20:.1f} MiB, after all {total / 2**20:.1f} MiB"
    )
    assert total <= 1.2 * largest + (4 << 20), pool_sizes
    assert graph_pool() == graph_pool()

    order = BUCKETS * 2
    rng.shuffle(order)
    for bs in order:
        meta = runner.fill(bs, bs, rng)  # new inputs and a new device scale, same static buffers
        meta.graph_safe = True
        with set_forward_context(meta, None, Context(running_tokens=bs, running_bs=bs)):
            replayed = req.replay((bs, 0)).clone()
        eager = runner.forward(meta, bs)
        torch.testing.assert_close(
            replayed, eager, rtol=1e-4, atol=1e-4, msg=f"request bucket {bs}"
        )


@torch.inference_mode()
def test_token_and_request_graphs_interleaved_in_one_pool():
    """A drafter's token graphs and the target's request graphs share the pool: interleave them."""
    rng = random.Random(2)
    runner = Runner(seed=2)
    capture_token_graphs(runner, rng)
    req = ReqGraph()
    for bs in BUCKETS:
        meta = runner.fill(bs, bs, rng)
        meta.graph_safe = True
        with set_forward_context(meta, None, Context(running_tokens=bs, running_bs=bs)):
            req.record(
                (bs, 0), lambda bs=bs: runner.model(runner.input_ids[:bs], runner.positions[:bs])
            )
    torch.cuda.synchronize()

    steps = [(kind, n) for kind in ("token", "req") for n in BUCKETS] * 2
    rng.shuffle(steps)
    for kind, n in steps:
        meta = runner.fill(n, n, rng)
        if kind == "token":
            replayed = runner.forward(meta, n, tr_graph="replay").clone()
        else:
            meta.graph_safe = True
            with set_forward_context(meta, None, Context(running_tokens=n, running_bs=n)):
                replayed = req.replay((n, 0)).clone()
        eager = runner.forward(meta, n)
        torch.testing.assert_close(
            replayed, eager, rtol=1e-4, atol=1e-4, msg=f"{kind} graph, bucket {n}"
        )


@token_graph(per_phase=True)
class PerPhaseToy(ToyModel):
    """Records different work per phase: a prefill forward runs one more block."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + positions[:, None].to(torch.float32) * 0.01
        blocks = self.blocks if get_forward_context().context.is_prefill else self.blocks[:2]
        for block in blocks:
            h = block(h)
        return self.norm(h)


@torch.inference_mode()
def test_per_phase_unit_replays_each_phase_recording():
    rng = random.Random(3)
    runner = Runner(seed=3)
    runner.model = PerPhaseToy().cuda().eval()
    for is_prefill in (False, True):
        for n in (8, 4):
            meta = runner.fill(n, n, rng)
            runner.forward(meta, n, is_prefill=is_prefill)
            runner.forward(meta, n, tr_graph="record", is_prefill=is_prefill)
    graph = token_graph_of(runner.model)
    assert len(graph) == 4 and graph.captured_sizes("prefill") == [4, 8] == graph.captured_sizes(
        "decode"
    )
    assert graph.num_segments(8, "prefill") == 4 and graph.num_segments(8, "decode") == 3

    steps = [(p, n) for p in (False, True) for n in (8, 4)] * 2
    rng.shuffle(steps)
    for is_prefill, n in steps:
        meta = runner.fill(rng.randint(n // 2 + 1, n), n, rng)
        replayed = runner.forward(meta, n, tr_graph="replay", is_prefill=is_prefill).clone()
        eager = runner.forward(meta, n, is_prefill=is_prefill)
        torch.testing.assert_close(
            replayed, eager, rtol=1e-4, atol=1e-4, msg=f"prefill={is_prefill}, bucket {n}"
        )


def test_composite_graph_runs_its_graphs_in_order_in_one_launch():
    from atomrt.graphs.composite import CompositeGraph

    x = torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        for op in (lambda: x.add_(1), lambda: x.mul_(3), lambda: x.sub_(2)):
            g = torch.cuda.CUDAGraph(keep_graph=True)
            g.capture_begin()
            op()
            g.capture_end()
            g.instantiate()
            graphs.append(g)
    torch.cuda.synchronize()
    joined = CompositeGraph([g.raw_cuda_graph() for g in graphs], stream.cuda_stream)
    x.fill_(1)
    torch.cuda.synchronize()
    joined.launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert (x == (1 + 1) * 3 - 2).all()  # order kept: add, mul, sub
    for g in graphs:
        g.replay()  # the parts still replay on their own
    torch.cuda.synchronize()
    assert (x == (4 + 1) * 3 - 2).all()
    joined.close()


@eager_region(request_fixed=True)
def toy_attention_fixed(x: torch.Tensor, output: torch.Tensor) -> None:
    toy_attention.__wrapped__(x, output)


@token_graph
class JoinedToy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids[:, None].float().repeat(1, HIDDEN) / VOCAB
        for block in self.blocks:
            n = h.shape[0]
            wide = torch.tanh(block.inp(h)).repeat(1, REPEAT)
            out = torch.empty_like(wide)
            toy_attention_fixed(wide, out)
            h = h + block.out(out[:, :HIDDEN] + out[:, -HIDDEN:]) / n
        return h


def test_joined_token_graph_replays_like_eager_in_random_order():
    """Every bucket recorded with its request bucket's region graphs (graph-safe metadata), then
    replayed in random order, joined (one launch) and segment by segment, against eager each time."""
    torch.manual_seed(0)
    model = JoinedToy().cuda()
    static = torch.zeros(max(BUCKETS), dtype=torch.int64, device="cuda")
    scale = torch.ones(1, device="cuda")
    graph = token_graph_of(model)
    with torch.inference_mode():
        for n in BUCKETS:
            safe = ToyMeta([0, n], scale, graph_safe=True)
            for meta in (ToyMeta([0, n], scale), safe):  # warm-up, eager
                with set_forward_context(meta, None, Context(running_tokens=n)):
                    model(static[:n])
            torch.cuda.synchronize()
            with set_forward_context(
                ToyMeta([0, n], scale),
                None,
                Context(running_tokens=n),
                tr_graph="record",
                tr_request=RegionRequest((n, 0), safe),
            ):
                model(static[:n])
        assert graph.req_keys() == [(n, 0) for n in sorted(BUCKETS)]
        rng = random.Random(3)
        order = [(n, joined) for n in BUCKETS for joined in (True, False)] * 2
        rng.shuffle(order)
        for i, (n, joined) in enumerate(order):
            static[:n] = torch.randint(0, VOCAB, (n,), device="cuda")
            scale.fill_(1.0 + i / 10)
            meta = ToyMeta([0, n], scale, graph_safe=joined)
            with set_forward_context(meta, None, Context(running_tokens=n)):
                ref = model(static[:n]).clone()
            with set_forward_context(
                meta,
                None,
                Context(running_tokens=n),
                tr_graph="replay",
                tr_req_key=(n, 0) if joined else None,
            ):
                got = model(static[:n])
            torch.testing.assert_close(got, ref, msg=f"bucket {n} joined={joined} (#{i})")
