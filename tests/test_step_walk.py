"""The decode-step walk: the chain of files a reader follows from `LLMEngine.step` to the attention
kernel (in-process executor, an eager decode step on CPU).

Measured with a profiler hook: the files of every function the engine calls directly in the step,
then the files on the call stack at the moment the attention kernel is entered. docs/architecture.md
names them; this test keeps that list true and the chain short.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from executor_harness import build_tiny_llama

from atomrt.runtime.driver.engine import LLMEngine
from atomrt.runtime.entrypoints.llm import LLM
from atomrt.runtime.sampling_params import SamplingParams
from atomrt.workers.layers import attention_ref

ROOT = Path(__file__).parent.parent
PACKAGE_DIRS = [str(ROOT / d) for d in ("runtime", "workers", "compile", "graphs", "distributed")]
MAX_FILES = 14


def decode_step_walk(model: Path) -> tuple[list[str], int]:
    """(the walk's files in the order first reached, the number of package files the step runs
    before the kernel in all)."""
    llm = LLM(str(model), device="cpu", enforce_eager=True, num_kv_blocks=16)
    engine = llm.engine
    engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # a first decode step
    kernel, engine_file = (
        attention_ref.paged_attention_ref.__code__,
        LLMEngine.step.__code__.co_filename,
    )
    stack: list[str] = []
    walk: list[str] = []
    touched: set[str] = set()
    at_kernel: list[str] = []

    def profile(frame, event, arg) -> None:
        if at_kernel:
            return
        if event == "call":
            name = frame.f_code.co_filename
            stack.append(name)
            touched.add(name)
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename == engine_file:
                walk.append(name)
            if frame.f_code is kernel:
                at_kernel.extend(stack)
        elif event == "return" and stack:
            stack.pop()

    try:
        sys.setprofile(profile)
        engine.step()
    finally:
        sys.setprofile(None)
        llm.shutdown()
    assert at_kernel, "the step never reached the attention kernel"
    ours = [f for f in walk + at_kernel if any(f.startswith(d) for d in PACKAGE_DIRS)]
    files = list(dict.fromkeys(str(Path(f).relative_to(ROOT)) for f in ours))
    return files, len({f for f in touched if any(f.startswith(d) for d in PACKAGE_DIRS)})


def test_decode_step_walk_is_short_and_documented(tmp_path):
    files, touched = decode_step_walk(build_tiny_llama(tmp_path / "model"))
    assert len(files) <= MAX_FILES, files
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## The decode-step walk", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\d+\. `([^`]+)`", section, re.M)
    assert documented == files, f"docs/architecture.md lists {documented}, the step walks {files}"
    print(
        f"walk: {len(files)} files; the step runs code in {touched} package files before the kernel"
    )
