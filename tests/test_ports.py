"""Ports picked for servers not yet listening: a deployment picks every port
(metadata server, engines, vLLM servers, proxies) before it starts any, so
a bind test alone handed the same port out twice (seen in CI: the metadata
server's port also became the prefill engine's, "Address already in use")."""
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
