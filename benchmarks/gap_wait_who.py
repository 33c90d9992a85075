"""Who was on the CPUs while the decode engine thread was runnable but waiting, in its
token-2 step (issue 31, JOURNAL run 32): benchmarks/gap_wait_who.py TL.json SCHED.txt.xz
(gap_window_run.sh writes both; windows as gap_window.py --engine-side)."""
import sys, json, collections, statistics as st
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.abspath(__file__)))
import gap_window as gw
tl, sched = sys.argv[1], sys.argv[2]
d = json.load(open(tl))
g, eng, client = gw.groups_of(d['rows'])
run, wait, comm, wakes, (t0, t1) = gw.intervals(gw.perf_lines(sched))
em = {s: gw.emissions(wakes.get(e, ()), g, s, e) for s, e in eng.items()}
e = eng['decode']
for n, recs in d['rows'].items():
    who = collections.Counter(); tot = 0; nreq = 0
    for r in recs:
        if r['mode'] != 'push_ll': continue
        itl = r['itl_ms']; a = r['t_send'] + r['ttft_ms'] / 1e3; b = a + itl[0] / 1e3
        ea, eb = gw._last_before(em['decode'], a), gw._last_before(em['decode'], b)
        if ea is None or eb is None or eb <= ea or ea < r['t_send']: continue
        nreq += 1
        for (ws, we) in wait.get(e, ()):
            s, t = max(ws, ea), min(we, eb)
            if t <= s: continue
            tot += (t - s)
            for tid, ivs in run.items():
                ms = gw.overlap(ivs, s, t)
                if ms > 0 and tid != 0:
                    grp = g.get(tid, 'client' if tid in client else comm.get(tid, '?'))
                    role = ''
                    if grp in eng:
                        role = '.engine' if tid == eng[grp] else '.main' if gw.PID_OF.get(tid) == tid else '.threads'
                    who[grp + role] += ms
    print(n, 'requests', nreq, 'decode engine runnable-waiting in step N+1: %.2f ms per request; on the CPUs meanwhile (ms per request):' % (tot * 1e3 / nreq))
    print('   ', [(k, round(v * 1e3 / nreq, 2)) for k, v in who.most_common(10)])
