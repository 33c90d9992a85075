"""Several fresh-process runs of Python code that all begin with the same
slow import, for the price of one import.

run_forked(preamble, jobs) starts one Python, which runs `preamble` (e.g.
`import vllm...`: 10-15 s on the 2-core CI host) once, then forks one child
per job: the child sets the job's environment, points its stdout and stderr
at files of its own, runs the job's code as __main__ (sys.argv = the job's
argv) and exits; the next job forks from the parent again, so no job sees
another's state, only the preamble's imports.  Each job's result is a
CompletedProcess-like (returncode, stdout, stderr), as subprocess.run would
give for `python -P -c code argv...` with that environment, less what the
preamble's imports printed (the parent's streams).

`fresh` names packages the preamble must not import (a test of what
importing them does needs them imported in the job): the runner exits with
an error if it did.  A job that raises, or exits non-zero, gives its exit
status (1 for an exception, its traceback in its stderr); one that runs past
`timeout` fails the whole run (subprocess.TimeoutExpired).
"""
import json
import os
import subprocess
import sys
import tempfile
import types

RUNNER = r'''
import json, os, sys, traceback
spec = json.load(open(sys.argv[1]))
exec(compile(spec["preamble"], "<preamble>", "exec"), {"__name__": "__preamble__"})
bad = sorted(m for m in sys.modules if m.split(".")[0] in spec["fresh"])
if bad:
    sys.exit(f"forked: the preamble imported {bad[:5]}; the jobs must import them themselves")
codes = []
for job in spec["jobs"]:
    sys.stdout.flush(); sys.stderr.flush()   # nothing of the parent's doubles into a job's files
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for k, v in job["env"].items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.argv = ["-c"] + job["argv"]
            try:
                exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
json.dump(codes, open(spec["codes"], "w"))
'''


def run_forked(preamble, jobs, env=None, fresh=("mooncake_connector",), timeout=600, cwd=None):
    """jobs: dicts with "code" and optionally "argv" (list of str) and "env"
    (variables to set; None unsets one).  env: the parent's environment
    (default os.environ).  Returns one result per job, in order."""
    with tempfile.TemporaryDirectory(prefix="mc-forked-") as d:
        spec = {"preamble": preamble, "fresh": list(fresh), "jobs": [],
                "codes": os.path.join(d, "codes.json")}
        for i, job in enumerate(jobs):
            spec["jobs"].append({"code": job["code"], "argv": list(job.get("argv", ())),
                                 "env": dict(job.get("env") or {}),
                                 "stdout": os.path.join(d, f"{i}.out"),
                                 "stderr": os.path.join(d, f"{i}.err")})
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        r = subprocess.run([sys.executable, "-P", "-c", RUNNER, os.path.join(d, "spec.json")],
                           capture_output=True, text=True, timeout=timeout, cwd=cwd,
                           env=os.environ if env is None else env)
        if r.returncode != 0 or not os.path.exists(spec["codes"]):
            raise RuntimeError(f"forked runner failed (exit {r.returncode}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        with open(spec["codes"]) as f:
            codes = json.load(f)
        return [types.SimpleNamespace(returncode=code, stdout=_read(job["stdout"]),
                                      stderr=_read(job["stderr"]))
                for code, job in zip(codes, spec["jobs"])]


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:  # the job's child died before it opened its files
        return ""
