"""Statistics shared by the benchmark scripts."""


def pct(xs, q):
    """The q-th percentile (0..100) of xs, linearly interpolated between the
    two nearest ranks; None for no samples."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def pct_known(xs, q=50):
    """pct of the values of xs that are not None (the timelines' requests
    that lack a point); None for none."""
    return pct([x for x in xs if x is not None], q)


def parse_extra_config(ap, items, flag="--extra-c"):
    """KEY=VALUE strings (a kv_connector_extra_config key, VALUE read as
    JSON: true, 5, "x"; a bare word is a string) as a dict; ap.error names
    the bad one."""
    import json
    import re

    out = {}
    for kv in items:
        k, eq, v = kv.partition("=")
        if not eq or not re.fullmatch(r"[a-z_][a-z0-9_]*", k):
            ap.error(f"{flag} {kv!r}: expected KEY=VALUE (a kv_connector_extra_config key)")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out
