"""mooncake_connector.json_in: JSON from outside whose only failure is
ValueError.  json.loads raised RecursionError for a value nested deeper
than Python's stack, which every `except ValueError` around a peer's
message, a metadata record or an upstream answer let through."""
import json

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


def _random_json_bytes(rng):
    """Seeded hostile JSON-ish bytes: deep or unbalanced nesting, junk,
    truncation, huge numbers, invalid UTF-8, and well-formed values."""
    kind = rng.randrange(6)
    if kind == 0:
        d = rng.choice([10, 999, 1001, 5000, 200000])
        return rng.choice([b"[", b"{\"a\":"]) * d + rng.choice([b"", b"]" * d, b"1"])
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if kind == 2:
        return b'{"0": {"engine_id": "' + rng.choice([b"::1:5", b"[::1]:5", b"h:99999", b"a:1",
                                                       b"\xff:1", b"[]:1"]) + b'"}}'
    if kind == 3:
        return b"9" * rng.randrange(1, 5000)
    if kind == 4:
        good = b'{"t":"target","tid":"x","n":0}'
        return good[:rng.randrange(len(good) + 1)]
    return rng.choice([b'{"0":{"engine_id":"a:1"}}', b'{"choices":[{"finish_reason":"error"}]}',
                       b'{"error":{"message":"x"}}', b"[]", b"null", b'"s"', b"NaN", b"1e999"])


def test_parsers_of_outside_json_on_random_bytes():
    """A seeded fuzz run (3,000 inputs) over the readers that take JSON from
    outside through json_in: a push message's header (push.decode), a
    bootstrap table (proxy_engines.parse_table), a peer record
    (peer_record.fetch), a decode's answer and stream event
    (proxy_retake.failed_answer, _event_verdict): each either parses or
    refuses with its own error, never another exception."""
    import random
    from types import SimpleNamespace
    from mooncake_connector.connector import peer_record, push
    from mooncake_connector.doctor.peer import _answer
    from mooncake_connector.proxy_engines import parse_table
    rng = random.Random(41)
    for i in range(3000):
        raw = _random_json_bytes(rng)
        try:
            push.decode(push.MAGIC + raw.replace(b"\n", b" ") + b"\n")
        except push.PushError:
            pass
        try:
            parse_table(raw)
        except ValueError:
            pass
        peer_record.fetch(SimpleNamespace(get=lambda k, raw=raw: raw), "e:1")
        try:  # doctor --peer's reading of the answer to its hello
            assert type(_answer(raw)) is int, i
        except ValueError:
            pass
        assert proxy_retake.failed_answer(rng.choice([200, 500]), raw) in (True, False), i
        assert proxy_retake._event_verdict(raw) in (None, proxy_retake.FAILED,
                                                   proxy_retake.RELAY), i


def test_the_plugins_reading_of_kv_transfer_config_takes_any_text():
    """vLLM's --kv-transfer-config text passes through the plugin (the
    seed's kv_rank/kv_parallel_size/kv_buffer_size moved into
    kv_connector_extra_config) before vLLM parses it: text nested deeper
    than Python's stack raised RecursionError out of vLLM's argument
    parsing (the plugin never raises); now it is left to vLLM, whose own
    parse names the problem."""
    from mooncake_connector.connector import plugin
    for text in ("[" * 100_000, '{"a":' * 50_000, "{not json", ""):
        assert plugin._move_seed_fields(text) == text
    seed = ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", '
            '"kv_connector_module_path": "mooncake_connector", "kv_rank": 0}')
    moved = json.loads(plugin._move_seed_fields(seed))
    assert moved["kv_connector_extra_config"] == {"kv_rank": 0} and "kv_rank" not in moved
