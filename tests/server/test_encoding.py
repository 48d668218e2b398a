"""Request bodies through `encoding.loads`: every body reads as `json.loads` reads it, the same
values where it accepts one and the same error where it refuses one."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from typing import Any

import pytest

from flashrec_core.server.encoding import id_lists_as_tuples, loads

BODIES = [
    b'{"prompt": [1, 2, 3], "n": 50, "max_tokens": 3}',
    b'{"messages": [{"role": "user", "content": "caf\xc3\xa9 \\u00e9 \\ud83d\\ude00"}]}',
    b'{"a": 1, "a": 2}',  # the last duplicate wins
    b"[18446744073709551616, -9223372036854775809, 100000000000000000000000]",  # past 64 bits
    b"[1e400, -1e400, -1e-400, 5e-324, 0.1, 1.0000000000000002, 1E5, -0]",
    b'{"temperature": NaN, "t": Infinity, "u": -Infinity}',
    b'"\\ud800"',  # a lone surrogate, escaped
    b'"\xed\xa0\x80"',  # a lone surrogate, encoded
    b"\xef\xbb\xbf{}",  # a UTF-8 byte-order mark
    '{"a": "é"}'.encode("utf-16"),
    b'{"messages": [',
    b"[1, 2,]",
    b'{"a": "\x01"}',
    b'"\xff"',
    b"01",
    b"1" * 5000,  # past Python's limit on digits in an int
    b"[" * 5000 + b"]" * 5000,  # past the recursion limit
]


def _outcome(parse: Callable[[bytes], Any], body: bytes) -> tuple[Any, ...]:
    try:
        value = parse(body)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc), str(exc)
    return "read", repr(value)  # repr: tells 0 from -0.0, and a NaN equals itself


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_loads_reads_a_body_as_json_loads_does(body: bytes) -> None:
    assert _outcome(loads, body) == _outcome(json.loads, body)


def test_token_id_prompts_become_tuples_the_collector_untracks() -> None:
    body = loads(
        b'{"prompt": [5, 6, 7], "n": 2, "stop": ["a"], "batch": [[1, 2], [3]], "empty": [],'
        b' "messages": [{"role": "user", "content": "hi"}], "mixed": [1, "a"]}'
    )
    data = id_lists_as_tuples(body)
    assert data["prompt"] == (5, 6, 7) and data["batch"] == ((1, 2), (3,))
    # text, messages and empty lists are left as parsed, for validation to read as sent
    assert data["stop"] == ["a"] and data["empty"] == [] and isinstance(data["messages"], list)
    assert data["mixed"] == (1, "a")  # judged by its first element; validation refuses it
    gc.collect()
    gc.collect()  # a tuple of tuples is untracked one collection after its elements
    assert not gc.is_tracked(data["prompt"]) and not gc.is_tracked(data["batch"])
    assert id_lists_as_tuples([1, 2]) == [1, 2]  # only an object's fields
