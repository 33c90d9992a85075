"""The chaos soak's fault schedule (benchmarks/soak.py: Faults, Gate,
fault_verdict), without vLLM: session 16's 30-minute soak lost every P1
fault after P1's first restart fell into a link cut (the restarted server
could not reach etcd across the cut link, exited with the designed
"etcd unreachable" error, and the harness never brought it back).

P1 here is a real process (serving.Process) that behaves like a starting
vLLM server towards the link: it spends a moment "publishing to etcd" and
exits with an error if the link is cut meanwhile.  The link is a flag file
(the namespace and veth need root and are not what is under test: the
harness's schedule around them is)."""
import os
import sys
import textwrap
import threading
import time
import types

from mooncake_connector import serving
from soak_util import load_soak

sk = load_soak("soak_sched_mod")

SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    port, cut, fail = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if os.path.exists(fail):
        sys.exit("cannot start (told to fail)")
    for _ in range(8):   # 'publishing the segment to etcd' across the link
        if os.path.exists(cut):
            sys.exit("MetadataError: cannot publish segment: etcd unreachable")
        time.sleep(0.1)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


class FileLink:
    """The link as a flag file: cut() creates it, heal() removes it."""

    enabled = True

    def __init__(self, path):
        self.path = path

    def cut(self):
        open(self.path, "w").close()

    def heal(self):
        if os.path.exists(self.path):
            os.unlink(self.path)

    def clear_netem(self):
        pass


def _setup(tmp_path, attempts=3):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    cut, fail = str(tmp_path / "cut"), str(tmp_path / "fail")
    port = serving.free_port()
    p1 = serving.Process("P1", [sys.executable, str(script), str(port), cut, fail],
                         str(tmp_path / "P1.log"), health_url=f"http://127.0.0.1:{port}/")
    p1.url = f"http://127.0.0.1:{port}"
    servers = {"P1": p1}
    for n in ("P2", "D1", "D2"):  # never started: the fault's counter watch skips them
        servers[n] = serving.Process(n, ["true"], str(tmp_path / f"{n}.log"))
        servers[n].url = "http://127.0.0.1:9"
    c = types.SimpleNamespace(servers=servers, launcher=sk.Launcher(), restarting=set(),
                              etcd=None)
    args = types.SimpleNamespace(start_timeout=20.0, restart_attempts=attempts, cut_s=1.5,
                                 stop_s=1.0, netem_s=1.0, load_timeout_s=0.0, seed=1,
                                 faults="kill_prefill,link_cut", burst=0,
                                 burst_delay_s=(0.0, 0.0), fault_period=1.0, first_fault_s=0.0)
    f = sk.Faults(c, FileLink(cut), args, time.monotonic())
    c.launcher.start_all([p1], 20)
    return f, c, p1, fail


def _teardown(f, c, p1):
    f.stop_evt.set()
    for th in f.restart_threads:
        th.join(timeout=60)
    p1.stop(grace=2)
    c.launcher.close()


def test_a_link_cut_waits_for_a_restart_and_the_server_comes_back(tmp_path):
    """Session 16's order: P1 SIGKILLed (restart begins), a link cut right
    after.  The cut must wait until P1 is back: P1 alive, no fault error,
    the cut's start after the restart's end.  Before the fix the cut
    landed in the restart and P1 exited for good (this test then fails on
    `not p1.alive` and the "P1 restart" error)."""
    f, c, p1, _ = _setup(tmp_path)
    try:
        f.kill_prefill()
        f.link_cut()
        for th in f.restart_threads:
            th.join(timeout=60)
        assert not f.errors, f.errors
        assert not getattr(f, "harness_failures", []), f.harness_failures
        assert p1.alive, open(p1.log_path).read()[-2000:]
        kill, cut = f.events
        assert (kill["fault"], cut["fault"]) == ("kill_prefill", "link_cut")
        assert kill["end"] is not None and cut["start"] >= kill["end"], f.events
        # The next SIGKILL is injected too (not skipped).
        f.kill_prefill()
        for th in f.restart_threads:
            th.join(timeout=60)
        assert p1.alive and [e["fault"] for e in f.events].count("kill_prefill") == 2
    finally:
        _teardown(f, c, p1)


def test_a_server_that_cannot_come_back_is_retried_then_a_harness_failure(tmp_path):
    f, c, p1, fail = _setup(tmp_path, attempts=2)
    try:
        open(fail, "w").close()   # every restart attempt exits at once
        f.kill_prefill()
        for th in f.restart_threads:
            th.join(timeout=60)
        assert not p1.alive
        assert f.restarts["P1"] == {"ok": 0, "retried": 2, "failed": 1}, f.restarts
        assert len(f.harness_failures) == 1 and "after 2 attempts" in f.harness_failures[0]
        # The next P1 fault is not silently skipped: it raises (run() records it).
        try:
            f.kill_prefill()
            raise AssertionError("kill_prefill on a P1 that is down did not raise")
        except RuntimeError as e:
            assert "P1 is down" in str(e)
        counts, v = sk.fault_verdict(["kill_prefill", "link_cut"], f.events, f.errors,
                                     f.harness_failures)
        assert counts["kill_prefill"] == {"P1": 1} and counts["link_cut"] == {"veth (P1+P2)": 0}
        assert any("injected 0 times: ['link_cut']" in x for x in v), v
        assert any("did not come back" in x for x in v), v
    finally:
        _teardown(f, c, p1)


