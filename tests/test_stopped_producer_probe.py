"""benchmarks/stopped_producer_probe.py and benchmarks/layer_read_probe.py
on vLLM's CPU backend (pytest -m e2e), both on one server set: the module's
fixture runs benchmarks/fault_probes.py's main() once, in this process (real
prefill, decode and colocated vLLM servers started once, forked from the
tests' vLLM fork server; the layer read's checks but "killed",
then the whole stopped-producer probe, then the layer read's "killed"), and
each test reads its probe's summary.

Stopped producer: the prefill SIGSTOPped while the decode lends it blocks
for a push (whole prompt, then push_layer_load), released by SIGCONT, then a
third stop ended by SIGKILL.  The probe's own checks (each target answered
within lease + grace and token-identical; the decode's push_fence_holds
counted and its blocks held while the producer stays stopped; every other
answer identical to colocated; the holds released after SIGCONT / SIGKILL;
nothing hangs) must all pass.  The same-host CPU path plays CUDA IPC's role
here: the producer process writes into the decode's KV memory itself.  Seen
failing with the holds broken in the servers (a scratch directory on
PYTHONPATH whose sitecustomize.py sets push.PushConsumer._hold to a no-op,
the behaviour before the holds): each phase's "held" (push_fence_holds +0,
KV usage 0 while stopped) and "released" checks fail, 6 of 18
(docs/vllm-gpu.md, "Stopped-producer probe").

Layer read: a write-based and a read-based (push_layer_read) layer-load
proxy.  Every check of the probe must pass: answers token-identical to
colocated in both modes (the read mode's producer writing 0 bytes), a
running stream's stall with the prefill SIGSTOPped at least the lease in
write mode and, in read mode, the decode's read given up at its stall bound
(push_layer_read_gave_up +1) with the gap below the lease (same run), and
a clean recompute with the prefill SIGKILLed.  (It was
tests/test_layer_read_probe.py, with servers of its own.)
"""
import contextlib
import io
import json
import os
import signal
import sys
import types

import pytest

import e2e_fixtures

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
PROBE = os.path.join(BENCH, "stopped_producer_probe.py")


def test_probe_arguments():
    """The probe's phases: END:MODE[+MODE], a SIGKILL phase only last (the
    prefill is not restarted); --lease-s above push_layer_timeout_s's 1 s."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("stopped_producer_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.parse_args([]).phase_list == [("cont", ["push"]), ("cont", ["push_layer_load"]),
                                               ("kill", ["push"])]
    assert probe.parse_phases("cont:push+push_layer_load") == [
        ("cont", ["push", "push_layer_load"])]
    for bad in ("kill:push,cont:push", "stop:push", "cont:", "cont:flow_a", ""):
        with pytest.raises(ValueError):
            probe.parse_phases(bad)
    assert probe.parse_args(["--extra-c", "early_recv=true", "--extra-c", "x_y=a"]).extra_config \
        == {"early_recv": True, "x_y": "a"}
    for argv in (["--lease-s", "1"], ["--gpu-path", "off"], ["--phases", "kill:push,cont:push"],
                 ["--extra-c", "early_recv"], ["--extra-c", "Early=1"]):
        with pytest.raises(SystemExit):
            probe.parse_args(argv)


def test_fault_probes_arguments():
    """Both probes on one server set: each probe's own arguments through
    --sp / --lr, one lease for both, the decode's config keys of both (one
    key two values refused)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fault_probes",
                                                  os.path.join(BENCH, "fault_probes.py"))
    both = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(both)
    args = both.parse_args(["--lease-s", "4", "--sp=--others 2 --after 1", "--lr=--n 2"])
    assert (args.sp_args.others, args.sp_args.after, args.lr_args.n) == (2, 1, 2)
    assert args.sp_args.lease_s == args.lr_args.lease_s == 4.0
    assert args.sp_args.device == "cpu"
    assert args.decode_config == {"load_timeout_s": 4.0, "push_layer_timeout_s": 4.0,
                                  "push_layer_read_stall_s": 0.5,
                                  "push_layer_load_max_batch": 4, "flow_a": False}
    for argv in (["--sp=--device cuda"], ["--lr=--lease-s 5"], ["--sp=--out x"],
                 ["--sp=--extra-c push_layer_load_max_batch=1"], ["--lr=--stall-s"]):
        with pytest.raises(SystemExit):
            both.parse_args(argv)


