"""`meshserve diagnose` over step records, printing each step kind's measured executor time
over the cost model's price (median, p10, p90).

    python price_steps.py STEPS.jsonl
"""

from __future__ import annotations

import statistics
import sys
from unittest import mock

import meshserve.parallel.planner.diagnosis as dg
from meshserve.launch import diagnose


def main() -> None:
    rows = []
    split_step = dg.split_step

    def spy(record, cost):  # noqa: ANN001, ANN202
        parts, predicted = split_step(record, cost)
        rows.append((record, predicted))
        return parts, predicted

    with mock.patch.object(dg, "split_step", spy):
        diagnose.run([f"diagnose.records={sys.argv[1]}"])
    kinds = {
        "decode-only": [r for r, _ in rows if r.is_decode_only],
        "prefill-only": [r for r, _ in rows if r.num_prefill_seqs and not r.num_decode_seqs],
        "mixed": [r for r, _ in rows if r.num_prefill_seqs and r.num_decode_seqs]}
    priced = {id(r): p for r, p in rows}
    for name, recs in kinds.items():
        xs = sorted((r.wall_s - r.scheduler_s) / priced[id(r)] for r in recs)
        if xs:
            print(f"{name} {len(xs)} measured/priced median {statistics.median(xs):.3f} "
                  f"p10 {xs[len(xs) // 10]:.3f} p90 {xs[9 * len(xs) // 10]:.3f}")


if __name__ == "__main__":
    main()