def test_fault_verdict_counts_per_kind_per_target_and_fails_a_missing_kind():
    ev = [{"fault": "kill_prefill", "target": "P1"}, {"fault": "stop_decode", "target": "D2"},
          {"fault": "kill_prefill", "target": "P1"}, {"fault": "netem"}]
    kinds = ["kill_prefill", "stop_decode", "etcd_restart", "netem"]
    counts, v = sk.fault_verdict(kinds, ev, [], [])
    assert counts == {"kill_prefill": {"P1": 2}, "stop_decode": {"D2": 1},
                      "etcd_restart": {"etcd": 0}, "netem": {"veth (P1+P2)": 1}}
    assert v == ["harness: planned fault kinds injected 0 times: ['etcd_restart']"]
    counts, v = sk.fault_verdict(kinds[:2], ev, [], [])
    assert v == []


def test_gate_keeps_restarts_and_disruptions_apart():
    g = sk.Gate()
    order = []
    with g.restart("P1", 5):
        def cut():
            with g.disruption("link_cut", 5):
                order.append("cut")
        th = threading.Thread(target=cut)
        th.start()
        time.sleep(0.3)
        order.append("restart done")
    th.join(5)
    assert order == ["restart done", "cut"]
    with g.disruption("link_cut", 5):
        try:
            with g.restart("P1", 0.3):
                raise AssertionError("restart began during a cut")
        except TimeoutError as e:
            assert "link_cut" in str(e)


def test_a_round_injects_every_kind_once_and_a_restart_only_reorders_it(tmp_path):
    """next_kind: while P1 restarts, the link cut and the etcd restart move
    behind the kinds that need not wait; each round still has every kind
    once.  While the host prefill P3 restarts, its own kind waits too."""
    f, c, p1, _ = _setup(tmp_path)
    try:
        f.kinds = list(sk.FAULTS)
        pending = []
        with f.gate.restart("P1", 5):
            got = [f.next_kind(pending) for _ in range(3)]
        got += [f.next_kind(pending) for _ in range(3)]
        assert got == ["stop_decode", "host_prefill", "netem", "kill_prefill", "etcd_restart",
                       "link_cut"]
        assert [f.next_kind(pending) for _ in range(6)] == list(sk.FAULTS)
        with f.gate.restart("P3", 5):
            got = [f.next_kind(pending) for _ in range(2)]
        got += [f.next_kind(pending) for _ in range(4)]
        assert got == ["kill_prefill", "stop_decode", "host_prefill", "etcd_restart",
                       "link_cut", "netem"]
    finally:
        _teardown(f, c, p1)


def test_host_prefill_is_stopped_then_killed_and_restarted_in_turn(tmp_path):
    """host_prefill (P3, the prefill outside the namespace: the same-host
    CPU path): its first injection SIGSTOPs P3 for stop_s (same process
    after, running again), its second SIGKILLs it and brings it back (a new
    process, counted in restarts); both counted against P3.  A soak
    without P3 (no host flow) plans no host_prefill."""
    f, c, p1, _ = _setup(tmp_path)
    script = tmp_path / "server.py"
    port = serving.free_port()
    p3 = serving.Process("P3", [sys.executable, str(script), str(port), str(tmp_path / "no"),
                                str(tmp_path / "nofail")], str(tmp_path / "P3.log"),
                         health_url=f"http://127.0.0.1:{port}/")
    p3.url = f"http://127.0.0.1:{port}"
    c.servers["P3"] = p3
    try:
        c.launcher.start_all([p3], 20)
        pid = p3.proc.pid
        states = []
        th = threading.Thread(target=lambda: (time.sleep(0.5), states.append(
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0])))
        th.start()
        f.host_prefill()
        th.join()
        assert states == ["T"], states           # stopped meanwhile
        assert p3.alive and p3.proc.pid == pid    # the same process, going again
        f.host_prefill()
        for t in f.restart_threads:
            t.join(timeout=60)
        assert p3.alive and p3.proc.pid != pid, open(p3.log_path).read()[-2000:]
        assert f.restarts["P3"] == {"ok": 1, "retried": 0, "failed": 0}, f.restarts
        stop, kill = f.events
        assert (stop["fault"], stop["target"], kill["fault"], kill["target"]) == (
            "host_prefill", "P3", "host_prefill", "P3"), f.events
        assert "SIGSTOP P3" in stop["detail"] and "SIGKILL to P3" in kill["detail"], f.events
        assert not f.errors and not f.harness_failures
        counts, v = sk.fault_verdict(["host_prefill"], f.events, f.errors, f.harness_failures)
        assert counts == {"host_prefill": {"P3": 2}} and v == []
        del c.servers["P3"]
        args = types.SimpleNamespace(**{**vars(f.args), "faults": ",".join(sk.FAULTS)})
        assert "host_prefill" not in sk.Faults(c, FileLink(tmp_path / "x"), args, 0).kinds
        c.servers["P3"] = p3
        assert "host_prefill" in sk.Faults(c, FileLink(tmp_path / "x"), args, 0).kinds
    finally:
        p3.stop(grace=2)
        _teardown(f, c, p1)
