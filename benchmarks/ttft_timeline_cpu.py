"""CPU per request and paired TTFT by mode from a ttft_timeline.py --out file
(issue 31, run 25): every thread of the mode's servers (prefill, decode, its
push proxy; colocated: the server, + its pass-through proxy), median; gap 1->2
and ITL p50; paired deltas of the --tree-b / --env-c / --whole A/B modes.

    python3 benchmarks/ttft_timeline_cpu.py build/ttft_timeline.json
"""
import json, sys, statistics as st
d = json.load(open(sys.argv[1]))
rows = d["rows"]
def servers(mode):
    if mode == "colocated": return ["colocated"]
    if mode == "colocated_proxy": return ["colocated", "proxy_colocated"]
    for base in ("push_ll", "push_whole"):
        if mode == base: return ["prefill", "decode", "proxy_" + base]
        if mode.startswith(base + "_"):
            sfx = mode[len(base):]
            return ["prefill" + sfx, "decode" + sfx, "proxy_" + base + sfx]
    return []
for n, recs in rows.items():
    modes = list(dict.fromkeys(r["mode"] for r in recs))
    print(f"== {n} words, prompt tokens {recs[0].get('prompt_tokens')}")
    by = {}
    for r in recs:
        i = r["rid"].rsplit("-", 2)[1]
        by.setdefault(i, {})[r["mode"]] = r
    for m in modes:
        rs = [r for r in recs if r["mode"] == m]
        cpu = [sum(v for s in servers(m) for t, v in (r["cpu_ms"].get(s) or {}).items() if not t.startswith("rq:")) for r in rs]
        dec = [sum(v for t, v in (r["cpu_ms"].get(servers(m)[1] if m.startswith("push") else "x") or {}).items() if not t.startswith("rq:")) for r in rs]
        gap = [r["itl_ms"][0] for r in rs if r["itl_ms"]]
        itl = [x for r in rs for x in r["itl_ms"][1:]]
        ident = sum(1 for r in rs if r.get("identical"))
        print(f"  {m:18s} n={len(rs)} TTFT p50 {st.median([r['ttft_ms'] for r in rs]):6.1f}  CPU/req p50 {st.median(cpu):6.1f}"
              f"  decode CPU p50 {st.median(dec):5.1f}  gap1->2 p50 {st.median(gap) if gap else float('nan'):5.1f}"
              f"  ITL p50 {st.median(itl) if itl else float('nan'):5.1f}  identical {ident}/{len(rs)}")
    pairs = [("push_ll_main", "push_ll"), ("push_whole_main", "push_whole"), ("push_ll", "push_ll_c"), ("push_ll_main", "push_ll_c")]
    for a, b in pairs:
        if a in modes and b in modes:
            dt = [v[a]["ttft_ms"] - v[b]["ttft_ms"] for v in by.values() if a in v and b in v]
            def c(r, m): return sum(vv for s in servers(m) for t, vv in (r["cpu_ms"].get(s) or {}).items() if not t.startswith("rq:"))
            dc = [c(v[a], a) - c(v[b], b) for v in by.values() if a in v and b in v]
            cr = st.median([c(v[b], b) for v in by.values() if a in v and b in v]) / st.median([c(v[a], a) for v in by.values() if a in v and b in v])
            print(f"  paired {a} - {b}: TTFT median {st.median(dt):+.1f} ms, CPU median {st.median(dc):+.1f} ms, CPU ratio {b}/{a} {cr:.2f}")
