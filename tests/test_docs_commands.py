"""The user-facing docs name only things that exist.

README.md, docs/*.md and benchmarks/README.md are read as a user reads
them: every code block line and every inline `code` span.  What they name
is checked against the code, without starting a server (a few seconds):

* a command of ours -- `mooncake-connector SUB`, `python -m
  mooncake_connector.X`, `mooncake-metadata-server`, `benchmarks/X.py`,
  `scripts/X.sh` (or their bare file names) -- exists, and every `--flag`
  after it is an option of that program: for a Python program, of the
  argparse parser it really builds (each is run, all in one subprocess,
  with ArgumentParser.parse_args replaced by a catch of the parser, so
  nothing past the parsing runs; a program without argparse is not run:
  the --flags its source spells); for a shell script, a flag its text
  spells or one of the Python programs of ours / scripts it runs has;
* a flag written with no program (`--flow push`) is an option of one of
  the programs named in its paragraph (a span, or "The proxy", "the
  proxy's", "at the proxy") or earlier in its section; with none named,
  of some program of ours;
* a path into this repository (`benchmarks/soak.py`, `tests/x.py::test_y`,
  `csrc/kv/kv_msg.[ch]`, a C test `tests/c/test_x` built from test_x.c)
  exists;
* a mooncake.json field (a ```json block with "prefill_url" or
  "metadata_server", a span right after the word mooncake.json) is one the
  mooncake.json reader accepts; a kv_connector_extra_config key (the
  `key (extra config)` table, `kv_connector_extra_config.KEY`, the extra
  config of a --kv-transfer-config JSON that the plugin takes for ours) is
  one the connector's settings reader accepts -- both asked of the readers
  themselves (connector/settings.py);
* an MC_* / MOONCAKE_* name is read somewhere in the code (a string literal
  "MC_X" in Python or C, $MC_X, or MC_X= as in a shell assignment or an env
  dict) or is a C identifier (MC_ERANGE, MC_LOOKUP_COPY); `MC_RDMA_*` is a
  prefix that must have a member;
* a `vllm:mooncake_*` metric (or its `..._x_total` short form) is one
  connector/stats.py exports;
* a supported-vLLM range (">=0.26,<0.35", "vLLM 0.26 to 0.34") is
  pyproject.toml's [vllm] extra.

What is not ours is not checked, by rule rather than by list:

* benchmarks/JOURNAL.md (a lab journal of past runs) is not read, nor any
  file outside the three sets above; a span the doc itself says is "not in
  main" (a past run's one-off knob) is skipped;
* a command whose program is not ours (vllm serve, python -m vllm...,
  vllm-router, pip, tar, docker ...): its flags are that tool's, and so is
  the same flag written bare elsewhere, unless the docs also show it on a
  command of ours;
* a bare flag the text gives to another project ("vLLM's `--x`", "a plain
  vLLM `--x` server", "vLLM's `--a` / `--b`"), or one our own code passes
  to other programs (a "--x" literal in mooncake_connector/, benchmarks/ or
  scripts/ that is no option of any program of ours: what we put on vLLM's,
  etcd's, redis-server's command lines);
* a path the text gives to another project ("vLLM's `tests/v1/...`").
"""
import glob
import json
import os
import re
import shlex
import functools
import subprocess
import sys
from collections import namedtuple

from mooncake_connector.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "benchmarks/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CODE_TREES = ["mooncake_connector", "csrc", "scripts", "benchmarks", "tests", ".ci"]
PROGRAM_DIRS = ["benchmarks", "scripts"]
REPO_DIRS = ("benchmarks/", "scripts/", "docs/", "tests/", "mooncake_connector/", "csrc/")

_TEXTS = {}  # doc -> its text, as read_spans read it

Span = namedtuple("Span", "doc line text kind para section pos pre post")
# kind: "code:LANG" (a code block line), "inline", "table-key" (first column
# of the `key (extra config)` table), "word" (a program named in plain text).
# pos: offset in its paragraph; pre / post: the paragraph's text around it.

# A program of ours a paragraph names in plain words: "The proxy ...", "the
# proxy's `--x`", "`--x` at the proxy".
WORDS = {"proxy": ("module", "mooncake_connector.proxy")}
WORD_RE = re.compile(r"\bThe proxy\b|\bproxy's|\bat the proxy\b")


