"""Shared test set-up.

Triton kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 must be set before
`triton` is first imported, so it is set here, before any test module imports atomrt, whenever no
CUDA device is present.

Kernel tests pick their device from tests/kernel_device.py: DEVICE is "cuda" when a GPU is present
(the compiled kernels run) and "cpu" otherwise (the interpreter runs them). They build their tensors
there and compare against float64 references on the CPU; a test that checks CPU-only behaviour
keeps "cpu" and says why, and one that cannot hold on CUDA is skipped there, saying why.

The CPU tests run several processes (mp and Ray ranks, servers) on few cores: OpenMP threads that
spin while they wait for work take the cores their peers need (a rank's step ran 10-35x slower),
so OMP_WAIT_POLICY=PASSIVE is set here, before torch is imported, for this process and its children.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a set-up error reported by pytest
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are deselected by default (pyproject addopts); asked for without CUDA, they skip saying why."""
    if _cuda_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multigpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine"))


@pytest.fixture(scope="session")
def embedded_hf():
    """transformers' own model of the embedded GGUF (float32, eager attention), loaded once: the
    reference several test modules compare the engine with (its dequantizing load is slow on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from atomrt.workers.loading.loader import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def tiny_bpe_server(tmp_path_factory: pytest.TempPathFactory):
    """`atomrt serve` on grammar_harness's tiny BPE Llama, plain flags, served as "tiny": started
    once for the modules whose requests leave nothing another module reads (a server's start-up,
    its first constrained request and its shutdown take ~10 s on the 2-core machine)."""
    from grammar_harness import build_tiny_bpe
    from test_server import CPU_FLAGS, Server

    folder = build_tiny_bpe(tmp_path_factory.mktemp("tiny-bpe-server") / "model")
    server = Server(["--model", str(folder), *CPU_FLAGS, "--served-model-name", "tiny"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def tiny_bpe_tools_server(tmp_path_factory: pytest.TempPathFactory):
    """The same server with the hermes tool-call parser and a 1 s grammar compile budget (what
    test_structured_server's 503 test needs; the other users' grammars compile in milliseconds),
    started once for the tool-calling modules."""
    from grammar_harness import build_tiny_bpe
    from test_server import CPU_FLAGS, Server

    folder = build_tiny_bpe(tmp_path_factory.mktemp("tiny-bpe-tools-server") / "model")
    args = ["--model", str(folder), *CPU_FLAGS, "--served-model-name", "tiny"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--set", "structured_outputs_config.grammar_compile_timeout_s=1.0"]
    server = Server(args)
    yield server
    assert server.stop() == 0
