"""Shared test set-up.

Triton kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 must be set before
`triton` is first imported, so it is set here, before any test module imports atomrt, whenever no
CUDA device is present.
"""

import os

import pytest


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