def read_spans(doc, text=None):
    """Every code block line (continuations joined) and inline code span of
    a markdown file, with its paragraph and section numbers."""
    if text is None:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
    _TEXTS[doc] = text
    out, para, section = [], 0, 0
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.lstrip().startswith("```"):
            lang = ln.strip()[3:].strip()
            para += 1
            i += 1
            pending, start = "", 0
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                cur = lines[i]
                if not pending:
                    start = i + 1
                if cur.rstrip().endswith("\\"):
                    pending += cur.rstrip()[:-1] + " "
                else:
                    out.append(Span(doc, start, pending + cur, "code:" + lang, para, section,
                                    i, "", ""))
                    pending = ""
                i += 1
            para += 1
            i += 1
            continue
        if ln.startswith("#"):
            section += 1
            para += 1
            i += 1
            continue
        if not ln.strip():
            para += 1
            i += 1
            continue
        # A paragraph (or table): inline spans may wrap lines.
        first, body = i, []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith("#") \
                and not lines[i].lstrip().startswith("```"):
            body.append(lines[i])
            i += 1
        para += 1
        if body[0].lstrip().startswith("|"):
            out += _table_spans(doc, first, body, para, section)
            continue
        out += _inline_spans(doc, first, "\n".join(body), "inline", para, section)
    return out


def _inline_spans(doc, first, joined, kind, para, section, base=0):
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        line = first + 1 + joined.count("\n", 0, m.start())
        out.append(Span(doc, line, m.group(1).replace("\n", " "), kind, para, section,
                        base + m.start(), joined[max(0, m.start() - 40):m.start()],
                        joined[m.end():m.end() + 80]))
    plain = re.sub(r"`[^`]+`", lambda m: " " * len(m.group(0)), joined)
    for m in WORD_RE.finditer(plain):
        line = first + 1 + joined.count("\n", 0, m.start())
        out.append(Span(doc, line, "proxy", "word", para, section, base + m.start(), "", ""))
    return sorted(out, key=lambda s: s.pos)


def _table_spans(doc, first, rows, para, section):
    out = []
    head = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    key_table = head and head[0].startswith("key (extra config)")
    for n, row in enumerate(rows):
        # Each cell is a paragraph of its own.
        for c, cell in enumerate(re.split(r"(?<!\\)\|", row.strip().strip("|"))):
            kind = "table-key" if key_table and n > 1 and c == 0 else "inline"
            out += [s._replace(text=s.text.replace("\\|", "|"))
                    for s in _inline_spans(doc, first + n, cell, kind, (para, n, c), section)]
    return out


def all_spans():
    return [s for d in DOCS for s in read_spans(d)]


# ------------------------------------------------------------ programs

def _resolve_file(name):
    """A program's file: a repo path, or a bare name in benchmarks/ or scripts/."""
    if "/" in name:
        return name if os.path.isfile(os.path.join(ROOT, name)) and \
            name.startswith(tuple(PROGRAM_DIRS)) else None
    for d in PROGRAM_DIRS:
        if os.path.isfile(os.path.join(ROOT, d, name)):
            return f"{d}/{name}"
    return None


def _tokens(text):
    text = text.replace("\\|", "|")
    try:
        toks = shlex.split(text, comments=True)
    except ValueError:
        toks = text.split()
    segs, cur = [], []
    for t in toks:
        if t in ("|", "||", "&&", ";", "&"):
            segs.append(cur)
            cur = []
        elif t.endswith(";"):
            cur.append(t[:-1])
            segs.append(cur)
            cur = []
        else:
            cur.append(t)
    segs.append(cur)
    return [s for s in segs if s]


