"""Static instruction mix of the kernels in a SASS dump (issue 12's
attribution of the Mosaic forward against cuDNN).

    MOSAIC_GPU_DUMP_SASS=1 python ... > dump.log 2>&1
    python benchmarks/sass_mix.py dump.log [--top 30]

Reads the dump (nvdisasm's text: a "Function : name" header, then one
instruction a line, `/*0a10*/  @P0 HGMMA.64x128x16.F32.BF16 ... ;`) and
prints, per function, one JSON line: the instruction count, the count per
opcode (the mnemonic before its first ".", predicates dropped) for the
`--top` most frequent, and per class: tensor-core (HGMMA), special-function
(MUFU: exp2, rcp), floating point (FADD/FMUL/FFMA/FMNMX...), integer,
memory (LD/ST/LDS/STS/LDG/STG/UTMA...), control and sync (BRA/BAR/SYNCS/
WARPGROUP...), other. Static counts: what the compiler emitted, not how
often it runs.
"""
from __future__ import annotations

import argparse
import collections
import json
import re

_FUNCTION = re.compile(r"Function\s*:\s*(\S+)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"
                          r"((?:\.[A-Z0-9_x]+)*)")

CLASSES = (
    ("tensor", ("HGMMA", "HMMA", "WARPGROUP")),
    ("special", ("MUFU",)),
    ("float", ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK",
               "F2F", "F2FP", "FSWZADD", "HADD2", "HMUL2", "HFMA2")),
    ("memory", ("LD", "ST", "LDS", "STS", "LDG", "STG", "LDSM", "STSM",
                "UTMALDG", "UTMASTG", "UBLKCP", "LDGSTS", "ATOM", "RED",
                "ATOMS", "LDC", "ULDC")),
    ("control", ("BRA", "BAR", "SYNCS", "EXIT", "BSYNC", "BSSY", "CALL",
                 "RET", "WARPSYNC", "NOP", "DEPBAR", "YIELD", "ELECT",
                 "USETMAXREG", "VOTE", "VOTEU", "ERRBAR", "MEMBAR", "FENCE")),
    ("integer", ("IADD3", "IMAD", "IMUL", "ISETP", "LOP3", "SHF", "LEA",
                 "IABS", "IMNMX", "SEL", "MOV", "PRMT", "S2R", "S2UR",
                 "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "UMOV",
                 "USEL", "UISETP", "R2UR", "P2R", "R2P", "PLOP3", "I2F",
                 "F2I", "SHFL", "POPC", "FLO", "BREV", "UPRMT", "CS2R",
                 "UPLOP3")),
)


def instruction_mix(text: str) -> dict[str, collections.Counter]:
  """{function name: Counter of opcodes} of a SASS dump."""
  mixes: dict[str, collections.Counter] = {}
  current = None
  for line in text.splitlines():
    header = _FUNCTION.search(line)
    if header:
      current = mixes.setdefault(header.group(1), collections.Counter())
      continue
    match = _INSTRUCTION.search(line)
    if match and current is not None:
      current[match.group(1)] += 1
  return mixes


def classify(mix: collections.Counter) -> dict[str, int]:
  """Counts per class (`CLASSES`; "other" for the rest)."""
  of = {op: name for name, ops in CLASSES for op in ops}
  out = collections.Counter()
  for op, n in mix.items():
    out[of.get(op, "other")] += n
  return dict(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  with open(args.dump) as f:
    mixes = instruction_mix(f.read())
  if not mixes:
    raise SystemExit(f"no 'Function :' header with instructions in "
                     f"{args.dump}: was MOSAIC_GPU_DUMP_SASS=1 set?")
  for name, mix in mixes.items():
    print(json.dumps(dict(function=name, instructions=sum(mix.values()),
                          classes=classify(mix),
                          opcodes=dict(mix.most_common(args.top)))))


if __name__ == "__main__":
  main()
