import sys, statistics
from unittest import mock
import meshserve.parallel.planner.diagnosis as dg
from meshserve.launch import diagnose as D
rows = []
orig = dg.split_step
def spy(record, cost):
    parts, pred = orig(record, cost)
    rows.append((record, pred))
    return parts, pred
with mock.patch.object(D, "diagnose", wraps=D.diagnose), mock.patch.object(dg, "split_step", spy):
    D.run([f"diagnose.records={sys.argv[1]}"])
dec = [(r.wall_s - r.scheduler_s) / p for r, p in rows if r.is_decode_only]
pre = [(r.wall_s - r.scheduler_s) / p for r, p in rows if r.num_prefill_seqs and not r.num_decode_seqs]
mix = [(r.wall_s - r.scheduler_s) / p for r, p in rows if r.num_prefill_seqs and r.num_decode_seqs]
for name, xs in (("decode-only", dec), ("prefill-only", pre), ("mixed", mix)):
    if xs:
        print(name, len(xs), "measured/priced median %.3f p10 %.3f p90 %.3f" % (statistics.median(xs), sorted(xs)[len(xs)//10], sorted(xs)[9*len(xs)//10]))
ex = [r for r, p in rows if r.is_decode_only][-1]
print(ex, [p for r, p in rows if r is ex])
