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
