"""connector/legs.py: the decode side's ledger of flow a/b decode legs,
which answers the proxy's "mc_forget" (harness with vLLM's scheduler:
tests/test_abort_release.py; real servers: tests/test_e2e_abort_release.py).
Here: its verdicts, and that it stays bounded (a record lives MEMORY_S after
its request ended; a running request's record is kept; MAX_RECORDS caps it)."""
from mooncake_connector.connector import legs
from mooncake_connector.connector.legs import LegLedger, carries


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_carries_matches_vllms_request_ids_only_on_whole_dashes():
    assert carries("cmpl-mc-7-0-1a2b3c4d", "mc-7")
    assert carries("chatcmpl-mc-7-1a2b3c4d", "mc-7")
    assert carries("3_cmpl-mc-7-0-1a2b3c4d", "mc-7")   # a parallel-sampling child
    assert not carries("cmpl-mc-70-0-1a2b3c4d", "mc-7")
    assert not carries("cmpl-xmc-7-0-1a2b3c4d", "mc-7")
    # vLLM with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1: no random part
    assert carries("cmpl-mc-7-0", "mc-7", False) and carries("chatcmpl-mc-7", "mc-7", False)
    assert not carries("cmpl-mc-7-0", "mc-7", True)


def test_a_client_id_inside_another_request_id_names_only_its_own():
    """A client picks its X-Request-Id: "0" is inside every completion's
    vLLM request id ("cmpl-<id>-0-<random>"), "victim" inside "victim-2"'s.
    Only vLLM's whole forms of an id name a request: the substring test
    released (prefill) or answered for (decode) other clients' requests."""
    other = "cmpl-4f1e9c2ab-0-1a2b3c4d"
    # The decode's ledger: a forget about "0" finds nothing of the other's.
    lg = LegLedger(Clock())
    assert lg.arrived(other)
    assert lg.forget("0") == "unseen"                   # "0"'s leg never came
    assert lg.finished(other, paid=False) is False      # not asked about: nothing owed
    assert lg.forget("4f1e9c2ab") == "unseen"           # its own: ended owing its pull
    assert lg.arrived("cmpl-0-0-5e6f7a8b") is False     # "0"'s own, late: forgotten
    for mode in (True, None):
        assert not carries(other, "0", mode) and not carries(other, "1a2b3c4d", mode)
        assert not carries(other, "4f1e9c2ab-0", mode)
        assert not carries("cmpl-victim-2-0-1a2b3c4d", "victim", mode)
        assert not carries("chatcmpl-victim-2-1a2b3c4d", "victim", mode)
        assert not carries("cmpl-a-release-0-1a2b3c4d", "a", mode)  # the proxy's release
    # The proxy's own "<id>-<8 hex>" (an id already in flight) where vLLM
    # keeps ids as given: another request than "<id>"'s.
    assert not carries("chatcmpl-foo-0a1b2c3d", "foo", False)


def test_verdicts():
    lg = LegLedger(Clock())
    assert lg.arrived("cmpl-a-0-1a2b3c4d")
    lg.finished("cmpl-a-0-1a2b3c4d", paid=False)    # ended owing its pull (here: below)
    assert lg.forget("a") == "unseen"
    assert lg.forget("a") == "seen"          # paid by the first answer
    assert lg.forget("b") == "unseen"        # never came
    assert lg.forget("b") == "seen"
    assert not lg.arrived("cmpl-b-0-1a2b3c4d")      # came late: neither loads nor releases
    assert not lg.arrived("cmpl-b-0-1a2b3c4d")      # asked again: the same
    lg.finished("cmpl-b-0-1a2b3c4d", paid=False)
    assert lg.forget("b") == "seen"
    assert lg.arrived("cmpl-c-0-1a2b3c4d")
    lg.finished("cmpl-c-0-1a2b3c4d", paid=True)
    assert lg.forget("c") == "seen"


