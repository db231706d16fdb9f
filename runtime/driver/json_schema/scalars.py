"""Strings and integers: the formats the backend enforces (and exact patterns for those it
enforces loosely), a string length folded into a pattern, integer bounds and `multipleOf`."""

from __future__ import annotations

import math
import re
from typing import Any

from atomrt.runtime.driver.json_schema.keywords import never, refuse

# String formats the backend enforces (xgrammar's built-in patterns).
FORMATS = (
    "date",
    "date-time",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
)
# Formats whose backend pattern is looser than the format (leading zeros in an address, the 31st
# of February): these patterns instead, exact.
_BYTE = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d\d\d)"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
    rf"|02-(0[1-9]|1\d|2[0-8]))|{_LEAP}-02-29)"
)
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {
    "ipv4": rf"^({_BYTE}\.){{3}}{_BYTE}$",
    "date": rf"^{_DATE}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
}
INTEGER_MULTIPLE_OF_MAX = 1024  # xgrammar ignores (with a warning) an integer multipleOf above it
MAX_ENUM = 1024  # an integer multipleOf beside bounds becomes the enum of at most this many values
INTEGER_LIMIT = 2**53  # integer bounds past it are tightened to it (exact as a double)

# A pattern of one repeated character class (a length bound folds into it exactly)
_ONE_CLASS = re.compile(
    r"^\^?(?P<atom>\[(?:\\.|[^\]\\])+\]|\\[dwDW]|[A-Za-z0-9_ -])"
    r"(?P<quant>\*|\+|\?|\{\d+\}|\{\d+,\d*\})?\$?$"
)


def is_int(v: Any) -> bool:
    """An integer, or a float of an integer's value (not a bool)."""
    return not isinstance(v, bool) and (
        isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v == int(v))
    )


def string_keywords(out: dict, path: str) -> None:
    fmt = out.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise refuse(path, "format", f"{fmt!r} cannot be enforced (enforced: {', '.join(FORMATS)})")
    if fmt in FORMAT_PATTERNS:
        if "pattern" in out:
            raise refuse(path, "format", "beside 'pattern' cannot be enforced; keep one")
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
        fmt = None
        if "minLength" in out or "maxLength" in out:
            which = "minLength" if "minLength" in out else "maxLength"
            raise refuse(path, which, "beside 'format' cannot be enforced while decoding")
    lo, hi = out.get("minLength"), out.get("maxLength")
    for k, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (not is_int(v) or v < 0):
            raise refuse(path, k, "must be an integer >= 0")
    if lo is None and hi is None:
        return
    lo, hi = int(lo or 0), None if hi is None else int(hi)
    if hi is not None and lo > hi:
        raise never(path, f"minLength {lo} > maxLength {hi}")
    which = "minLength" if "minLength" in out else "maxLength"
    if fmt is not None:
        raise refuse(
            path,
            which,
            "beside 'format' cannot be enforced while decoding; put the length in a "
            "'pattern' instead of the format (or check it on the output)",
        )
    pattern = out.get("pattern")
    if pattern is None:  # the backend's own length rule (made JSON-safe: xgrammar_backend.py)
        out["minLength"] = lo
        if hi is not None:
            out["maxLength"] = hi
        return
    out.pop("minLength", None)
    out.pop("maxLength", None)
    m = _ONE_CLASS.match(pattern) if isinstance(pattern, str) else None
    if m is None:
        raise refuse(
            path,
            which,
            "beside 'pattern' cannot be enforced while decoding; put the length in the "
            "pattern (or check it on the output)",
        )
    q = m.group("quant") or "{1}"
    plo, phi = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(q, (None, None))
    if plo is None:
        a, _, b = q[1:-1].partition(",")
        plo, phi = int(a), (int(a) if not _ else (int(b) if b else None))
    lo2 = max(lo, plo)
    hi2 = phi if hi is None else (hi if phi is None else min(hi, phi))
    if hi2 is not None and lo2 > hi2:
        raise never(path, "the length bounds and the pattern's repeat count do not meet")
    out["pattern"] = f"^{m.group('atom')}{{{lo2},{'' if hi2 is None else hi2}}}$"


def integer_keywords(out: dict, path: str) -> None:
    """Bounds as inclusive integers (within +-2**53: the backend reads them as doubles);
    `multipleOf` beside a bound as the `enum` of its values (the backend drops it there)."""
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        v = out.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise refuse(path, k, "must be a number")
    lows = [math.ceil(out.pop("minimum"))] if "minimum" in out else []
    lows += [math.floor(out.pop("exclusiveMinimum")) + 1] if "exclusiveMinimum" in out else []
    highs = [math.floor(out.pop("maximum"))] if "maximum" in out else []
    highs += [math.ceil(out.pop("exclusiveMaximum")) - 1] if "exclusiveMaximum" in out else []
    lo = max(max(lows), -INTEGER_LIMIT) if lows else None
    hi = min(min(highs), INTEGER_LIMIT) if highs else None
    if lo is not None and hi is not None and lo > hi:
        raise never(path, f"no integer is >= {lo} and <= {hi}")
    m = out.pop("multipleOf", None)
    if m is not None:
        if not isinstance(m, (int, float)) or isinstance(m, bool) or m <= 0:
            raise refuse(path, "multipleOf", "must be a number > 0")
        if not is_int(m):
            raise refuse(path, "multipleOf", "is enforced on integers only when it is one")
        m = int(m)
    if m is not None and m > 1 and (lo is not None or hi is not None):
        if lo is None or hi is None or (hi - lo) // m + 1 > MAX_ENUM:
            raise refuse(
                path,
                "multipleOf",
                f"beside a bound is enforced where both bounds hold at most {MAX_ENUM} "
                "multiples (give 'minimum' and 'maximum', or an 'enum')",
            )
        values = list(range(-(-lo // m) * m, hi + 1, m))
        if not values:
            raise never(path, f"no multiple of {m} lies in [{lo}, {hi}]")
        out.pop("type", None)
        out["enum"] = values
        return
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    if m is not None and m > INTEGER_MULTIPLE_OF_MAX:
        raise refuse(path, "multipleOf", f"above {INTEGER_MULTIPLE_OF_MAX} cannot be enforced")
    if m is not None and m > 1:
        out["multipleOf"] = m
