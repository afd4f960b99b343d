"""Argument checks shared by the decoders and the data: one wording for one kind of error."""
from __future__ import annotations

import operator


def check_int(name: str, value, lowest: int) -> int:
    """`value` as an int >= lowest (numpy and 0-d torch integers too, never a bool or a float);
    otherwise a ValueError naming the argument."""
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or v < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
    return v