def test_seen_while_here_pays_at_its_end():
    """A forget answered "seen" about a request still here (its flow-a
    probe out, say): the proxy releases nothing, so that request, ending
    without a pull or a release, must release itself (finished() True),
    once; kept past MEMORY_S while it runs."""
    clk = Clock()
    lg = LegLedger(clk)
    assert lg.arrived("cmpl-a-0-1a2b3c4d") and lg.arrived("cmpl-b-0-1a2b3c4d")
    assert lg.forget("a") == "seen" and lg.forget("b") == "seen"
    assert lg.forget("a") == "seen"          # asked twice while here: the same
    clk.t += legs.MEMORY_S + 1
    assert lg.forget("other") == "unseen"    # prunes: the asked ones still run
    assert lg.finished("cmpl-a-0-1a2b3c4d", paid=False) is True
    assert lg.finished("cmpl-a-0-1a2b3c4d", paid=False) is False   # once
    assert lg.finished("cmpl-b-0-1a2b3c4d", paid=True) is False    # its pull paid
    assert lg.forget("a") == "seen" and lg.forget("b") == "seen"
    assert lg.arrived("cmpl-c-0-1a2b3c4d")
    assert lg.finished("cmpl-c-0-1a2b3c4d", paid=False) is False   # not asked: "unseen" pays
    assert lg.forget("c") == "unseen"


def test_bounded_by_time_and_size(monkeypatch):
    clk = Clock()
    lg = LegLedger(clk)
    lg.arrived("cmpl-run-0-1a2b3c4d")               # still running after MEMORY_S
    for i in range(100):
        lg.arrived(f"cmpl-r{i}-0-5e6f7a8b")
        lg.finished(f"cmpl-r{i}-0-5e6f7a8b", paid=True)
        lg.forget(f"gone{i}")
    assert len(lg) == 201
    clk.t += legs.MEMORY_S + 1
    assert lg.forget("run") == "seen"        # the running one is kept
    assert len(lg) == 1                      # only it: the others are older than MEMORY_S
    monkeypatch.setattr(legs, "MAX_RECORDS", 50)
    for i in range(200):
        lg.arrived(f"cmpl-s{i}-0-5e6f7a8b")
        lg.forget(f"t{i}")
    assert len(lg) <= 100


def _consumer(**kw):
    import types
    from mooncake_connector.connector import settings as settings_mod
    from mooncake_connector.connector.scheduler import SchedulerSide
    cfg = types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={
        "prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", "flow_a": False})
    return SchedulerSide(settings_mod.resolve(cfg), 32, 1, lambda: None, block_bytes=32768, **kw)


def _forget_req(xid):
    import types
    return types.SimpleNamespace(request_id="cmpl-mc-forget-1-0-aaaaaaaa", prompt_token_ids=[7],
                                 kv_transfer_params={"mc_forget": {"x_request_id": xid}})


def test_the_scheduler_answers_the_forget_in_its_params():
    """The forget's answer rides in request_finished's kv_transfer_params
    (vLLM puts them in the response); its blocks are not held."""
    sch = _consumer()
    assert sch.request_finished(_forget_req("mc-1"), []) == (False, {"mc_forget": "unseen"})
    assert sch.request_finished(_forget_req("mc-1"), []) == (False, {"mc_forget": "seen"})
    for bad in (None, 7, "", {"x_request_id": 7}):
        r = _forget_req("x")
        r.kv_transfer_params = {"mc_forget": bad}
        assert sch.request_finished(r, [])[1] is None


def test_a_data_parallel_server_never_answers_unseen():
    """With vLLM's data parallelism inside the decode server the forget may
    reach another engine than its leg's: "unseen" there could release a
    prompt the leg's engine pulls (another request would compute it), so
    such a server answers "seen" (held until hold_timeout_s, as before)."""
    sch = _consumer(dp_size=2)
    assert sch.request_finished(_forget_req("mc-2"), []) == \
        (False, {"mc_forget": "seen", "mc_dp": True})