def find_program(seg):
    """(program, index of its first argument) for the first program of ours
    in a command segment, else (None, None).  A program is ("module", name),
    ("cli", sub) or ("file", repo path)."""
    for k, t in enumerate(seg):
        t = t.strip("[]()")
        if t == "mooncake-connector" or (t == "mooncake_connector" and k and seg[k - 1] == "-m"):
            sub = seg[k + 1] if k + 1 < len(seg) else ""
            if sub and not sub.startswith("-") and sub != "...":
                return ("cli", sub), k + 2
            return ("cli", ""), k + 1
        if t == "doctor" and k == 0 and len(seg) > 1 and seg[1].startswith("--"):
            return ("cli", "doctor"), 1
        if k == 0 and len(seg) > 1 and seg[1].startswith("--") and \
                os.path.isfile(os.path.join(ROOT, "mooncake_connector", t + ".py")):
            return ("module", "mooncake_connector." + t), 1  # `transfer_demo --device cuda`
        if t == "mooncake-metadata-server":
            return ("module", "mooncake_connector.metadata_server"), k + 1
        if t.startswith("mooncake_connector.") and k and seg[k - 1] == "-m":
            return ("module", t), k + 1
        if re.fullmatch(r"[\w./-]+\.(py|sh)", t) and not t.startswith(("tests/", "vllm/")):
            path = _resolve_file(t)
            if path:
                return ("file", path), k + 1
            if t.startswith(tuple(PROGRAM_DIRS)):
                return ("missing", t), k + 1
    return None, None


def foreign_program(seg):
    """The first word of a segment that runs someone else's tool (vllm,
    pip, ...): not an env assignment, not a flag, not a placeholder."""
    for t in seg:
        if re.match(r"^\[?[A-Z_][A-Z0-9_]*=", t) or t in ("nice", "-n", "sudo", "exec", "env") \
                or t.isdigit():
            continue
        return t if re.fullmatch(r"[\w./-]+", t) and not t.startswith("-") else None
    return None


FLAG_RE = re.compile(r"(?:^|(?<=[\s\[(|,]))(--[a-z0-9][a-z0-9-]*)")


def flags_in(args):
    return FLAG_RE.findall(" ".join(args))


CAPTURE = r'''
import argparse, json, os, runpy, sys
class Got(BaseException):
    pass
def grab(self, *a, **k):
    raise Got(self)
argparse.ArgumentParser.parse_args = grab
argparse.ArgumentParser.parse_known_args = grab
argparse.ArgumentParser.parse_intermixed_args = grab
def options(p, seen):
    if id(p) in seen:
        return []
    seen.add(id(p))
    out = []
    for a in p._actions:
        out += [o for o in a.option_strings if o.startswith("--")]
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                out += options(sp, seen)
    return out
res = {}
root = os.getcwd()
for key, kind, target in json.loads(sys.argv[1]):
    sys.argv = [target, "--help"]
    try:
        if kind == "cli":
            from mooncake_connector import cli
            cli.main([target, "--help"])
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.join(root, target)
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
        res[key] = {"error": "no argparse parser was built"}
    except Got as g:
        res[key] = {"flags": sorted(set(options(g.args[0], set())))}
    except BaseException as e:
        res[key] = {"error": f"{type(e).__name__}: {e}"}
print("\nCAPTURED " + json.dumps(res))
'''


def _source(path):
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        return f.read()


def _module_path(mod):
    """A module's file in this checkout (the installed package is the same
    code), without importing it."""
    base = os.path.join(ROOT, *mod.split("."))
    for p in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(p):
            return os.path.relpath(p, ROOT)
    return None


def _text_flags(text):
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))


