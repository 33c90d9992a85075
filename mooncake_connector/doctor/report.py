"""doctor's result: one Row per item checked, printed as a table or JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass
class Row:
    check: str
    item: str
    status: str
    detail: str
    fix: str = ""


class Report:
    def __init__(self):
        self.rows: list[Row] = []

    def add(self, check, item, status, detail, fix=""):
        self.rows.append(Row(check, item, status, detail, fix))

    @property
    def failed(self):
        return any(r.status == FAIL for r in self.rows)

    def table(self):
        heads = ("CHECK", "ITEM", "STATUS", "DETAIL")
        cells = [(r.check, r.item, r.status.upper(), r.detail) for r in self.rows]
        w = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads[:3])]
        lines = ["  ".join(h.ljust(w[i]) if i < 3 else h for i, h in enumerate(heads))]
        for r, c in zip(self.rows, cells):
            lines.append("  ".join(x.ljust(w[i]) if i < 3 else x for i, x in enumerate(c)))
            if r.fix:
                lines.append(" " * (w[0] + w[1] + 4) + "fix: " + r.fix)
        n = {s: sum(r.status == s for r in self.rows) for s in (OK, WARN, FAIL, SKIP)}
        lines.append(f"\n{n[OK]} ok, {n[WARN]} warnings, {n[FAIL]} failed, {n[SKIP]} skipped")
        return "\n".join(lines)

    def as_json(self):
        return json.dumps({"ok": not self.failed, "rows": [asdict(r) for r in self.rows]},
                          indent=2)