def test_a_data_parallel_engine_answers_a_forget_sent_to_it():
    """The proxy asks each engine of a data-parallel decode (its
    X-data-parallel-rank header, and the rank named as dp_rank): the engine
    of that rank answers for itself; another (the header not honoured)
    answers "seen"; mc_dp tells the proxy to ask the other engines."""
    sch = _consumer(dp_size=2, dp_local=1)
    r = _forget_req("mc-3")
    r.kv_transfer_params["mc_forget"]["dp_rank"] = 1
    assert sch.request_finished(r, []) == (False, {"mc_forget": "unseen", "mc_dp": True})
    for other in (0, True, "1", None):
        r = _forget_req("mc-4")
        r.kv_transfer_params["mc_forget"]["dp_rank"] = other
        assert sch.request_finished(r, []) == (False, {"mc_forget": "seen", "mc_dp": True})
    # Without data parallelism dp_rank changes nothing (one engine answers).
    sch = _consumer()
    r = _forget_req("mc-5")
    r.kv_transfer_params["mc_forget"]["dp_rank"] = 0
    assert sch.request_finished(r, []) == (False, {"mc_forget": "unseen"})


def test_ended_legs_are_bounded_by_time_and_size(monkeypatch):
    """Publishes.ended (a prefill's held requests that ended owing a pull,
    kept for the proxy's release naming them): ENDED_S after their end, at
    most ENDED_MAX, the oldest going first."""
    import types
    from mooncake_connector.connector import publishes
    clk = Clock()
    monkeypatch.setattr(publishes, "time", types.SimpleNamespace(monotonic=clk))
    pub = publishes.Publishes(worker=None)

    def end(rid):
        pub.pub_tokens[rid] = [1, 2]
        pub._ended(rid)

    for i in range(publishes.ENDED_MAX + 10):
        end(f"r{i}")
    assert len(pub.ended) == publishes.ENDED_MAX
    assert "r9" not in pub.ended and "r10" in pub.ended
    clk.t += publishes.ENDED_S / 2
    end("late")
    assert len(pub.ended) == publishes.ENDED_MAX  # the oldest made room
    clk.t += publishes.ENDED_S / 2 + 1
    end("last")
    assert list(pub.ended) == ["late", "last"]    # the rest ended over ENDED_S ago


def test_a_question_asked_again_gets_the_answer_it_missed():
    """The proxy asks again when a forget's answer never reached it (a
    stopped or overloaded decode, its own timeout, a reset), with the same
    ask id: the ledger gives the first answer again.  Without the id the
    second question was "seen" (paid by the first answer), and the proxy,
    which never got that "unseen", left the prompt held until
    hold_timeout_s.  A new question (another ask id, or none) about a leg
    already answered is still "seen": the prompt is released once."""
    clk = Clock()
    lg = LegLedger(clk)
    assert lg.forget("a", "q1") == "unseen"          # never came
    assert lg.forget("a", "q1") == "unseen"          # the answer was lost: the same again
    assert lg.forget("a", "q2") == "seen" and lg.forget("a") == "seen"
    assert lg.arrived("cmpl-b-0-1a2b3c4d")
    lg.finished("cmpl-b-0-1a2b3c4d", paid=False)     # ended owing its pull
    assert lg.forget("b", "q3") == "unseen" and lg.forget("b", "q3") == "unseen"
    assert lg.forget("b", "q4") == "seen"
    assert lg.arrived("cmpl-c-0-1a2b3c4d")           # here: it pays at its end
    assert lg.forget("c", "q5") == "seen" and lg.forget("c", "q5") == "seen"
    assert lg.finished("cmpl-c-0-1a2b3c4d", paid=False) is True  # asked: its own release
    clk.t += legs.MEMORY_S + 1                       # answers are kept as long as records
    assert lg.forget("zz") == "unseen" and len(lg) == 1


def test_the_scheduler_passes_the_ask_id():
    sch = _consumer()
    r = _forget_req("mc-6")
    r.kv_transfer_params["mc_forget"]["ask"] = "k1"
    assert sch.request_finished(r, []) == (False, {"mc_forget": "unseen"})
    assert sch.request_finished(r, []) == (False, {"mc_forget": "unseen"})
    r.kv_transfer_params["mc_forget"]["ask"] = "k2"
    assert sch.request_finished(r, []) == (False, {"mc_forget": "seen"})
