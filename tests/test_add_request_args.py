"""`add_request`'s two forms bound by name (runtime/driver/request.py): vLLM's `(request_id,
prompt, params, ...)` and the older `(prompt, params, request_id, stream)`, and the TypeError or
ValueError naming what is wrong."""

from __future__ import annotations

import pytest

from atomrt.runtime.driver.request import bind_add_request
from atomrt.runtime.sampling_params import RequestOutputKind, SamplingParams


def test_both_forms_bind_by_name() -> None:
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    got = bind_add_request(("r1", "hi", params), {})
    assert got == ("hi", params, "r1", RequestOutputKind.DELTA)
    got = bind_add_request((), {"request_id": "r2", "prompt": [1, 2]})
    assert got.prompt == [1, 2] and got.request_id == "r2"
    assert got.kind is RequestOutputKind.FINAL_ONLY
    older = bind_add_request(("hi", params), {"stream": True})
    assert older == ("hi", params, None, True)
    assert bind_add_request(("hi",), {}).kind is False


@pytest.mark.parametrize(
    "args,kwargs,error",
    [
        (("hi", None, "id", False, 1), {}, "at most 4 arguments"),
        (("r", "hi", None, 0, None, None, None, 0, 1), {}, "at most 8 arguments"),
        (("hi",), {"seed": 1}, "unexpected or repeated argument 'seed'"),
        (("r", "hi", None), {"prompt": "x"}, "unexpected or repeated argument 'prompt'"),
        ((), {"params": None}, "missing the prompt"),
        ((), {"prompt": "hi"}, "missing request_id"),
    ],
)
def test_a_bad_call_is_a_type_error_naming_the_argument(args, kwargs, error) -> None:
    with pytest.raises(TypeError, match=error):
        bind_add_request(args, kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"lora_request": object()}, "lora_request"), ({"priority": 1}, "priority")],
)
def test_what_atomrt_does_not_serve_is_a_value_error_naming_it(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        bind_add_request(("r", "hi", SamplingParams()), kwargs)
