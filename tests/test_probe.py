"""The scheduler-side probe (connector/probe.py) against a real producer
engine in this process: how much of a prompt is held, a dead producer, and
a probe engine that cannot start (metadata server down)."""
import contextlib
import ctypes
from types import SimpleNamespace

import mooncake_connector as mc
from conftest import wait_until
from mooncake_connector.connector import probe as probe_mod
from mooncake_connector.connector import settings

BS = 16


def consumer_settings(**extra):
    ktc = SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=dict(
        {"decode_url": "127.0.0.1:400", "protocol": "tcp",
         "metadata_server": "P2PHANDSHAKE"}, **extra))
    return settings.resolve(ktc, env={})


@contextlib.contextmanager
def probe(**extra):
    """A ProducerProbe with consumer_settings(**extra), closed on the way out."""
    p = probe_mod.ProducerProbe(consumer_settings(**extra))
    try:
        yield p
    finally:
        p.close()


def test_probe_counts_what_the_producer_holds():
    buf = ctypes.create_string_buffer(8 * 4096)
    with mc.TransferEngine() as eng:
        eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        eng.register_memory(ctypes.addressof(buf), len(buf))
        lb = mc.LookupBuffer(1 << 20, block_size=BS)
        with mc.KVTransfer(eng, lb) as kv:
            toks = list(range(1000, 1000 + 3 * BS + 5))
            kv.send_kv(toks, [(ctypes.addressof(buf) + i * 4096, 4096, i) for i in range(3)])
            with probe(prefill_url=eng.get_segment_name()) as p:
                assert p.held_tokens(None, toks) == 3 * BS
                assert p.held_tokens(None, toks[:2 * BS] + [7] * BS) == 2 * BS
                assert p.held_tokens(None, [5] * (4 * BS)) == 0
                assert p.probes == 3 and p.failures == 0
                assert kv.stats()["probes_served"] == 3
                # Nothing was taken: the entry is still whole.
                assert lb.stats()["entries"] == 1 and lb.stats()["pinned_blocks"] == 0


def test_dead_producer_is_a_miss_and_backs_off():
    with probe(prefill_url="127.0.0.1:1", lookup_timeout_s=2.0) as p:
        assert p.held_tokens(None, list(range(64))) == 0
        assert p.held_tokens(None, list(range(64))) == 0
        assert p.probes == 1 and p.failures == 1  # the second one did not ask


def test_probe_engine_that_cannot_start_falls_back_then_retries(monkeypatch):
    with probe(prefill_url="127.0.0.1:1", metadata_server="http://127.0.0.1:1/metadata") as p:
        assert p.held_tokens(None, list(range(64))) is None  # unknown: load asynchronously
        assert p.held_tokens(None, list(range(64))) is None
        assert p.start_failures == 1                         # not retried at once
        monkeypatch.setattr(probe_mod, "RESTART_S", 0.0)
        p._broken_until = 0.0
        assert p.held_tokens(None, list(range(64))) is None
        assert p.start_failures == 2


def test_warm_up_makes_first_contact_and_a_first_contact_gets_longer():
    with mc.TransferEngine() as eng:
        eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        lb = mc.LookupBuffer(1 << 20, block_size=BS)
        with mc.KVTransfer(eng, lb) as kv:
            with probe(prefill_url=eng.get_segment_name(), lookup_timeout_s=0.25) as p:
                # Before any answer a probe may take the first contact's time.
                assert p.timeout_for(None) == probe_mod.FIRST_CONTACT_S
                p.warm()  # returns at once; the probe thread does the rest
                assert wait_until(lambda: kv.stats()["probes_served"] == 1)
                assert wait_until(lambda: p.timeout_for(None) == 0.25)
                assert p.failures == 0
                # Questions still work after the warm-up.
                p.ask("r1", None, list(range(2 * BS)))
                assert wait_until(lambda: not p.pending("r1"))
                assert p.answer("r1") == (True, 0)  # nothing published: holds 0


def test_warm_up_of_a_producer_not_up_yet_is_no_failure():
    with probe(prefill_url="127.0.0.1:1") as p:
        p.warm()
        assert wait_until(lambda: not p.pending(probe_mod.WARM))
        # No back-off and no failure: the first request asks for real.
        assert p.failures == 0 and not p._down_until
        assert p.timeout_for(None) == probe_mod.FIRST_CONTACT_S


def test_probe_thread_survives_an_engine_that_cannot_start(monkeypatch):
    # Through the scheduler's non-blocking interface: the first question
    # gets "cannot probe" (None: load asynchronously); once the start may be
    # retried, later questions are answered again (the thread was not shut
    # down by the failed start).
    with probe(prefill_url="127.0.0.1:1", metadata_server="http://127.0.0.1:1/metadata") as p:
        p.ask("a", None, list(range(64)))
        assert wait_until(lambda: p.pending("a") is False)
        assert p.answer("a") == (True, None)
        monkeypatch.setattr(probe_mod, "RESTART_S", 0.0)
        p._broken_until = 0.0
        p.ask("b", None, list(range(64)))
        assert wait_until(lambda: p.pending("b") is False, timeout=15)
        assert p.answer("b") == (True, None)
        assert p.start_failures == 2


def test_wait_returns_with_the_answer_and_not_for_a_forgotten_question():
    """wait() (the idle scheduler's probe_wait_ms) ends when the answer is
    in - the probe thread notifies - and says False for a question that was
    forgotten or never asked."""
    with mc.TransferEngine() as eng:
        eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        lb = mc.LookupBuffer(1 << 20, block_size=BS)
        with mc.KVTransfer(eng, lb) as kv:
            with probe(prefill_url=eng.get_segment_name()) as p:
                p.ask("a", None, [5] * (2 * BS))
                assert p.wait("a", 30.0)          # a live producer answers well within
                assert p.answer("a") == (True, 0)
                assert kv.stats()["probes_served"] >= 1
                assert not p.wait("never-asked", 30.0)
                p.ask("b", None, [6] * (2 * BS))
                p.forget("b")
                assert not p.wait("b", 30.0)