class _Tee(io.TextIOBase):
    """stdout for the in-process run: kept (the tests print its tail) and
    passed on to the stream it replaces (pytest's capture, or -s's terminal)."""

    def __init__(self, to):
        self.to, self.buf = to, io.StringIO()

    def write(self, s):
        self.buf.write(s)
        return self.to.write(s)

    def flush(self):
        self.to.flush()


@pytest.fixture(scope="module")
def probes(tmp_path_factory, tiny_model_dir):
    """Both probes' run on one server set: (the run's outcome: returncode,
    stdout, stderr as subprocess.run's; --out).  benchmarks/fault_probes.py's
    main() runs in this process, so that its three vLLM servers fork from the
    tests' vLLM fork server (serving.vllm_launcher, which tiny_model_dir sets:
    tests/e2e_fixtures.py) as the session deployment's do, instead of each
    importing vLLM's API server anew (three imports at once on CI's two
    cores).  Its SIGTERM handler and sys.path are put back afterwards.  When
    the session deployment is up (tests/e2e_fixtures.py; in CI the e2e
    modules before this one started it), its colocated server -- the same
    model and arguments -- is the probes' reference (--reference-url): one
    vLLM server's start less."""
    sys.path.insert(0, BENCH)
    try:
        import fault_probes
    finally:
        sys.path.remove(BENCH)
    tmp = tmp_path_factory.mktemp("probes")
    out = tmp / "out"
    # Servers start 30-150 s on a loaded 2-core host; the probes take ~1 min.
    argv = ["--out", str(out), "--workdir", str(tmp / "work"), "--sp=--others 2 --after 1",
            "--start-timeout", os.environ.get("MC_E2E_START_TIMEOUT", "600")]
    session = e2e_fixtures._SESSION["dep"]
    if session is not None and session.colocated is not None and session.colocated.alive \
            and session.model == tiny_model_dir:
        argv += ["--reference-url", session.colocated.url]
    path, on_term, tee = list(sys.path), signal.getsignal(signal.SIGTERM), _Tee(sys.stdout)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MC_SAME_HOST_CPU", "1")
        try:
            with contextlib.redirect_stdout(tee):
                rc = fault_probes.main(argv)
        finally:
            sys.path[:] = path
            signal.signal(signal.SIGTERM, on_term)
    return types.SimpleNamespace(returncode=rc, stdout=tee.buf.getvalue(), stderr=""), out


def probe_summary(probes, name):
    """The probe's summary (out/NAME.json) once the servers started and every
    check of it passed; its exit status 0 (out/fault_probes.json)."""
    p, out = probes
    print(p.stdout[-6000:], p.stderr[-3000:])
    assert p.returncode != 2, "the servers did not start:\n" + p.stdout[-3000:]
    summary = json.loads((out / f"{name}.json").read_text())
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    assert json.loads((out / "fault_probes.json").read_text())["rc"][name] == 0, \
        p.stdout[-3000:]
    return summary


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_stopped_producer_keeps_blocks_and_answers_match(probes):
    out = probes[1]
    summary = probe_summary(probes, "stopped_producer_probe")
    names = [c["check"] for c in summary["checks"]]
    # Every phase ran its five checks; both push modes and both ends came.
    assert len(summary["phases"]) == 3, summary["phases"]
    for check in ("bound", "held", "released", "identical", "no hang"):
        assert sum(n.endswith(": " + check) for n in names) == 3, names
    assert [ph["end"] for ph in summary["phases"]] == ["cont", "cont", "kill"]
    assert {m for ph in summary["phases"] for m in ph["modes"]} == {"push", "push_layer_load"}
    for ph in summary["phases"]:
        assert ph["holds"] >= len(ph["modes"]) and ph["idle_usage"] > 0, ph
        assert ph["usage_after"] == 0 and ph["released_after_s"] is not None, ph
    assert "RESULT: PASS" in (out / "stopped_producer_probe.txt").read_text()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_layer_read_probe(probes):
    summary = probe_summary(probes, "layer_read_probe")
    assert [c["check"] for c in summary["checks"]] == ["identical", "stall write", "stall read",
                                                        "killed"]
    info = summary["info"]
    assert info["stall_write"]["stream_max_gap_s"] > info["stall_read"]["stream_max_gap_s"]
    assert info["stall_read"]["read_gave_up"] >= 1, info["stall_read"]
