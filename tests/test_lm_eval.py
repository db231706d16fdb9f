"""lm-evaluation-harness scores a model through `atomrt serve` as it scores the same weights in
transformers: its `local-completions` model (loglikelihood requests: token-id prompts, `echo`,
`logprobs`, `max_tokens: 1`) against its `hf` model, on a multiple-choice task of this test's own
(a local JSONL file and a task YAML), per choice and in accuracy."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from executor_harness import WORDS, build_tiny_llama, save_word_tokenizer
from test_server import CPU_FLAGS, Server

pytest.importorskip("lm_eval")

TASK = "atomrt_tiny_choice"
NUM_DOCS = 12


def write_task(folder: Path, greedy_word: Callable[[str], str]) -> Path:
    """A multiple-choice task over the tiny model's words: a question of several words and four
    one- or two-word continuations, one of them the answer; every other document has the model's
    own greedy next word among its choices (lm-eval's is_greedy)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    lines = []
    for _ in range(NUM_DOCS):
        question = " ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(4, 9)))
        choices = [
            " ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(1, 2))) for _ in range(4)
        ]
        if len(lines) % 2:
            choices[rng.randint(0, 3)] = greedy_word(question)
        lines.append(
            json.dumps({"question": question, "choices": choices, "answer": rng.randint(0, 3)})
        )
    data = folder / "docs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
target_delimiter: " "
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return folder


def per_choice(results: dict) -> list[list[tuple[float, bool]]]:
    """Each document's per-choice (loglikelihood, is greedy), in document order."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[(float(r[0]), bool(r[1])) for r in s["filtered_resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_through_the_server_matches_hf(tmp_path: Path, monkeypatch) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = save_word_tokenizer(build_tiny_llama(tmp_path / "model"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def greedy_word(question: str) -> str:
        ids = [WORDS.index(w) for w in question.split()]
        with torch.no_grad():
            return WORDS[int(hf(torch.tensor([ids])).logits[0, -1].argmax())]

    tasks = TaskManager(include_path=str(write_task(tmp_path / "task", greedy_word)))

    reference = simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32,device=cpu",
        tasks=[TASK],
        task_manager=tasks,
        batch_size=1,
        log_samples=True,
    )
    server = Server(["--model", str(folder), *CPU_FLAGS, "--served-model-name", "tiny"])
    try:
        served = simple_evaluate(
            model="local-completions",
            model_args=(
                f"model=tiny,base_url={server.url}/v1/completions,tokenizer={folder},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1"
            ),
            tasks=[TASK],
            task_manager=tasks,
            log_samples=True,
        )
    finally:
        assert server.stop() == 0
    want, got = per_choice(reference), per_choice(served)
    assert len(got) == len(want) == NUM_DOCS
    for doc, (w, g) in enumerate(zip(want, got)):
        assert [lp for lp, _ in g] == pytest.approx([lp for lp, _ in w], abs=1e-4), doc
        assert [greedy for _, greedy in g] == [greedy for _, greedy in w], doc
    assert any(greedy for doc in want for _, greedy in doc)  # the greedy check is exercised
    accuracy = [r["results"][TASK]["acc,none"] for r in (reference, served)]
    assert accuracy[0] == accuracy[1]
