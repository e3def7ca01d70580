"""Summarises Mosaic GPU profiler traces of the Mosaic kernels.

    JAX_FLASH_MOSAIC_PROFILE_DIR=DIR python3 ...   # on the GPU: one trace a launch
    python3 benchmarks/profile_summary.py DIR/*.json

A trace (Chrome trace JSON, as Mosaic GPU's profiler writes it) holds, per
warpgroup of every CTA (`tid`; a CTA's warpgroups are consecutive tids), on
its multiprocessor (`pid`), begin/end events of the kernel's named regions
(`jax.named_scope`: the forward's "q_load", "tiles" with a "k_wait" and a
"v_wait" a key tile, "epilogue"; Mosaic's own "Init"). Prints one JSON line
a file and region: how often it ran, the median and mean duration in
microseconds, the median of each warpgroup's first occurrence, and its
share of the warpgroups' time (from a warpgroup's first event to its last);
then "cta_gap": the time between one CTA's last event and the next CTA's
first on the same multiprocessor (launch and set-up outside any region).
"""
import argparse
import collections
import json
import statistics


def _stats(durations, total=None, first=None):
  stats = dict(count=len(durations), median_us=statistics.median(durations),
               mean_us=statistics.fmean(durations))
  if first is not None:
    stats["first_median_us"] = statistics.median(first)
  if total is not None:
    stats["share"] = sum(durations) / total if total else 0.0
  return stats


def summarise(trace: dict, warpgroups: int = 3) -> dict:
  """{region: stats} of one trace, and "cta_gap" when a multiprocessor ran
  more than one CTA."""
  durations = collections.defaultdict(list)
  first = collections.defaultdict(list)
  spans, sm_of = {}, {}
  open_events = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    tid, ts = event["tid"], event["ts"]
    lo, hi = spans.get(tid, (ts, ts))
    spans[tid] = (min(lo, ts), max(hi, ts))
    sm_of[tid] = event["pid"]
    if event["ph"] == "B":
      open_events[tid].append((event["name"], ts))
    else:
      name, start = open_events[tid].pop()
      durations[name].append(ts - start)
      if (tid, name) not in first:
        first[(tid, name)] = ts - start
  for (tid, name), d in list(first.items()):
    first[name].append(d)
  total = sum(hi - lo for lo, hi in spans.values())
  out = {name: _stats(d, total, first[name])
         for name, d in sorted(durations.items())}
  ctas = collections.defaultdict(lambda: [float("inf"), float("-inf")])
  for tid, (lo, hi) in spans.items():
    cta = (sm_of[tid], (tid - 1) // warpgroups)
    ctas[cta] = [min(ctas[cta][0], lo), max(ctas[cta][1], hi)]
  by_sm = collections.defaultdict(list)
  for (sm, _), span in ctas.items():
    by_sm[sm].append(span)
  gaps = [b[0] - a[1] for spans_ in by_sm.values()
          for a, b in zip(sorted(spans_), sorted(spans_)[1:]) if b[0] >= a[1]]
  if gaps:
    out["cta_gap"] = _stats(gaps)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("traces", nargs="+")
  parser.add_argument("--warpgroups", type=int, default=3,
                      help="warpgroups a CTA (the Mosaic kernels: 3)")
  args = parser.parse_args()
  for path in args.traces:
    with open(path) as f:
      for name, stats in summarise(json.load(f), args.warpgroups).items():
        print(json.dumps(dict(file=path, region=name, **stats)))


if __name__ == "__main__":
  main()
