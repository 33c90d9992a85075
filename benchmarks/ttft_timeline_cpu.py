"""CPU per request and paired TTFT by mode from a ttft_timeline.py --out file
(issue 31, run 25): every thread of the mode's servers (prefill, decode, its
push proxy; colocated: the server, + its pass-through proxy), median; gap 1->2
and ITL p50; paired deltas of the --tree-b / --env-c / --whole A/B modes.

    python3 benchmarks/ttft_timeline_cpu.py build/ttft_timeline.json
"""
import json
import statistics as st
import sys

PAIRS = (("push_ll_main", "push_ll"), ("push_whole_main", "push_whole"),
         ("push_ll", "push_ll_c"), ("push_ll_main", "push_ll_c"))


def servers(mode):
    if mode == "colocated":
        return ["colocated"]
    if mode == "colocated_proxy":
        return ["colocated", "proxy_colocated"]
    for base in ("push_ll", "push_whole"):
        if mode == base or mode.startswith(base + "_"):
            sfx = mode[len(base):]
            return ["prefill" + sfx, "decode" + sfx, "proxy_" + base + sfx]
    return []


def cpu(rec, names):
    return sum(v for s in names for t, v in (rec["cpu_ms"].get(s) or {}).items()
               if not t.startswith("rq:"))


def med(xs):
    return st.median(xs) if xs else float("nan")


def main(path):
    rows = json.load(open(path))["rows"]
    for n, recs in rows.items():
        modes = list(dict.fromkeys(r["mode"] for r in recs))
        print(f"== {n} words, prompt tokens {recs[0].get('prompt_tokens')}")
        by = {}
        for r in recs:
            by.setdefault(r["rid"].rsplit("-", 2)[1], {})[r["mode"]] = r
        for m in modes:
            rs = [r for r in recs if r["mode"] == m]
            dec = servers(m)[1:2] if m.startswith("push") else []
            print(f"  {m:18s} n={len(rs)} TTFT p50 {med([r['ttft_ms'] for r in rs]):6.1f}"
                  f"  CPU/req p50 {med([cpu(r, servers(m)) for r in rs]):6.1f}"
                  f"  decode CPU p50 {med([cpu(r, dec) for r in rs]):5.1f}"
                  f"  gap1->2 p50 {med([r['itl_ms'][0] for r in rs if r['itl_ms']]):5.1f}"
                  f"  ITL p50 {med([x for r in rs for x in r['itl_ms'][1:]]):5.1f}"
                  f"  identical {sum(1 for r in rs if r.get('identical'))}/{len(rs)}")
        for a, b in PAIRS:
            if a not in modes or b not in modes:
                continue
            both = [v for v in by.values() if a in v and b in v]
            dt = [v[a]["ttft_ms"] - v[b]["ttft_ms"] for v in both]
            dc = [cpu(v[a], servers(a)) - cpu(v[b], servers(b)) for v in both]
            ratio = (med([cpu(v[b], servers(b)) for v in both]) /
                     med([cpu(v[a], servers(a)) for v in both]))
            print(f"  paired {a} - {b}: TTFT median {med(dt):+.1f} ms, CPU median "
                  f"{med(dc):+.1f} ms, CPU ratio {b}/{a} {ratio:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
