"""LaunchMemo's keying on CPU tensors: a launch with what Triton specializes on unchanged (dtypes,
16-byte alignment, scalar values, constexprs) reuses the kept compiled kernel and passes tensor
addresses; any change goes through the kernel's own dispatch again. The kernel here is a stand-in
that records calls (the real launcher needs CUDA: tests/gpu/test_decode_attention_gpu.py runs the
decode kernel's memo on a GPU against float64)."""

from __future__ import annotations

import torch

from atomrt.workers.kernels import launch


class Compiled:
    packed_metadata = "packed"
    function = "fn"

    def __init__(self, log: list):
        self.log = log

    def run(self, *args):
        self.log.append(("run", args))

    def launch_metadata(self, grid, stream, *args):
        return None


class Kernel:
    __name__ = "stand_in_kernel"
    arg_names = ["x_ptr", "y_ptr", "n", "BLOCK", "FLAG"]
    constexprs = [3, 4]

    class _Param:
        def __init__(self, default):
            self.default = default

    signature = type("Sig", (), {"parameters": {"FLAG": _Param(True)}})()

    def __init__(self):
        self.log: list = []

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.log.append(("dispatch", grid, args, kwargs))
            return Compiled(self.log)

        return dispatch


def test_the_memo_keys_on_what_triton_specializes(monkeypatch) -> None:
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    kernel = Kernel()
    memo = launch.LaunchMemo(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    consts = (("BLOCK", 32), ("num_warps", 4))
    memo((2, 1, 1), (x, y), (64,), consts)
    assert kernel.log[-1][0] == "dispatch" and (memo.hits, memo.misses) == (0, 1)

    x2, y2 = torch.ones(64), torch.ones(64)  # new tensors, same specialization
    memo((3, 1, 1), (x2, y2), (64,), consts)
    kind, args = kernel.log[-1]
    assert kind == "run" and (memo.hits, memo.misses) == (1, 1)
    assert args[:7] == (3, 1, 1, 7, "fn", "packed", None)
    # hooks, then addresses, scalars and constexprs (defaults filled), in signature order
    assert args[9:] == (x2.data_ptr(), y2.data_ptr(), 64, 32, True)

    for tensors, scalars, c in [
        ((x[1:], y), (64,), consts),  # a 4-byte-aligned pointer
        ((x.double(), y), (64,), consts),  # another dtype
        ((x, y), (65,), consts),  # another scalar value
        ((x, y), (64,), (("BLOCK", 64), ("num_warps", 4))),  # another constexpr
    ]:
        misses = memo.misses
        memo((1, 1, 1), tensors, scalars, c)
        assert memo.misses == misses + 1 and kernel.log[-1][0] == "dispatch"


def test_the_interpreter_launches_through_the_kernel_every_time(monkeypatch) -> None:
    class Interpreted(Kernel):
        def __getitem__(self, grid):
            def dispatch(*args, **kwargs):
                self.log.append(("dispatch", grid, args, kwargs))

            return dispatch

    kernel = Interpreted()
    memo = launch.LaunchMemo(kernel)
    x = torch.zeros(8)
    for _ in range(3):
        memo((1, 1, 1), (x, x), (8,), (("BLOCK", 8),))
    assert [e[0] for e in kernel.log] == ["dispatch"] * 3 and memo.hits == 0


def test_a_bound_launch_repeats_the_kept_one_on_the_given_stream(monkeypatch) -> None:
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    kernel = Kernel()
    memo = launch.LaunchMemo(kernel)
    x, y = torch.zeros(16), torch.zeros(16)
    args = ((4, 2, 1), (x, y), (16,), (("BLOCK", 8),))
    assert memo.bound(*args) is None  # nothing kept before the first launch
    memo(*args)
    bound = memo.bound(*args)
    bound(stream=99)
    kind, run_args = kernel.log[-1]
    assert kind == "run" and memo.hits == 1
    assert run_args[:4] == (4, 2, 1, 99)
    assert run_args[9:] == (x.data_ptr(), y.data_ptr(), 16, 8, True)
    assert bound.keep == ()  # the caller's tensors are not held
    kept = memo.bound(*args, keep=(y,))
    assert kept.keep == (y,)


def test_a_kernel_whose_constexprs_are_not_last_is_refused(monkeypatch) -> None:
    """The memo passes tensors, scalars, then constexpr values: a kernel laid out otherwise would
    get its arguments shifted, so its first launch says so."""
    import pytest

    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    kernel = Kernel()
    kernel.constexprs = [2, 4]  # a constexpr among the scalars
    memo = launch.LaunchMemo(kernel)
    x = torch.zeros(8)
    with pytest.raises(RuntimeError, match="then constexprs only"):
        memo((1, 1, 1), (x, x), (8,), (("BLOCK", 8),))


def test_launch_keeps_a_fitting_call_in_the_kernels_memo(monkeypatch) -> None:
    """`launch` sends a call of tensors, then scalars, then named constexprs through a LaunchMemo
    per kernel (its grid padded to three), so a repeat with new tensors runs the kept kernel."""
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    monkeypatch.setattr(launch, "_MEMOS", {})
    kernel = Kernel()
    x, y = torch.zeros(32), torch.zeros(32)
    launch.launch(kernel, (5,), x, y, 32, BLOCK=16, num_warps=2)
    assert kernel.log[-1][:2] == ("dispatch", (5, 1, 1))
    x2, y2 = torch.ones(32), torch.ones(32)
    launch.launch(kernel, (6,), x2, y2, 32, BLOCK=16, num_warps=2)
    kind, args = kernel.log[-1]
    assert kind == "run" and args[:4] == (6, 1, 1, 7)
    assert args[9:] == (x2.data_ptr(), y2.data_ptr(), 32, 16, True)
    assert launch._MEMOS[kernel].hits == 1


def test_launch_dispatches_a_call_no_memo_fits(monkeypatch) -> None:
    """A None argument (Triton specializes on it), a tensor after a scalar, a grid that is not a
    tuple of ints, or a kernel with a constexpr among its positional parameters: every such launch
    goes through the kernel's own dispatch, and none raises."""
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    monkeypatch.setattr(launch, "_MEMOS", {})
    monkeypatch.setattr(launch, "_FITS", {})
    x = torch.zeros(8)
    shifted = Kernel()
    shifted.constexprs = [2, 4]
    calls = [
        (Kernel(), (1,), (x, None, 8)),
        (Kernel(), (1,), (x, 8, x)),
        (Kernel(), lambda meta: (1,), (x, x, 8)),
        (shifted, (1,), (x, x, 8)),
    ]
    for kernel, grid, args in calls:
        for _ in range(2):
            launch.launch(kernel, grid, *args, BLOCK=8)
        assert [e[0] for e in kernel.log] == ["dispatch", "dispatch"]


def test_a_kept_launch_builds_metadata_only_for_a_hook_that_listens(monkeypatch) -> None:
    """Triton's default launch hooks are empty chains: a kept launch then passes no hooks and
    builds no launch metadata; once a profiler adds an enter hook, the launch passes that chain and
    the metadata, as Triton's own dispatch does (the exit chain, still empty, stays off)."""
    from triton.knobs import HookChain

    monkeypatch.setattr(launch, "_raw_stream", lambda index: 7)
    enter, exit_ = HookChain(), HookChain()
    knobs = type("Runtime", (), {"launch_enter_hook": enter, "launch_exit_hook": exit_})()
    monkeypatch.setattr(launch, "_runtime_knobs", lambda: knobs)
    asked: list = []

    class Described(Compiled):
        def launch_metadata(self, grid, stream, *args):
            asked.append(grid)
            return "meta"

    kernel = Kernel()
    memo = launch.LaunchMemo(kernel)
    x = torch.zeros(8)
    key = memo._key((x, x), [x.data_ptr(), x.data_ptr()], (8,), (("BLOCK", 8),))
    memo._kept[key] = (Described(kernel.log), (8, True))
    memo((1, 1, 1), (x, x), (8,), (("BLOCK", 8),))
    assert kernel.log[-1][1][6:9] == (None, None, None) and asked == []
    seen: list = []
    enter.add(seen.append)
    memo((2, 1, 1), (x, x), (8,), (("BLOCK", 8),))
    assert kernel.log[-1][1][6:9] == ("meta", enter, None) and asked == [(2, 1, 1)]