def capture_parsers(programs):
    """{program: {"flags": [...]}} of Python programs: the long options of
    the argparse parser each builds (one subprocess for all).  A program
    that builds none (it reads sys.argv itself) is not run: its options are
    the --flags its source spells."""
    todo, got = [], {}
    for p in sorted(programs):
        path = (_module_path(COMMANDS[p[1]][0]) if p[0] == "cli" and p[1] in COMMANDS else
                _module_path(p[1]) if p[0] == "module" else p[1])
        if path is None:
            got[p] = {"error": "no such program"}
        elif "argparse" in _source(path) or path.endswith("__main__.py"):
            todo.append((json.dumps(p), p[0], p[1]))
        else:
            got[p] = {"flags": sorted(_text_flags(_source(path)))}
    env = dict(os.environ, PYTHONSAFEPATH="1", MC_LOG_LEVEL="error")
    r = subprocess.run([sys.executable, "-P", "-c", CAPTURE, json.dumps(todo)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("CAPTURED ")]
    assert line, f"parser capture failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    for k, v in json.loads(line[-1][len("CAPTURED "):]).items():
        p = tuple(json.loads(k))
        if v.get("error", "").startswith("ModuleNotFoundError"):
            # A program needing what this host lacks (torch without vLLM):
            # the --flags its source spells.
            mod = COMMANDS[p[1]][0] if p[0] == "cli" else p[1]
            v = {"flags": sorted(_text_flags(_source(p[1] if p[0] == "file" else
                                                     _module_path(mod))))}
        got[p] = v
    return got


@functools.lru_cache(maxsize=None)  # the walks below reach a script ~40 times
def _script_refs(path):
    """The Python programs of ours (modules run with -m, .py files) and the
    shell scripts a shell script runs (frozensets: cached)."""
    text = _source(path)
    mods = {("module", m) for m in re.findall(r"-m\s+(mooncake_connector(?:\.\w+)+)", text)}
    files = set()
    for name in set(re.findall(r"[\w./${}-]+\.(?:py|sh)\b", text)):
        p = _resolve_file(os.path.basename(name))
        if p and p != path:
            files.add(p)
    return frozenset(mods), frozenset(files)


def script_flags(path, parsers, seen=()):
    """A shell script's options: --flags in its own text, and those of the
    Python programs of ours and the scripts it runs."""
    out = _text_flags(_source(path))
    mods, files = _script_refs(path)
    for m in mods:
        out |= set(parsers.get(m, {}).get("flags", ()))
    for p in files - set(seen):
        if p.endswith(".py"):
            out |= set(parsers.get(("file", p), {}).get("flags", ()))
        else:
            out |= script_flags(p, parsers, seen + (path,))
    return out


def script_python_programs(path, seen=()):
    mods, files = _script_refs(path)
    out = set(mods)
    for p in files - set(seen):
        if p.endswith(".py"):
            out.add(("file", p))
        else:
            out |= script_python_programs(p, seen + (path,))
    return out


# ------------------------------------------------------------ the code

def _code_files(trees):
    for tree in trees:
        for dp, dns, fns in os.walk(os.path.join(ROOT, tree)):
            dns[:] = [d for d in dns if d not in ("__pycache__", "results")]
            for fn in fns:
                path = os.path.join(dp, fn)
                if os.path.abspath(path) == os.path.abspath(__file__):
                    continue  # this file spells mistakes on purpose
                if fn.endswith((".py", ".pyi", ".c", ".h", ".cu", ".sh")) or "." not in fn:
                    yield path
    yield os.path.join(ROOT, "Makefile")


def _strip_c_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def code_names():
    """(names the code reads as environment variables, C identifiers)."""
    env, c_names = set(), set()
    name = r"((?:MC|MOONCAKE|VLLM_MOONCAKE)_[A-Z0-9_]*[A-Z0-9])"
    for path in _code_files(CODE_TREES):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if path.endswith((".c", ".h", ".cu")):
            text = _strip_c_comments(text)
            c_names |= set(re.findall(r"(?<![\w\"])" + name + r"(?![\w\"])", text))
        env |= set(re.findall(r"[\"']" + name + r"[\"']", text))  # getenv("MC_X"), environ
        env |= set(re.findall(r"\$\{?" + name, text))                # shell: $MC_X
        env |= set(re.findall(r"(?<![\w$.])" + name + r"=(?!=)", text))  # MC_X=..., env(MC_X=)
    return env, c_names


def metric_names():
    """The vllm:mooncake_* names connector/stats.py exports (read from its
    source: importing it imports vLLM)."""
    return set(re.findall(r"\"(vllm:mooncake_\w+)\"",
                          _source("mooncake_connector/connector/stats.py")))


def extra_config_accepts(key):
    """Whether the connector's settings reader takes `key` in
    kv_connector_extra_config (a value of the wrong type is still a key it
    knows)."""
    from types import SimpleNamespace

    from mooncake_connector.connector import settings
    cfg = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={key: None})
    try:
        settings.resolve(cfg, env={})
    except settings.SettingsError as e:
        return "unknown kv_connector_extra_config key" not in str(e)
    return True


def mooncake_json_accepts(key, value=""):
    """Whether the mooncake.json reader takes field `key`."""
    from mooncake_connector.connector import settings
    try:
        settings._check_fields([(key, value)], "mooncake.json")
    except settings.SettingsError as e:
        return "unknown field" not in str(e)
    return True


