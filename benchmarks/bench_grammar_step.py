"""The driver's share of a decode step with grammar-constrained rows, on CPU: the engine's step loop
with the forward replaced by random logits, a batch of `--bs` rows of which `--grammar-rows` follow
a JSON schema (benchmarks/schemas/user_profiles.json) and the rest are unconstrained.

    python benchmarks/bench_grammar_step.py [--bs 64] [--grammar-rows 0,16,64] [--sync]
                                            [--steps 60] [--profile tottime] [--per-row-accept]
                                            [--fill-on-thread on|off]
                                            [--parallel-fill-rows 32] [--tokenizer DIR]
                                            [--device cuda [--forward-ms 1.5]
                                             [--pinned-masks off,on]]

Prints, per count of constrained rows, the best of three runs: the driver's µs per step (the host
step less the in-process CPU worker's sampling and mask apply, which a GPU does on the device), of
which the mask fill (`grammar_mask_seconds`); the driver's µs from a step's masks going out to
its successor's plan (the GPU's wait between the two); the step loop thread's CPU time per step
(the same span, less the sampling's: on a shared machine steadier than the wall clock, and
without work the driver hands to other threads); the grammars' batch accept of the step's tokens
(`MaskStats.accept_seconds`, part of the driver's); the CPU worker's sampling apart; and the
driver's µs from a step's results coming in to the masks they let out (the least of the runs:
what the GPU's forward of the step the masks are for has to hide, or the GPU waits); and the
step's wall time. The worker's torch runs on one thread, so that its sampling does not take the
cores from the driver. The model is a 2-layer Llama of hidden size 64 over the embedded SmolLM2
tokenizer's 49k vocabulary (tests/grammar_harness.py; `--tokenizer`: another's), so a row's mask
is as wide as on a real model of that vocabulary. `--device cuda`: the worker samples (and
applies the masks) on the GPU, each forward being `--forward-ms` of queued GPU work; the step
wall of constrained rows over that of none is then the whole cost of structure, the driver's and
the mask upload's (`--pinned-masks off,on` compares the two uploads). A finished request
is replaced between steps, outside the timed span; the unconstrained requests are as long as
the constrained ones are on average (measured first), so that requests come and go as often at
any count of constrained rows. Under async scheduling a step with grammar
rows cannot sample before the previous step's tokens have advanced the grammars: what a step
adds over the unconstrained one is what the GPU would wait for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from atomrt import SamplingParams
from atomrt.runtime.driver import structured_outputs, xgrammar_backend
from atomrt.runtime.driver.grammar_backend import GrammarBackend
from atomrt.runtime.driver.xgrammar_backend import XgrammarBackend
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import StructuredOutputsParams
from atomrt.workers.runner.grammar_upload import GrammarUpload
from atomrt.workers.runner.model_runner import ModelOutput

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the CPU tests' tiny models
from grammar_harness import build_tiny_bpe  # noqa: E402
from moe_harness import make_hf_model  # noqa: E402

SCHEMA = HERE / "schemas" / "user_profiles.json"
PROMPT = [1, 504, 3287, 28, 253, 2896, 30]


def build_tiny_with(folder: Path, tokenizer: str) -> Path:
    """The bench's tiny Llama (grammar_harness.build_tiny_bpe's shape) over `tokenizer`'s
    vocabulary, with that tokenizer saved beside it."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        max_position_embeddings=1024,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
    )
    make_hf_model(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bs", type=int, default=64, help="rows a step decodes")
    ap.add_argument(
        "--grammar-rows", default="0,16,64", help="comma-separated counts of constrained rows"
    )
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile", default="", help="cProfile one more run, sorted by this key")
    ap.add_argument(
        "--per-row-accept",
        action="store_true",
        help="the stop rules advance each constrained row's grammar in a call of its own (the "
        "backend accepts nothing ahead in a batch): the comparison",
    )
    ap.add_argument(
        "--fill-on-thread",
        choices=("on", "off"),
        default="on" if structured_outputs.FILL_ON_THREAD else "off",
        help="the masks waiting for a step's tokens fill on a thread while the step loop applies "
        "the stop rules and plans the next step (structured_outputs.FILL_ON_THREAD, the default)",
    )
    ap.add_argument(
        "--parallel-fill-rows",
        type=int,
        default=xgrammar_backend.PARALLEL_FILL_ROWS,
        help="a step with this many constrained rows fills their masks on threads, on a "
        "machine of MIN_FILL_CORES or more (xgrammar_backend.PARALLEL_FILL_ROWS)",
    )
    ap.add_argument(
        "--tokenizer",
        default="",
        help="a Hugging Face tokenizer folder whose vocabulary the tiny model takes (default: the "
        "embedded SmolLM2 tokenizer's 49152 tokens; Llama-3's 128256 widen each mask row)",
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the worker samples on the GPU, each forward being --forward-ms of queued GPU "
        "work: what a step with constrained rows adds over one without is then what the GPU waits",
    )
    ap.add_argument("--forward-ms", type=float, default=1.5, help="--device cuda: a forward's time")
    ap.add_argument(
        "--pinned-masks",
        default="",
        help="--device cuda: comma list of off,on: the worker's mask upload through pinned "
        "buffers (workers/runner/grammar_upload.py; default: PINNED_GRAMMAR_MASKS)",
    )
    a = ap.parse_args()
    counts = [int(c) for c in a.grammar_rows.split(",")]
    xgrammar_backend.PARALLEL_FILL_ROWS = a.parallel_fill_rows
    torch.set_num_threads(1)  # the CPU worker's sampling keeps to the step loop's thread
    if a.per_row_accept:
        XgrammarBackend.accept_ahead = GrammarBackend.accept_ahead  # type: ignore[method-assign]
    structured_outputs.FILL_ON_THREAD = a.fill_on_thread == "on"
    if any(not 0 <= c <= a.bs for c in counts):
        ap.error(f"--grammar-rows: each count between 0 and --bs ({a.bs})")
    folder = Path(tempfile.mkdtemp()) / "model"
    folder = build_tiny_with(folder, a.tokenizer) if a.tokenizer else build_tiny_bpe(folder)
    llm = LLM(
        str(folder),
        device=a.device,
        enforce_eager=True,
        num_kv_blocks=4096,
        max_num_seqs=a.bs,
        max_model_len=1024,
        async_scheduling=not a.sync,
    )
    eng = llm.engine
    runner = eng.executor.worker.runner
    vocab = eng.grammars.vocab_size
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randn(a.bs * 8, vocab, generator=gen) for _ in range(4)]
    cycles = 0
    if a.device == "cuda":  # a model's logits, and the forward's time on the GPU
        tables = [t.to("cuda", torch.bfloat16) for t in tables]
        cycles = sleep_cycles(a.forward_ms)
    calls = [0]

    def random_logits(input_ids, decision, logits_indices, split=None) -> ModelOutput:
        n = input_ids.shape[0]
        calls[0] += 1
        if cycles:
            torch.cuda._sleep(cycles)
        logits = tables[calls[0] % len(tables)]
        return ModelOutput(logits[:n][logits_indices], logits[:n], None)

    runner.run_model = random_logits
    apply = {"s": 0.0, "cpu": 0.0}  # the CPU worker's sampling (and mask apply): not the driver's
    sample = runner.sample

    def timed_sample(*args):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return sample(*args)
        finally:
            apply["s"] += time.perf_counter() - t
            apply["cpu"] += time.thread_time() - c

    runner.sample = timed_sample
    # the host time from a step's masks going out to its successor's plan: on a GPU the forward
    # of that successor cannot start before, so it is time the GPU waits
    gap = {"s": 0.0, "n": 0, "masks_at": None}
    # and from a step's results coming in to the masks they let out: the driver's share of what
    # the GPU's forward of the step those masks are for has to hide
    lag = {"s": 0.0, "n": 0, "results_at": None}
    send, submit, collect = eng.executor.send_grammar, eng.executor.submit, eng.executor.collect

    def noted_collect(step, flush):
        results = collect(step, flush)
        lag["results_at"] = time.perf_counter()
        return results

    def noted_send(masks):
        if lag["results_at"] is not None:
            lag["s"] += time.perf_counter() - lag["results_at"]
            lag["n"] += 1
            lag["results_at"] = None
        send(masks)  # the in-process worker samples here
        gap["masks_at"] = time.perf_counter()

    def noted_submit(plan):
        if gap["masks_at"] is not None:
            gap["s"] += time.perf_counter() - gap["masks_at"]
            gap["n"] += 1
            gap["masks_at"] = None
        return submit(plan)

    eng.executor.send_grammar, eng.executor.submit = noted_send, noted_submit
    eng.executor.collect = noted_collect
    constrained = SamplingParams(
        temperature=0,
        max_tokens=400,
        structured_outputs=StructuredOutputsParams(json=json.loads(SCHEMA.read_text())),
    )
    eng.grammars.prepare(constrained).result()  # the schema compiled (and cached) before a run
    # plain requests as long as the constrained ones: requests end and start as often whatever
    # the share of constrained rows, so that what a count of them adds is the grammars' alone
    probe = llm.generate([PROMPT] * 8, constrained, use_tqdm=False)
    plain_len = round(sum(len(o.outputs[0].token_ids) for o in probe) / len(probe))
    plain = SamplingParams(temperature=0, max_tokens=plain_len, ignore_eos=True)
    live: dict[str, bool] = {}  # request id -> constrained

    def top_up(n_grammar: int) -> None:
        for out in list(live):
            if out not in eng._requests:
                del live[out]
        want = n_grammar - sum(live.values())
        for _ in range(want):
            live[eng.add_request(PROMPT, constrained, stream=True)] = True
        for _ in range(a.bs - len(live)):
            live[eng.add_request(PROMPT, plain, stream=True)] = False

    def run(n_grammar: int) -> tuple[float, ...]:
        top_up(n_grammar)
        for _ in range(8):  # prefill, compiles, the pipeline full
            eng.step()
            top_up(n_grammar)
        stats0 = eng.grammars.mask_stats.seconds
        accept0 = eng.grammars.mask_stats.accept_seconds
        apply0, cpu0 = apply["s"], apply["cpu"]
        gap.update(s=0.0, n=0, masks_at=None)
        lag.update(s=0.0, n=0, results_at=None)
        busy = cpu = 0.0
        for _ in range(a.steps):
            t, c = time.perf_counter(), time.thread_time()
            eng.step()
            busy += time.perf_counter() - t
            cpu += time.thread_time() - c
            top_up(n_grammar)
        for rid in list(live):
            eng.abort(rid)
        live.clear()
        while eng.has_unfinished():
            eng.step()
        fill = eng.grammars.mask_stats.seconds - stats0
        accept = eng.grammars.mask_stats.accept_seconds - accept0
        spans = (busy, fill, apply["s"] - apply0, cpu - (apply["cpu"] - cpu0), accept)
        per_step = [x / a.steps * 1e6 for x in spans]
        return (
            *per_step[:3],
            gap["s"] / gap["n"] * 1e6 if gap["n"] else 0.0,
            *per_step[3:],
            lag["s"] / lag["n"] * 1e6 if lag["n"] else 0.0,
        )

    mode = "sync" if a.sync else "async"
    uploads = [None]  # the worker's mask upload as built
    if a.device == "cuda" and a.pinned_masks:
        uploads = [GrammarUpload(runner.device, x == "on") for x in a.pinned_masks.split(",")]
    for upload, n in ((u, n) for u in uploads for n in counts):
        if upload is not None:
            runner.grammar_upload = upload
        gpu = ""
        if a.device == "cuda":
            pinned = "on" if runner.grammar_upload.pinned else "off"
            gpu = f" (cuda, forward {a.forward_ms:g} ms, pinned masks {pinned})"
        runs = [run(n) for _ in range(3)]
        best = min(runs, key=lambda r: r[0] - r[2])
        print(
            f"bs={a.bs} grammar rows={n} {mode}: driver {best[0] - best[2]:.0f} us/step, of which "
            f"mask fill {best[1]:.0f}; masks to next plan {best[3]:.0f} us; its thread's CPU "
            f"{min(r[4] for r in runs):.0f} us/step; the grammars' batch accept {best[5]:.0f} us; "
            f"the CPU worker's sampling {best[2]:.0f} more "
            f"(driver runs {', '.join(f'{r[0] - r[2]:.0f}' for r in runs)}; {a.steps} steps each); "
            f"results to masks {min(r[6] for r in runs):.0f} us; step wall "
            f"{min(r[0] for r in runs):.0f} us{gpu}"
        )
        if a.profile and n == counts[-1]:
            prof = cProfile.Profile()
            prof.enable()
            run(n)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(a.profile).print_stats(40)
            print(buf.getvalue())
    llm.shutdown()


def sleep_cycles(ms: float) -> int:
    """The torch.cuda._sleep argument that keeps the GPU busy about `ms`."""
    torch.cuda._sleep(1000)  # loaded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return int(10**7 * ms / start.elapsed_time(end))


if __name__ == "__main__":
    main()
