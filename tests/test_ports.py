"""Ports picked for servers not yet listening: a deployment picks every port
(metadata server, engines, vLLM servers, proxies) before it starts any, so
a bind test alone handed the same port out twice (seen in CI: the metadata
server's port also became the prefill engine's, "Address already in use")."""
import socket

import pytest

from mooncake_connector import deployment, serving


def test_free_port_never_hands_out_a_port_twice():
    ports = [serving.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_port_pairs_avoid_ports_already_handed_out():
    taken = {serving.free_port() for _ in range(50)}
    for _ in range(10):
        p, d = deployment._port_pair(span=4)
        run = set(range(p, p + 4)) | set(range(d, d + 4))
        assert not run & taken, sorted(run & taken)
        taken |= run


def test_a_span_is_free_on_every_address_and_handed_out_whole():
    """free_port(span=4): the engine of TP rank r listens on 0.0.0.0:port+r."""
    p = serving.free_port(span=4)
    for q in range(p, p + 4):
        assert serving.port_claimed(q)
        with socket.socket() as s:
            s.bind(("0.0.0.0", q))
    later = {serving.free_port() for _ in range(300)}
    assert not later & set(range(p, p + 4))


def test_a_listener_on_another_local_address_makes_a_port_unusable():
    """The engine binds 0.0.0.0: a listener on 127.0.0.2 blocks it too."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        assert not serving._usable(port, 1, ())
        assert not serving._usable(port - 1, 2, ())


def test_away_keeps_the_config_distance():
    p = serving.free_port()
    for _ in range(100):
        d = serving.free_port(span=4, away=[p, f"127.0.0.1:{p + 120}"])
        assert abs(d - p) >= serving.PORT_DISTANCE and abs(d - p - 120) >= serving.PORT_DISTANCE


def test_port_range_holds_whole_spans(monkeypatch):
    lo = serving.free_port(span=12)
    monkeypatch.setattr(serving, "_CLAIMED", set())
    monkeypatch.setenv("MC_PORT_RANGE", f"{lo}-{lo + 11}")
    a = serving.free_port(span=4)  # 8 left beside it: one side holds another run of 4
    b = serving.free_port(span=4)
    assert lo <= a <= lo + 8 and lo <= b <= lo + 8 and abs(a - b) >= 4
    with pytest.raises(RuntimeError, match="MC_PORT_RANGE.*no free port.*run of 13"):
        serving.free_port(span=13)
    with pytest.raises(ValueError, match="span"):
        serving.free_port(span=0)


def test_xdist_worker_shares_split_free_ports_default_range():
    """Without MC_PORT_RANGE each pytest-xdist worker's share (tests/conftest.py)
    is a disjoint part of the range free_port() itself would pick from."""
    from conftest import _worker_port_share

    lo, hi = serving.default_port_range()
    assert (lo, hi) == (max(1024, serving.ephemeral_low() - 12000), serving.ephemeral_low() - 200)
    shares = [tuple(int(x) for x in _worker_port_share(w, 3).split("-")) for w in range(3)]
    assert shares[0][0] == lo and shares[-1][1] <= hi
    assert all(a[1] + 1 == b[0] for a, b in zip(shares, shares[1:]))
    assert _worker_port_share(1, 2, "40000-40999") == "40500-40999"
    with pytest.raises(ValueError, match="too small for 2 pytest-xdist workers"):
        _worker_port_share(0, 2, "40000-40099")
