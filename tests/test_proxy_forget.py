"""The proxy's forget (flows a, b) against a decode that does not answer:
stopped (SIGSTOP), overloaded (503), killed (nothing listens) and
restarted, or gone for good.  The decode is a process of its own
(tests/forget_decode.py) that answers with the connector's own ledger
(connector/legs.LegLedger); the prefill a vLLM-shaped stand-in recording
the releases it gets (tests/test_proxy.py's vllm_like).  What is checked is
where the prompt's hold goes: released at the prefill (its mc_release
request) or left to the prefill's hold_timeout_s (120 s by default,
longer than every test here), never a timing."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import in_threads, sigstop, wait_until
from test_proxy import (_releases, get_stats, post, stream_to_the_decode_leg,  # noqa: F401
                        vllm_like)  # (a fixture)

from mooncake_connector.serving import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


class Decode:
    """tests/forget_decode.py on a port of its own, restartable there."""

    def __init__(self, mode, n503=0):
        self.port, self.mode, self.n503 = free_port(), mode, n503
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = None
        self.start()

    def start(self):
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "forget_decode.py"),
                                   str(self.port), self.mode, str(self.n503)],
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def legs(self):
        with urllib.request.urlopen(self.url + "/legs", timeout=10) as r:
            return json.loads(r.read())["legs"]

    def kill(self):
        self.p.kill()
        self.p.wait()

    def close(self):
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.kill()


@pytest.fixture
def proxy(tmp_path):
    """The proxy (test_proxy's fixture, but its log goes to a file, read by
    proxy.log(): a pipe nobody reads stops a proxy that logs 1,000
    requests)."""
    procs = []

    def start(prefill, decode, flow="a", extra=(), preexec_fn=None):
        log = tmp_path / f"proxy{len(procs)}.log"
        p = subprocess.Popen([sys.executable, "-m", "mooncake_connector.proxy", "--host",
                              "127.0.0.1", "--port", "0", *extra, "--flow", flow,
                              "--prefill", *prefill, "--decode", *decode],
                             stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                             preexec_fn=preexec_fn)
        procs.append(p)
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line + log.read_text()
        start.log = log.read_text
        return f"http://127.0.0.1:{m.group(1)}"

    yield start
    for p in procs:
        p.terminate()
        p.wait()


@pytest.fixture
def decode():
    made = []

    def make(mode, n503=0):
        d = Decode(mode, n503)
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()


def test_a_decode_stopped_past_a_forgets_wait_is_asked_again(vllm_like, proxy, decode):
    """The client leaves while its decode is SIGSTOPped, for longer than one
    question waits (--forget-timeout-s: 1 s here, 10 s by default; the old
    proxy's only question waited 30 s, then the prompt stayed held until
    the prefill's hold_timeout_s).  The proxy asks again (0.5 s, doubling)
    with the same ask id: two questions go unanswered while the decode is
    stopped, and nothing is released; once the decode runs again, its
    ledger answers "unseen" (the leg never reached its connector) to every
    copy of the question, and the prefill gets its release."""
    p, d = vllm_like("prefill"), decode("drop")
    url = proxy([p.url], [d.url], extra=["--forget-timeout-s", "1"])
    s = stream_to_the_decode_leg(url, d.legs)
    sigstop(d.p.pid)
    s.close()  # the client leaves: the proxy asks the stopped decode
    assert wait_until(lambda: get_stats(url)["decode_forgets_sent"] >= 1, timeout=10)
    # the first question and its first repeat waited their 1 s out; a third is asked
    assert wait_until(lambda: get_stats(url)["decode_forgets_retried"] >= 2, timeout=20), \
        get_stats(url)
    assert _releases(p) == []
    os.kill(d.p.pid, signal.SIGCONT)
    assert wait_until(lambda: _releases(p), timeout=20), get_stats(url)
    st = get_stats(url)
    assert st["decode_forgets_retried"] >= 2 and st["decode_forgets_unseen_late"] == 1, st
    assert st["decode_forgets_in_flight"] == 0, st
    assert len(_releases(p)) == 1


@pytest.mark.parametrize("flow", ["a", "b"])
def test_a_killed_decode_is_asked_until_it_is_back(vllm_like, proxy, decode, flow):
    """The decode dies before any output (its leg's stream breaks): its
    address refuses connections.  That is not taken as "gone: release"
    (vLLM's engine core outlives its API server's socket for a while, and
    a Service/load-balancer address refuses while its servers live: a later
    pull would take another request's entry): the proxy asks again and
    releases nothing while refused.  A decode restarted on that address has
    a fresh ledger: "unseen" (it cannot have the old leg), and the prefill
    gets its release."""
    p, d = vllm_like("prefill"), decode("drop")
    url = proxy([p.url], [d.url], flow=flow)
    s = stream_to_the_decode_leg(url, d.legs)
    d.kill()  # the leg's stream breaks: the proxy asks the dead decode
    assert wait_until(lambda: get_stats(url)["decode_forgets_sent"] >= 1, timeout=10)
    time.sleep(3)  # refused, again and again: nothing released
    assert _releases(p) == []
    asked = get_stats(url)  # (its counters after the release: the old proxy's lack them)
    d.start()
    assert wait_until(lambda: _releases(p), timeout=20), get_stats(url)
    st = get_stats(url)
    assert st["decode_forgets_retried"] >= 2 and st["decode_forgets_unseen_late"] == 1, st
    assert st["decode_forgets_in_flight"] == 0 and asked["decode_forgets_in_flight"] == 1, st
    assert len(_releases(p)) == 1
    log = proxy.log()  # INFO: the decode, and what happens to the hold
    assert f"decode {d.url} did not answer a forget about leg" in log, log
    assert f"the prefill {p.url} holds the prompt meanwhile" in log, log
    assert f"'unseen'; the prefill {p.url} releases the prompt now" in log, log
    s.close()


def test_a_decode_gone_for_good_is_given_up_at_forget_retry_s(vllm_like, proxy, decode):
    """A decode that never comes back: asked until --forget-retry-s after
    the prefill's answer, then given up (counted); the prompt stays held
    until the prefill's hold_timeout_s, nothing released."""
    p, d = vllm_like("prefill"), decode("drop")
    url = proxy([p.url], [d.url], extra=["--forget-retry-s", "3"])
    s = stream_to_the_decode_leg(url, d.legs)
    d.kill()
    assert wait_until(lambda: get_stats(url)["decode_forgets_gave_up"] == 1, timeout=20)
    st = get_stats(url)
    assert st["decode_forgets_retried"] >= 2 and st["decode_forgets_in_flight"] == 0, st
    time.sleep(1.0)
    assert _releases(p) == [] and get_stats(url)["decode_forgets_sent"] == \
        st["decode_forgets_sent"]
    assert "holds the prompt until its hold_timeout_s" in proxy.log() and \
        "given up (--forget-retry-s 3)" in proxy.log()
    s.close()


def test_a_decode_answering_seen_late_is_never_released(vllm_like, proxy, decode):
    """The leg reached the decode's connector (it pays for the prompt by
    its own pull or release), but the decode answers the first forgets 503
    (overloaded): asked again, it answers "seen", and the proxy releases
    nothing, and asks no more."""
    p, d = vllm_like("prefill"), decode("arrive", n503=3)
    url = proxy([p.url], [d.url])
    s = stream_to_the_decode_leg(url, d.legs)
    s.close()
    assert wait_until(lambda: get_stats(url)["decode_forgets_seen_late"] == 1, timeout=20), \
        get_stats(url)
    st = get_stats(url)
    assert st["decode_forgets_retried"] == 3 and st["decode_forgets_sent"] == 4, st
    assert st["decode_forgets_in_flight"] == 0 and st["decode_forgets_unseen"] == 0, st
    time.sleep(1.0)
    assert _releases(p) == [] and get_stats(url)["decode_forgets_sent"] == 4


def test_forgets_in_flight_are_capped_with_a_dead_decode(vllm_like, proxy):
    """1,000 requests whose decode is dead (nothing listens: every decode
    leg is refused, every forget asked again): at most --forget-max forgets
    are in flight; the rest are not sent, counted (the prefill frees those
    prompts at its hold_timeout_s), so a decode outage under load costs the
    proxy bounded memory."""
    p = vllm_like("prefill")
    dead = f"http://127.0.0.1:{free_port()}"
    url = proxy([p.url], [dead], extra=["--forget-max", "50", "--forget-retry-s", "60"])
    codes = []

    def client(i):
        for _ in range(100):
            codes.append(post(url + "/v1/completions",
                              {"model": "m", "prompt": "a b c", "max_tokens": 5})[0])
    in_threads(client, 10)
    assert codes == [502] * 1000
    st = get_stats(url)
    assert st["decode_forgets_in_flight"] == 50, st
    assert st["decode_forgets_dropped"] == 950, st
    assert wait_until(lambda: get_stats(url)["decode_forgets_retried"] >= 100, timeout=10)
    st = get_stats(url)
    assert st["decode_forgets_in_flight"] == 50 and st["decode_forgets_gave_up"] == 0, st
    assert _releases(p) == []


def test_forgets_take_at_most_a_quarter_of_the_upstream_connections(vllm_like, proxy):
    """A question to a stopped decode holds an upstream connection for up
    to --forget-timeout-s: under an open-file limit of 1,024 (448 upstream
    connections) --forget-max is cut to 112, so forgets never starve the
    requests of connections."""
    import resource

    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    p = vllm_like("prefill")
    proxy([p.url], [f"http://127.0.0.1:{free_port()}"], preexec_fn=low)
    assert "--forget-max 112: a quarter of the upstream connections (448)" in proxy.log()


@pytest.mark.parametrize("args,says", [
    (["--forget-retry-s", "-1"], "--forget-retry-s must be a number of seconds >= 0"),
    (["--forget-retry-s", "inf"], "--forget-retry-s must be a number of seconds >= 0"),
    (["--forget-timeout-s", "0"], "--forget-timeout-s must be a number of seconds > 0"),
    (["--forget-max", "0"], "--forget-max must be an integer >= 1")])
def test_bad_forget_options_are_refused(args, says):
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--prefill",
                        "http://p:1", "--decode", "http://d:2", *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and says in r.stderr, r.stderr
