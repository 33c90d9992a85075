"""mooncake_connector.json_in: JSON from outside whose only failure is
ValueError.  json.loads raised RecursionError for a value nested deeper
than Python's stack, which every `except ValueError` around a peer's
message, a metadata record or an upstream answer let through."""
import pytest

from mooncake_connector import json_in, proxy_retake

DEEP = b"[" * 100000 + b"]" * 100000


def test_loads_refuses_deep_nesting_as_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        json_in.loads(DEEP)
    with pytest.raises(ValueError):
        json_in.loads(b"{nope")
    assert json_in.loads(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    assert json_in.loads("[[1]]") == [[1]]


def test_the_proxys_reading_of_a_decode_answer_survives_deep_nesting():
    """A decode's answer nested too deeply is not a failed answer to take
    again and a stream event of that shape is relayed as sent (were:
    RecursionError out of the proxy's relay)."""
    assert proxy_retake.failed_answer(500, DEEP) is False
    assert proxy_retake._event_verdict(DEEP) == proxy_retake.RELAY
