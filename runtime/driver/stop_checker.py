"""Stop rules, applied by the scheduler to a sequence right after a token is appended.

Before a token is appended, `refused_token` checks it against the sequence's constraints (its
grammar, which advances on it, allowed_token_ids, bad_words): the sampler takes an allowed token
whenever one exists, so a refused token means none was (an unsatisfiable regex; a grammar whose
tokens allowed_token_ids or bad_words all remove), and the sequence ends "abort" with the error,
the token not emitted. Then, order: detokenize the token (not an EOS or stop token that ends
the sequence: its text is never output, unless include_stop_str_in_output); a constrained sequence
whose grammar accepted its end stops ("stop"); before min_tokens output tokens nothing but the
length limits stops a sequence; then EOS (unless ignore_eos), stop_token_ids, stop strings (the
output text is cut before the stop string unless include_stop_str_in_output), then max_tokens and
max_model_len ("length").
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


def refused_token(seq: Sequence, token_id: int) -> Optional[str]:
    """None when `token_id` satisfies seq's constraints (its grammar then advances on it); else
    the error that ends the sequence: which constraints allowed no token at this position."""
    params = seq.sampling_params
    grammar, allowed, bad_words = seq.grammar, params.allowed_token_ids, seq.bad_words_token_ids
    if grammar is None and not allowed and not bad_words:
        return None
    if allowed and seq.allowed_token_set is None:
        seq.allowed_token_set = frozenset(allowed)
    refused = (
        (allowed and token_id not in seq.allowed_token_set)
        or (bad_words and _completes_bad_word(seq, token_id))
        or (grammar is not None and not grammar.accept(token_id))
    )
    if not refused:
        return None
    names = [
        name
        for name, on in (
            ("structured_outputs", grammar is not None),
            ("allowed_token_ids", bool(allowed)),
            ("bad_words", bool(bad_words)),
        )
        if on
    ]
    logger.warning(
        "request %r: no token satisfies its %s at output token %d; ending it",
        seq.request_id,
        " + ".join(names),
        seq.num_output_tokens,
    )
    return (
        f"{' + '.join(names)}: no token satisfies {'it' if len(names) == 1 else 'them together'} "
        f"at output token {seq.num_output_tokens} (an unsatisfiable constraint), so the request "
        "ended without it"
    )


def _completes_bad_word(seq: Sequence, token_id: int) -> bool:
    """Whether `token_id` after seq's output so far ends one of its bad words."""
    for word in seq.bad_words_token_ids:
        if word[-1] != token_id:
            continue
        head = word[:-1]
        if not head or seq.token_ids[len(seq.token_ids) - len(head) :] == head:
            if len(head) <= seq.num_output_tokens:
                return True
    return False


def check_stop(
    seq: Sequence, token_id: int, max_model_len: Optional[int] = None
) -> Optional[FinishReason]:
    """Apply the stop rules to seq, whose last token is token_id. Returns the finish reason (and
    sets seq.stop_reason for stop tokens/strings) or None to keep going."""
    params = seq.sampling_params
    num_output = seq.num_output_tokens
    grammar_done = seq.grammar is not None and seq.grammar.is_terminated  # on a stop token
    stop_token = num_output >= params.min_tokens and (
        (not params.ignore_eos and token_id in seq.eos_token_ids)
        or token_id in params.stop_token_ids
    )
    new_chars = ""
    # the text of the EOS or stop token that ends the sequence is never output (vLLM's rule),
    # whatever skip_special_tokens, unless include_stop_str_in_output
    if seq.detokenizer is not None and (
        params.include_stop_str_in_output or not (stop_token or grammar_done)
    ):
        if params.stop:  # stop strings need the text now
            new_chars = seq.detokenizer.add_token(token_id)
        else:  # text is made when asked for (a finished or streamed output)
            seq.detokenizer.append_token(token_id)
    if grammar_done:  # it advanced in refused_token
        return "stop"
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
