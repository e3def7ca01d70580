"""Summarises Mosaic GPU profiler traces of the Mosaic kernels.

    JAX_FLASH_MOSAIC_PROFILE_DIR=DIR python3 ...   # on the GPU: one trace a launch
    python3 benchmarks/profile_summary.py DIR/*.json

A trace (Chrome trace JSON, as Mosaic GPU's profiler writes it) holds, per
warpgroup of every CTA (`tid`; a CTA's warpgroups are consecutive tids), on
its multiprocessor (`pid`), begin/end events of the kernel's named regions
(`jax.named_scope`: the forward's "q_load", "tiles" with a "k_wait" and a
"v_wait" a key tile, "epilogue"; Mosaic's own "Init"). Units: the profiler
stamps each warpgroup's start with the global timer (ns) and its events
with the multiprocessor's cycle counter, offset to its first event; a "ts"
is (start ns + cycles since the first event) / 1000. So durations here are
in thousands of cycles, and only the starts compare across warpgroups.

Prints one JSON line a file and region: how often it ran, the median and
mean duration (kcycles), the median of each warpgroup's first occurrence,
and its share of the warpgroups' cycles (first event to last); then "cta":
per multiprocessor, the time from one CTA's start to the next's
(`period_us`, global timer) beside a CTA's own span (`span_kcycles`, its
longest warpgroup) and the spread of all CTAs' starts (`starts_us`).
"""
import argparse
import collections
import json
import statistics


def _stats(durations, total, first):
  """Count, median and mean of a region's durations, the median of each
  warpgroup's first one, and their share of `total`."""
  return dict(count=len(durations),
              median_kcycles=statistics.median(durations),
              mean_kcycles=statistics.fmean(durations),
              first_median_kcycles=statistics.median(first),
              share=sum(durations) / total if total else 0.0)


def summarise(trace: dict, warpgroups: int = 3) -> dict:
  """{region: stats} of one trace, and "cta" when a multiprocessor ran
  more than one CTA."""
  durations = collections.defaultdict(list)
  first = collections.defaultdict(list)  # Each warpgroup's first one.
  seen = set()  # (tid, region) pairs already in `first`.
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
      if (tid, name) not in seen:
        seen.add((tid, name))
        first[name].append(ts - start)
  total = sum(hi - lo for lo, hi in spans.values())
  out = {name: _stats(d, total, first[name])
         for name, d in sorted(durations.items())}
  ctas = {}  # (multiprocessor, CTA): (start ns / 1000, span kcycles).
  for tid, (lo, hi) in spans.items():
    cta = (sm_of[tid], (tid - 1) // warpgroups)
    start, span = ctas.get(cta, (lo, 0.0))
    ctas[cta] = (min(start, lo), max(span, hi - lo))
  by_sm = collections.defaultdict(list)
  for (sm, _), start_span in ctas.items():
    by_sm[sm].append(start_span)
  periods = [b[0] - a[0] for runs in by_sm.values()
             for a, b in zip(sorted(runs), sorted(runs)[1:])]
  if periods:
    starts = [start for start, _ in ctas.values()]
    out["cta"] = dict(
        count=len(ctas), period_us=statistics.median(periods),
        span_kcycles=statistics.median(span for _, span in ctas.values()),
        starts_us=max(starts) - min(starts))
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
