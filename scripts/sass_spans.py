"""Code size of the transport kernels and the span of code between their trace stamps, read from
the built extension's SASS. Needs no GPU: a change to a kernel's hot path can be checked here
(did the code the compiler emitted change as intended, did the span shrink) before device time
is spent on it.

Why spans: on one H200 the small-T stages cost by the span of code they pass, not only by what
runs (docs/history.md, session 14: compiling two never-called error reports out of line took
about 0.2 us off each stage).

Usage:
    python scripts/sass_spans.py [--so torch_afdep/_cuda*.so] [--cuobjdump PATH] [--sass FILE]
        [--resources FILE] [--kernel NAME] [--against OLD_SASS]
Prints, per kernel: its code bytes, its integer divisions by a run-time value (each starts
with an `I2F.RP` or `I2F.U32.RP`, the reciprocal's seed; the small-T forms should have none,
docs/protocol.md), each %globaltimer read (the trace stamps, the deadlines) with its offset
and the bytes since the previous one, plus the barriers, fences and calls in between, and the
64-byte lines of its parameter block (constant bank 0) in the order the code first reads them:
each launch's block is new, so each line's first read misses the constant cache. With the
extension (or --resources, a saved `cuobjdump --dump-resource-usage` listing) it also prints
each kernel's registers a thread and stack bytes: on a GPU that ranks share, whether one rank's
CTA still fits on an SM beside another's depends on them (65,536 registers an SM). --sass reads
a saved `cuobjdump -sass` listing instead of running it.

--against OLD_SASS (a saved `cuobjdump -sass` listing of another build, e.g. the commit before
a change) prints instead, per kernel instantiation, whether its instructions are OLD's
instruction for instruction (SAME), differ (DIFF), or exist in one listing only (NEW, GONE),
with both instruction counts: how a change that adds an instantiation of its own shows that
every other one is untouched.

cuobjdump: --cuobjdump, $CUOBJDUMP, PATH, or /usr/local/cuda/bin. A machine with nvcc but no
cuobjdump (this workplace's CPU machines) can take NVIDIA's from PyPI:
    pip download --no-deps -d /tmp/cuobjdump nvidia-cuda-cuobjdump
    python -m zipfile -e /tmp/cuobjdump/nvidia_cuda_cuobjdump-*.whl /tmp/cuobjdump/x
    # binary: /tmp/cuobjdump/x/nvidia/cu13/bin/cuobjdump (chmod +x)
`cuobjdump -sass` also runs NVIDIA's disassembler, `nvdisasm`: where the machine lacks it, the
same way from `nvidia-cuda-nvdisasm`, its directory in NVDISASM_PATH (chmod +x).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

_FUNC = re.compile(r"^\s*Function : (\S+)")
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
#: instructions worth seeing between two stamps (the rest is counted)
_NOTABLE = ("BAR.", "MEMBAR", "CALL", "ATOMS", "ATOMG", "MATCH", "REDUX", "ACQBULK")
#: the first instruction of the compiler's integer division by a run-time divisor
_DIVISION = re.compile(r"^(@!?U?P\w+\s+)?I2F(\.U32)?\.RP\b")
_RES_FUNC = re.compile(r"^\s*Function (\S+):\s*$")
_RES_FIELD = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def parse_sass(text: str) -> Dict[str, List[Tuple[int, str]]]:
    """`cuobjdump -sass` text -> {mangled kernel name: [(byte offset, instruction), ...]}."""
    out: Dict[str, List[Tuple[int, str]]] = {}
    cur: Optional[List[Tuple[int, str]]] = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


def parse_resources(text: str) -> Dict[str, Dict[str, int]]:
    """`cuobjdump --dump-resource-usage` text -> {mangled kernel name: {"REG": registers a
    thread, "STACK", "SHARED", "LOCAL": bytes}}."""
    out: Dict[str, Dict[str, int]] = {}
    cur: Optional[str] = None
    for line in text.splitlines():
        m = _RES_FUNC.match(line)
        if m:
            cur = m.group(1)
            continue
        fields = _RES_FIELD.findall(line)
        if cur is not None and fields:
            out[cur] = {k: int(v) for k, v in fields}
            cur = None
    return out


def short_name(mangled: str) -> str:
    """The kernel's own name inside the mangled one (dispatch_kernel, combine_kernel, ...),
    with its integer template argument where it has one (dispatch_kernel<1>: KernelForm) and
    its bool ones up to the last true one (combine_kernel<1, true>: AFDEP_SPREAD_CHUNKS';
    dispatch_kernel<1, false, true>: AFDEP_SHUFFLE_MATCH's)."""
    found = re.findall(r"\d+([a-z_]+_kernel)(?:ILi(\d+)E((?:Lb[01]E)*)E)?E", mangled)
    if not found:
        return mangled
    name, form, flags = found[-1]
    if not form:
        return name
    bools = ["true" if b == "1" else "false" for b in re.findall(r"Lb([01])E", flags)]
    while bools and bools[-1] == "false":
        bools.pop()
    return f"{name}<{', '.join([form] + bools)}>"


def form_names(header: Optional[str] = None) -> Dict[int, str]:
    """KernelForm's names by value (2 -> "kSmallRecv"), read from its list AFDEP_KERNEL_FORMS
    in csrc/include/afdep/forms.h (``header``); {} when the file or the list is absent."""
    header = header or os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                    "csrc", "include", "afdep", "forms.h")
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return {}
    body = re.search(r"#define AFDEP_KERNEL_FORMS\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    if not body:
        return {}
    return {int(v): k for k, v in re.findall(r"X\((k\w+),\s*(\d+)\)", body.group(1))}


def spans(insns: List[Tuple[int, str]]) -> Dict[str, object]:
    """Code bytes, integer divisions, and each %globaltimer read with the bytes and notable
    instructions since the previous one (the first: since the kernel's start)."""
    size = insns[-1][0] + 16 if insns else 0
    divisions = sum(1 for _, ins in insns if _DIVISION.match(ins))
    stamps = []
    prev, notable, count = 0, [], 0
    for off, ins in insns:
        if "SR_GLOBALTIMER" in ins:
            stamps.append({"offset": off, "bytes": off - prev, "instructions": count,
                           "notable": notable})
            prev, notable, count = off, [], 0
            continue
        count += 1
        words = ins.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # predicate
        if op.startswith(_NOTABLE):
            notable.append(op)
    return {"bytes": size, "divisions": divisions, "stamps": stamps}


#: a read of constant bank 0 at a fixed offset (the kernel parameters start at 0x210 on sm_90;
#: the driver's words below them, e.g. the global-memory descriptor at 0x208)
_CONST0 = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_CONST0_INDEXED = re.compile(r"c\[0x0\]\[U?R\d+")
PARAM_BASE, PARAM_LINE = 0x200, 64


def param_lines(insns: List[Tuple[int, str]]) -> Dict[str, object]:
    """The 64-byte lines of constant bank 0 from PARAM_BASE on that the code reads at fixed
    offsets, in the order of their first read: [(line's first offset, index of the first
    instruction reading it)], and how many reads are indexed by a register (their line is known
    only at run time). Each launch gets a new parameter block, so each line's first read misses
    the constant cache (docs/history.md, session 45)."""
    first: Dict[int, int] = {}
    indexed = 0
    for i, (_, ins) in enumerate(insns):
        for off in _CONST0.findall(ins):
            o = int(off, 16)
            if o >= PARAM_BASE:
                first.setdefault(o // PARAM_LINE * PARAM_LINE, i)
        indexed += len(_CONST0_INDEXED.findall(ins))
    return {"lines": sorted(first.items(), key=lambda kv: kv[1]), "indexed": indexed}


def compare(old: Dict[str, List[Tuple[int, str]]],
            new: Dict[str, List[Tuple[int, str]]]) -> List[Tuple[str, str, int, int]]:
    """(status, short name, old instruction count, new count) per kernel instantiation, by
    short_name (the file hash in the mangled name changes between builds): "SAME" where the
    instructions are equal one for one (their offsets aside), else "DIFF"; "NEW" / "GONE" for
    one listing's only (count 0 in the other). The new listing's order, then the gone ones."""
    a = {short_name(k): [ins for _, ins in v] for k, v in old.items()}
    b = {short_name(k): [ins for _, ins in v] for k, v in new.items()}
    out = []
    for name, insns in b.items():
        if name not in a:
            out.append(("NEW", name, 0, len(insns)))
        else:
            out.append(("SAME" if a[name] == insns else "DIFF", name, len(a[name]), len(insns)))
    out += [("GONE", name, len(insns), 0) for name, insns in a.items() if name not in b]
    return out


def _cuobjdump(explicit: Optional[str]) -> str:
    for c in (explicit, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
              "/usr/local/cuda/bin/cuobjdump"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("cuobjdump not found: pass --cuobjdump or set CUOBJDUMP "
                     "(this script's docstring says where to get one)")


def _summary(notable: List[str]) -> str:
    counts = collections.Counter(notable)  # first-seen order
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--so", default=None, help="the extension (default torch_afdep/_cuda*.so)")
    p.add_argument("--cuobjdump", default=None)
    p.add_argument("--sass", default=None, help="a saved cuobjdump -sass listing")
    p.add_argument("--resources", default=None,
                   help="a saved cuobjdump --dump-resource-usage listing (with --sass)")
    p.add_argument("--kernel", default=None,
                   help="only kernels whose name (with its form's, e.g. kSmallRecv) contains this")
    p.add_argument("--against", default=None, metavar="OLD_SASS",
                   help="compare each instantiation with a saved cuobjdump -sass listing")
    args = p.parse_args(argv)
    res_text = ""
    if args.resources:
        with open(args.resources) as f:
            res_text = f.read()
    if args.sass:
        with open(args.sass) as f:
            text = f.read()
    else:
        so = args.so or next(iter(sorted(glob.glob("torch_afdep/_cuda*.so"))), None)
        if not so:
            raise SystemExit("no torch_afdep/_cuda*.so: build the extension or pass --so")
        tool = _cuobjdump(args.cuobjdump)
        text = subprocess.run([tool, "-sass", so], check=True, capture_output=True,
                              text=True).stdout
        if not res_text:
            res_text = subprocess.run([tool, "--dump-resource-usage", so], check=True,
                                      capture_output=True, text=True).stdout
    resources = parse_resources(res_text)
    kernels = parse_sass(text)
    if not kernels:
        raise SystemExit("no kernels in the listing")
    forms = form_names()

    def named(short: str) -> str:  # with the form's name (KernelForm, afdep/forms.h)
        form = re.search(r"<(\d+)(?:, (?:true|false))*>$", short)
        return f"{short} {forms[int(form.group(1))]}" if form and int(form.group(1)) in forms \
            else short

    if args.against:
        with open(args.against) as f:
            old = parse_sass(f.read())
        rows = [r for r in compare(old, kernels) if not args.kernel or args.kernel in named(r[1])]
        for status, short, n_old, n_new in rows:
            print(f"{status:4s} {named(short)}: {n_old} -> {n_new} instructions")
        counts = collections.Counter(r[0] for r in rows)
        print(", ".join(f"{k} {counts[k]}" for k in ("SAME", "DIFF", "NEW", "GONE")))
        return 0
    for name, insns in kernels.items():
        short = named(short_name(name))
        if args.kernel and args.kernel not in short:
            continue
        s = spans(insns)
        res = resources.get(name)
        regs = (f", {res.get('REG', 0)} registers a thread, {res.get('STACK', 0)} B stack"
                if res else "")
        print(f"{short}: {s['bytes']:,} bytes of code, {s['divisions']} integer divisions, "
              f"{len(s['stamps'])} %globaltimer reads{regs}")
        for st in s["stamps"]:
            print(f"  at {st['offset']:#07x}: +{st['bytes']:>7,} B ({st['instructions']:>5} "
                  f"instructions) {_summary(st['notable'])}")
        pl = param_lines(insns)
        firsts = ", ".join(f"{off:#x}@{i}" for off, i in pl["lines"])
        print(f"  parameter lines read: {len(pl['lines'])} (line@first instruction: {firsts}); "
              f"{pl['indexed']} indexed reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
