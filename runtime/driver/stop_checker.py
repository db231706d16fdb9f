"""Stop rules, applied by the scheduler to a sequence right after a token is appended.

Order: detokenize the token; a constrained sequence's grammar advances on it, and one that accepted
its end stops the sequence ("stop"); before min_tokens output tokens nothing but the length limits
stops a sequence; then EOS (unless ignore_eos), stop_token_ids, stop strings (the output text is cut
before the stop string unless include_stop_str_in_output), then max_tokens and max_model_len ("length").
The token that completes a stop string stays in token_ids; only the text is cut.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Optional

from atomrt.runtime.driver.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)


def find_stop_string(text: str, num_new_chars: int, stop: Seq[str]) -> Optional[tuple[int, str]]:
    """The earliest stop string that ends within the last num_new_chars characters of text:
    (index where it starts, the stop string), or None. Earlier text was already checked."""
    if num_new_chars <= 0:
        return None
    best: Optional[tuple[int, str]] = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def check_stop(
    seq: Sequence, token_id: int, max_model_len: Optional[int] = None
) -> Optional[FinishReason]:
    """Apply the stop rules to seq, whose last token is token_id. Returns the finish reason (and
    sets seq.stop_reason for stop tokens/strings) or None to keep going."""
    params = seq.sampling_params
    new_chars = ""
    if seq.detokenizer is not None:
        if params.stop:  # stop strings need the text now
            new_chars = seq.detokenizer.add_token(token_id)
        else:  # text is made when asked for (a finished or streamed output)
            seq.detokenizer.append_token(token_id)
    grammar = seq.grammar
    if grammar is not None:
        if not grammar.accept(token_id):  # the mask allowed it: a worker broke the contract
            logger.error(
                "request %r: token %d is outside its grammar; ending it", seq.request_id, token_id
            )
            return "abort"
        if grammar.is_terminated:
            return "stop"
    num_output = seq.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if params.stop and seq.detokenizer is not None:
            hit = find_stop_string(seq.detokenizer.output_text, len(new_chars), params.stop)
            if hit is not None:
                seq.detokenizer.truncate(
                    hit[0] + (len(hit[1]) if params.include_stop_str_in_output else 0)
                )
                seq.stop_reason = hit[1]
                return "stop"
    if num_output >= params.max_tokens:
        return "length"
    if max_model_len is not None and seq.num_tokens >= max_model_len:
        return "length"
    return None