def flags_our_code_passes_on(parsers_flags):
    """--flags our code spells that are no option of any program of ours:
    what it passes to vLLM (and other tools) on their command lines."""
    out = set()
    for path in _code_files(["mooncake_connector", "benchmarks", "scripts"]):
        with open(path, encoding="utf-8", errors="replace") as f:
            out |= set(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"'= ]", f.read()))
    return out - parsers_flags


# ------------------------------------------------------------ the check

# Text that gives the span after it to another project: "vLLM's `x`", "a
# plain vLLM `--x`", "vLLM's `--a` / `--b`".
PEER_PROJECT = re.compile(r"\b(vllm-router|vLLM|vllm|Mooncake|SGLang|sglang)(?:'s)?\s*\(?"
                          r"(?:`[^`]*`\s*(?:/|,|or|and)\s*)*$")
HISTORICAL = "not in main"  # a reference the doc itself says is not in main


def problems(spans, checked=None):
    """Every reference in spans that names nothing in the code; `checked`
    (a dict) gets how many references of each kind were checked."""
    bad = []
    checked = {} if checked is None else checked

    def count(kind):
        checked[kind] = checked.get(kind, 0) + 1

    def fail(s, what):
        msg = f"{s.doc}:{s.line}: `{s.text.strip()[:100]}`: {what}"
        if msg not in bad:
            bad.append(msg)

    spans = [s for s in spans if HISTORICAL not in re.split(r"[.;|]", s.post)[0]]
    peer_span = [bool(PEER_PROJECT.search(s.pre)) for s in spans]

    # 1. Commands: ours and their flags; others' flags.
    parsed = []  # (span, [(program, flags)], bare flags)
    foreign_flags, python_progs, scripts = set(), set(), set()
    for s in spans:
        cmds, bare = [], []
        if s.kind == "word":
            parsed.append((s, [(WORDS[s.text], None)], []))
            continue
        for seg in _tokens(s.text):
            prog, at = find_program(seg)
            if prog:
                cmds.append((prog, flags_in(seg[at:])))
                if prog[0] == "missing":
                    pass
                elif prog[0] in ("cli", "module") or prog[1].endswith(".py"):
                    python_progs.add(prog)
                elif prog[0] == "file":
                    scripts.add(prog[1])
            elif seg[0].startswith("--") or seg[0].startswith("[--"):
                bare += flags_in(seg)
            elif foreign_program(seg):
                foreign_flags |= set(flags_in(seg))
        parsed.append((s, cmds, bare))
    for p in sorted(scripts):
        python_progs |= script_python_programs(p)
    parsers = capture_parsers({p for p in python_progs if p[0] != "cli" or p[1] in COMMANDS})
    for prog, got in parsers.items():
        if "error" in got:
            bad.append(f"{prog[1]}: cannot read its options: {got['error']}")

    known = {}  # prog: its options (asked once per command in the docs: ~450 times)

    def options(prog):
        if prog not in known:
            known[prog] = frozenset(script_flags(prog[1], parsers) if prog[0] == "file" and
                                    prog[1].endswith(".sh") else
                                    parsers.get(prog, {}).get("flags", ()))
        return known[prog]

    ours = set().union(*(options(p) for p in python_progs | {("file", x) for x in scripts}))
    passed_on = flags_our_code_passes_on(ours)
    # A flag the docs show on a command of ours is ours wherever it is written.
    foreign_flags -= {fl for _, cmds, _ in parsed for _, fls in cmds for fl in fls or ()}
    in_para, in_section = {}, {}  # programs named in each paragraph / section so far

    def real(prog):
        return prog[0] != "missing" and (prog[0] != "cli" or prog[1] in COMMANDS)

    for s, cmds, _ in parsed:
        for prog, _ in cmds:
            if real(prog):
                in_para.setdefault((s.doc, s.para), []).append(prog)
    for s, cmds, bare in parsed:
        for prog, flags in cmds:
            if flags is None:
                continue
            if prog[0] == "missing":
                fail(s, f"{prog[1]} does not exist")
                continue
            if prog[0] == "cli" and prog[1] not in COMMANDS:
                if prog[1]:
                    fail(s, f"mooncake-connector has no command {prog[1]!r} (it has "
                         f"{', '.join(COMMANDS)})")
                continue
            have = options(prog)
            count("commands")
            for fl in flags:
                count("flags")
                if fl not in have and fl != "--help":
                    fail(s, f"{fl} is not an option of {prog[1]}")
        # A bare flag belongs to a program named in its paragraph or before
        # it in its section, else to any program of ours -- unless the text
        # gives it to another project ("vLLM's `--x`").
        owners = in_para.get((s.doc, s.para), []) + in_section.get((s.doc, s.section), [])
        for fl in bare:
            count("flags")
            if fl == "--help" or fl in foreign_flags or fl in passed_on or \
                    PEER_PROJECT.search(s.pre):
                continue
            if any(fl in options(p) for p in owners) if owners else fl in ours:
                continue
            where = ("of " + " or ".join(sorted({p[1] for p in owners})) +
                     " (named near it)") if owners else "of any program of ours"
            fail(s, f"{fl} is not an option {where}")
        for prog, _ in cmds:
            if real(prog):
                in_section.setdefault((s.doc, s.section), []).append(prog)

    # 2. Paths into the repository.
    for s, peer in zip(spans, peer_span):
        if s.kind == "word" or peer:
            continue
        for t in re.findall(r"(?<![\w./-])((?:%s)[\w./*\[\]-]*)" % "|".join(map(re.escape,
                                                                              REPO_DIRS)),
                            s.text):
            path = re.split(r"::|:\d|#", t)[0].rstrip(".,;:)")
            full = os.path.join(ROOT, path)
            count("paths")
            if not glob.glob(full) and not glob.glob(full + ".c"):
                fail(s, f"{path} does not exist")

    # 3. Config keys.
    def extra_key(s, key):
        count("extra config keys")
        if not extra_config_accepts(key):
            fail(s, f"{key} is not a kv_connector_extra_config key the settings reader "
                 "accepts (mooncake_connector/connector/settings.py)")

    def json_field(s, key, value=""):
        count("mooncake.json fields")
        if not mooncake_json_accepts(key, value):
            fail(s, f"{key} is not a mooncake.json field the reader accepts")

    for s in spans:
        if s.kind == "table-key":
            for key in re.findall(r"^\w+$|^\w+(?=,)|(?<=, )\w+", s.text):
                extra_key(s, key)
        if s.kind == "word":
            continue
        for key in re.findall(r"kv_connector_extra_config\.(\w+)", s.text):
            extra_key(s, key)
        for m in re.finditer(r"'(\{.*\})'", s.text):  # --kv-transfer-config '{...}'
            try:
                cfg = json.loads(m.group(1))
            except ValueError:
                continue
            extra = cfg.get("kv_connector_extra_config") if isinstance(cfg, dict) else None
            if isinstance(extra, dict):
                from mooncake_connector.connector.plugin import choose
                if not choose(extra, env={})[0]:
                    continue  # the shape of vLLM's in-tree connector's config: not ours
                for key in extra:
                    extra_key(s, key)
        if s.kind == "code:json":  # a mooncake.json
            block = [x.text for x in spans if x.doc == s.doc and x.para == s.para]
            m = re.match(r'\s*"(\w+)"\s*:', s.text)
            if m and any('"prefill_url"' in x or '"metadata_server"' in x for x in block):
                json_field(s, m.group(1))
        if s.kind == "inline" and re.search(r"mooncake\.json\s+(?:key\s+|field\s+)?$", s.pre):
            m = re.fullmatch(r'"?(\w+)"?(?::\s*(true|false|"[^"]*"))?', s.text.strip())
            if m:
                json_field(s, m.group(1), json.loads(m.group(2)) if m.group(2) else "")

    # 4. Environment variables, C identifiers; 5. metrics.
    env, c_names = code_names()
    metrics = metric_names()
    for s in spans:
        if s.kind == "word":
            continue
        for n, star in re.findall(r"(?<![\w.])((?:MC|MOONCAKE)_[A-Z0-9_]*)(\*?)", s.text):
            count("MC_* names")
            if star or n.endswith("_"):
                if not any(x.startswith(n) for x in env | c_names):
                    fail(s, f"no variable or constant {n}* in the code")
            elif n not in env and n not in c_names:
                fail(s, f"{n} is read nowhere in the code ({', '.join(CODE_TREES)}) and is "
                     "no C identifier")
        for m in re.findall(r"(vllm:mooncake_\w+|(?<![\w.])\.\.\._[a-z]\w+)", s.text):
            full = "vllm:mooncake" + m[3:] if m.startswith("...") else m
            count("metrics")
            if full not in metrics:
                fail(s, f"{full} is not a metric connector/stats.py exports")

    # 6. The supported vLLM range (">=0.26,<0.35", "vLLM 0.26 to 0.34"): as
    # pyproject.toml's [vllm] extra states it.
    m = re.search(r'^vllm = \["vllm>=0\.(\d+),<0\.(\d+)"\]', _source("pyproject.toml"), re.M)
    lo, hi = int(m.group(1)), int(m.group(2))
    for doc in sorted({s.doc for s in spans}):
        text = _TEXTS.get(doc, "")
        for r in re.finditer(r">=0\.(\d+),<0\.(\d+)|vLLM 0\.(\d+) to 0\.(\d+)", text):
            count("vLLM ranges")
            a, b = (int(r.group(1)), int(r.group(2))) if r.group(1) else \
                (int(r.group(3)), int(r.group(4)) + 1)
            if (a, b) != (lo, hi):
                line = text.count("\n", 0, r.start()) + 1
                fail(Span(doc, line, r.group(0), "inline", 0, 0, 0, "", ""),
                     f"pyproject.toml's [vllm] extra says >=0.{lo},<0.{hi} (vLLM 0.{lo} to "
                     f"0.{hi - 1})")
    return bad


