"""Argument checks shared by the decoders and the data: one wording for one kind of error."""
from __future__ import annotations

import numbers
import operator

# The largest BPE vocabulary train_bpe (and a text run's text_vocab) takes. HF tokenizers' trainer
# reserves about 70 bytes of hash table per vocabulary entry before it reads a document (measured: vocab 10**8 reserves 6.6 GB,
# 10**9 asks for 70 GB and aborts the process; past 2**63 it panics), so the bound keeps that
# reservation under about 100 MB. 2**20 is four times the largest vocabulary of production language
# models (262144), and the model's embedding table at that size is already larger than its layers.
MAX_VOCAB = 1 << 20


class TokenIdError(IndexError, ValueError):
    """A token id outside the model's vocabulary: an IndexError, as torch's embedding lookup raises
    for one, and a ValueError, as every other bad value of an argument here is."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError by Python's convention, and a ValueError, as the
    argument checks here raised (and callers caught) before the two were told apart."""


def is_int(value) -> bool:
    """An int and not a bool (bool is an int subclass: True would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, lowest: int) -> int:
    """`value` as an int >= lowest (numpy and 0-d torch integers too, never a bool or a float);
    otherwise an error naming the argument: ArgumentTypeError for another type, ValueError for an
    int below `lowest`."""
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None or v < lowest:
        raise (ArgumentTypeError if v is None else ValueError)(f"{name} must be an int >= {lowest}, got {short(value)}")
    return v


def plain_number(value):
    """A numpy scalar as the Python bool, int or float it holds (a config read through numpy passes
    np.bool_, np.int64 and np.float32); anything else as it is, for the caller's checks (a bool
    stays one)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # numpy 2, 1
        return bool(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, int):
        return operator.index(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        return float(value)
    return value


def short(value, limit: int = 200) -> str:
    """repr(value) bounded in depth, width and length (reprlib, then cut to `limit` characters): an
    error message quotes what it was given, but a hostile value (a YAML file of nested aliases, a
    huge list) must not make the message itself huge."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = limit
    try:
        text = r.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<{type(value).__name__} of about {value.bit_length() * 0.30103:.0f} digits>" if isinstance(value, int) \
            else f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
