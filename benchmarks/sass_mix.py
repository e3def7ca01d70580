"""Static instruction mix of the kernels in a SASS dump (the Mosaic-forward goal's
attribution of the Mosaic forward against cuDNN).

    MOSAIC_GPU_DUMP_TO=/tmp/dump python ...   # NAME.ptx (.sass) per module
    python benchmarks/sass_mix.py /tmp/dump [--top 30] [--assemble]

Mosaic GPU writes NAME.sass only where it finds nvdisasm in its CUDA root
(the H200 machine has none); `--assemble` makes it from NAME.ptx first with
`ptxas -arch=sm_90a` and `nvdisasm` (PTXAS / NVDISASM, or from PATH; PTX of
CUDA 13 needs a ptxas of CUDA 13), on any machine.

Reads every `*.sass` file of a folder, or the files named (nvdisasm's text,
as Mosaic GPU writes it: a function's section, `.text.NAME:`, or
cuobjdump's `Function : NAME` header, then one instruction a line,
`/*0a10*/  @P0 HGMMA.64x128x16.F32.BF16 ... ;`) and prints, per function
(named `FILE/NAME` where a folder holds several modules; with `--loops`
also per innermost loop that runs HGMMA, the kernels' per-tile bodies, in
address order), one JSON line: the instruction count, the count per
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
import os
import pathlib
import re
import subprocess

_FUNCTION = re.compile(r"Function\s*:\s*(\S+)|^\s*\.text\.(\S+):\s*$")
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
      name = header.group(1) or header.group(2)
      current = mixes.setdefault(name, collections.Counter())
      continue
    match = _INSTRUCTION.search(line)
    if match and current is not None:
      current[match.group(1)] += 1
  return mixes


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"\bBRA\b[^;]*?(\.L_x_\d+)")


def tensor_loops(text: str) -> dict[str, list[collections.Counter]]:
  """{function name: [Counter of opcodes of each innermost loop that runs
  tensor-core instructions]} of nvdisasm's text: a loop is the span from a
  label to a branch back to it; innermost: no other such loop inside it
  (the kernels' per-tile bodies, not the spans of a polling wait's retry
  branch around them)."""
  functions: dict[str, list] = {}
  ops = labels = None
  for line in text.splitlines():
    header = _FUNCTION.search(line)
    if header:
      ops, labels = [], {}
      functions[header.group(1) or header.group(2)] = (ops, labels)
      continue
    if ops is None:
      continue
    label = _LABEL.match(line)
    if label:
      labels[label.group(1)] = len(ops)
      continue
    match = _INSTRUCTION.search(line)
    if match:
      target = _TARGET.search(line) if match.group(1) == "BRA" else None
      ops.append((match.group(1), target and target.group(1)))
  out = {}
  for name, (ops, labels) in functions.items():
    spans = [(labels[t], i) for i, (op, t) in enumerate(ops)
             if t in labels and labels[t] <= i]
    spans = [(a, b) for a, b in spans
             if any(op in CLASSES[0][1] for op, _ in ops[a:b + 1])]
    inner = [(a, b) for a, b in spans
             if not any(a <= c and d <= b and (c, d) != (a, b)
                        for c, d in spans)]
    out[name] = [collections.Counter(op for op, _ in ops[a:b + 1])
                 for a, b in sorted(inner)]
  return out


def classify(mix: collections.Counter) -> dict[str, int]:
  """Counts per class (`CLASSES`; "other" for the rest)."""
  of = {op: name for name, ops in CLASSES for op in ops}
  out = collections.Counter()
  for op, n in mix.items():
    out[of.get(op, "other")] += n
  return dict(out)


def assemble(ptx: pathlib.Path) -> pathlib.Path:
  """NAME.ptx -> NAME.cubin (sm_90a) -> NAME.sass (nvdisasm's text)."""
  cubin, sass = ptx.with_suffix(".cubin"), ptx.with_suffix(".sass")
  subprocess.run([os.environ.get("PTXAS", "ptxas"), "-arch=sm_90a", str(ptx),
                  "-o", str(cubin)], check=True)
  text = subprocess.run([os.environ.get("NVDISASM", "nvdisasm"), "-ndf", "-c",
                         str(cubin)], check=True, capture_output=True,
                        text=True).stdout
  sass.write_text(text)
  return sass


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dumps", nargs="+",
                      help="a folder of *.sass files, or the files")
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--assemble", action="store_true",
                      help="make NAME.sass from NAME.ptx where it is missing")
  parser.add_argument("--loops", action="store_true",
                      help="also one line per innermost tensor-core loop")
  args = parser.parse_args(argv)
  if args.assemble:
    for dump in args.dumps:
      for ptx in sorted(pathlib.Path(dump).glob("*.ptx")):
        if not ptx.with_suffix(".sass").exists():
          assemble(ptx)
  paths = []
  for dump in args.dumps:
    paths += sorted(pathlib.Path(dump).glob("*.sass")) if os.path.isdir(
        dump) else [pathlib.Path(dump)]
  mixes, loops = {}, {}
  for path in paths:
    text = path.read_text()
    named = lambda name: f"{path.stem}/{name}" if len(paths) > 1 else name
    for name, mix in instruction_mix(text).items():
      mixes[named(name)] = mix
    if args.loops:
      for name, bodies in tensor_loops(text).items():
        loops[named(name)] = bodies
  if not mixes:
    raise SystemExit(f"no function with instructions in {args.dumps}: was "
                     f"MOSAIC_GPU_DUMP_TO (or MOSAIC_GPU_DUMP_SASS) set?")
  for name, mix in mixes.items():
    print(json.dumps(dict(function=name, instructions=sum(mix.values()),
                          classes=classify(mix),
                          opcodes=dict(mix.most_common(args.top)))))
    for i, body in enumerate(loops.get(name, ())):
      print(json.dumps(dict(function=name, loop=i,
                            instructions=sum(body.values()),
                            classes=classify(body),
                            opcodes=dict(body.most_common(args.top)))))


if __name__ == "__main__":
  main()