def test_the_docs_name_only_what_exists():
    checked = {}
    bad = problems(all_spans(), checked)
    assert not bad, "the docs name things the code does not have:\n" + "\n".join(bad)
    # Not vacuous: the docs' references were found (a parsing slip would
    # otherwise pass with nothing checked).
    floor = {"commands": 130, "flags": 200, "paths": 250, "extra config keys": 22,
             "mooncake.json fields": 8, "MC_* names": 260, "metrics": 40, "vLLM ranges": 4}
    low = {k: (checked.get(k, 0), n) for k, n in floor.items() if checked.get(k, 0) < n}
    assert not low, f"fewer references found than the docs hold (found, expected >=): {low}"


BROKEN = """# A page with one mistake of each kind

```sh
python -m mooncake_connector.proxy --prefill http://P:8100 --decode http://D:8200 --flwo a
mooncake-connector doctor --confg mooncake.json
mooncake-connector serve --port 1
scripts/no-such-script.sh --x
vllm serve MODEL --enforce-eager --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_connector_extra_config":{"hold_timeout_s":5,"hold_timout_s":5}}'
```

The proxy's `--push-layer-lode on` asks for it; start the decode with
vLLM's `--no-async-scheduling` and see `benchmarks/no_such_bench.py`.

```json
{
  "prefill_url": "192.168.0.137:13003",
  "metadata_sever": "192.168.0.139:2379"
}
```

Off with the mooncake.json key `"same_host_cpus": false`, or
`kv_connector_extra_config.load_wrokers`; `MC_NO_SUCH_KNOB=1`; counted
`vllm:mooncake_no_such_total`. Supported: vLLM 0.26 to 0.30.

| key (extra config) | default | meaning |
|---|---|---|
| `hold_timeout_s`, `idle_wait_mss` | 1 | x |
"""


def test_the_check_finds_each_kind_of_mistake():
    """It can fail: a page with one mistake of each kind gets one problem
    each, and the things that are right on it (vLLM's own flags on its
    command line and where the text gives them to vLLM, known keys) none."""
    bad = problems(read_spans("broken.md", BROKEN))
    want = ["--flwo is not an option of mooncake_connector.proxy",
            "--confg is not an option of doctor",
            "mooncake-connector has no command 'serve'",
            "scripts/no-such-script.sh does not exist",
            "hold_timout_s is not a kv_connector_extra_config key",
            "--push-layer-lode is not an option of",
            "benchmarks/no_such_bench.py does not exist",
            "metadata_sever is not a mooncake.json field",
            "same_host_cpus is not a mooncake.json field",
            "load_wrokers is not a kv_connector_extra_config key",
            "MC_NO_SUCH_KNOB is read nowhere",
            "vllm:mooncake_no_such_total is not a metric",
            "`vLLM 0.26 to 0.30`: pyproject.toml's [vllm] extra says",
            "idle_wait_mss is not a kv_connector_extra_config key"]
    for w in want:
        assert sum(w in b for b in bad) == 1, (w, bad)
    assert len(bad) == len(want), bad
