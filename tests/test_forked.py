"""tests/forked.py, the runner that forks several fresh-process jobs from one
slow import (test_doctor's and test_connector_vllm's plugin checks use it):
each job sees the preamble's imports and none of another job's state, gets
its own environment, streams and exit status."""
import pytest

from forked import run_forked

PREAMBLE = "import json\nSHARED = {'n': 0}\nimport sys; sys.modules['json'].seen_by_preamble = 1\n"
JOB = r'''
import json, os, sys
import email.message                      # imported by the job, not the preamble
state = sys.modules.setdefault("job_state", type(sys)("job_state"))
state.count = getattr(state, "count", 0) + 1
os.environ["LEAK"] = "set by a job"
print(json.dumps({"argv": sys.argv[1:], "var": os.environ.get("VAR"), "count": state.count,
                  "preamble": getattr(json, "seen_by_preamble", 0)}))
print("to stderr", sys.argv[1], file=sys.stderr)
code = int(sys.argv[2])
if code == 99:
    raise RuntimeError("boom")
sys.exit(code)
'''


def test_jobs_are_isolated_and_each_has_its_own_result():
    import json

    runs = run_forked(PREAMBLE, [
        {"code": JOB, "argv": ["a", "0"], "env": {"VAR": "1"}},
        {"code": JOB, "argv": ["b", "3"], "env": {"VAR": None}},
        {"code": JOB, "argv": ["c", "99"], "env": {"VAR": "3", "LEAK": None}},
    ], env={"VAR": "parent", "LEAK": "parent", "PATH": "/usr/bin:/bin"})
    got = [json.loads(r.stdout.splitlines()[0]) for r in runs]
    assert [g["argv"] for g in got] == [["a", "0"], ["b", "3"], ["c", "99"]]
    assert [g["var"] for g in got] == ["1", None, "3"]
    assert [g["count"] for g in got] == [1, 1, 1]          # no job saw another's module state
    assert all(g["preamble"] == 1 for g in got)           # every job saw the preamble's
    assert [r.returncode for r in runs] == [0, 3, 1]
    assert runs[0].stderr.strip() == "to stderr a" and "RuntimeError: boom" in runs[2].stderr
    assert "to stderr c" in runs[2].stderr and "to stderr a" not in runs[1].stderr


def test_a_preamble_that_imports_a_fresh_package_is_refused():
    with pytest.raises(RuntimeError, match=r"the preamble imported \['email"):
        run_forked("import email.message", [{"code": "pass"}], fresh=("email",))
    ok, = run_forked("import json", [{"code": "import email"}], fresh=("email",))
    assert ok.returncode == 0, ok.stderr
