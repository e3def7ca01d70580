"""Summarises Mosaic GPU profiler traces of the Mosaic kernels.

    JAX_FLASH_MOSAIC_PROFILE_DIR=DIR python3 ...   # on the GPU: one trace a launch
    python3 benchmarks/profile_summary.py DIR/*.json

A trace (Chrome trace JSON, as Mosaic GPU's profiler writes it) holds, per
warpgroup of every CTA (`tid`), begin/end events of the kernel's named
regions (`jax.named_scope`: the forward's "q_load", "tiles", "epilogue").
Prints one JSON line a file and region: how often it ran, its median and
mean duration in microseconds, and its share of the warpgroups' time (from
a warpgroup's first event to its last).
"""
import argparse
import collections
import json
import statistics


def summarise(trace: dict) -> dict:
  """{region: {count, median_us, mean_us, share}} of one trace."""
  durations = collections.defaultdict(list)
  spans = {}
  open_events = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    tid, ts = event["tid"], event["ts"]
    first, last = spans.get(tid, (ts, ts))
    spans[tid] = (min(first, ts), max(last, ts))
    if event["ph"] == "B":
      open_events[tid].append((event["name"], ts))
    else:
      name, start = open_events[tid].pop()
      durations[name].append(ts - start)
  total = sum(last - first for first, last in spans.values())
  return {name: dict(count=len(d), median_us=statistics.median(d),
                     mean_us=statistics.fmean(d),
                     share=sum(d) / total if total else 0.0)
          for name, d in sorted(durations.items())}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("traces", nargs="+")
  for path in parser.parse_args().traces:
    with open(path) as f:
      for name, stats in summarise(json.load(f)).items():
        print(json.dumps(dict(file=path, region=name, **stats)))


if __name__ == "__main__":
  main()
