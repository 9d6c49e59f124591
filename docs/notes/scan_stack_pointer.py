"""Every cubin under a Triton cache, disassembled, for the stack pointer read as data (lab
probe, not maintained).

The ptxas that triton 3.6 ships (CUDA 12.8) once widened the stack pointer register R1 in
place of a freshly packed e4m3 value (NOTES-decode-fp8.md, "QK straight from the fp8
ring slot"). R1 is set once from the constant bank and then only addresses the stack;
this lists each cubin with an instruction that reads R1 as a source operand otherwise.

    TRITON_CACHE_DIR=/tmp/tc python -m pytest -q -n 8 -m gpu tests   (fills the cache)
    python docs/notes/scan_stack_pointer.py /tmp/tc [--all]

Inductor's generated kernels (triton_poi_ / triton_per_ / triton_red_ / triton_tem_) read
R1 for their stack frames' arithmetic; they are skipped unless --all is given. The
cubins are disassembled in parallel, one process per CPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import triton

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
INSTR = re.compile(r"/\*[0-9a-f]+\*/\s+(.*?);")
R1 = re.compile(r"-?R1(\.[A-Z0-9_]+)?")
SP_SETUP = re.compile(r"(IADD3|MOV|VIADD|IMAD\.MOV|LDC)")     # R1's own set-up and moves


def r1_reads(cubin: Path) -> list[str]:
    """The instructions of one cubin that read R1 as a plain source operand."""
    sass = subprocess.run([str(NVDISASM), "-c", str(cubin)], capture_output=True,
                          text=True).stdout
    hits = []
    for line in sass.splitlines():
        m = INSTR.search(line)
        if not m or len(m.group(1).split(None, 1)) < 2:
            continue
        op, rest = m.group(1).split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        if any(R1.fullmatch(a) for a in args[1:]):
            if SP_SETUP.match(op) and args[0] == "R1":
                continue
            hits.append(m.group(1))
    return hits


INDUCTOR = ("triton_poi_", "triton_per_", "triton_red_", "triton_tem_")


def main():
    from concurrent.futures import ThreadPoolExecutor
    cubins = sorted(Path(sys.argv[1]).rglob("*.cubin"))
    if "--all" not in sys.argv:
        cubins = [c for c in cubins if not c.name.startswith(INDUCTOR)]
    flagged = 0
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:     # nvdisasm runs as processes
        found = list(pool.map(r1_reads, cubins))
    for c, hits in zip(cubins, found):
        if hits:
            flagged += 1
            print(f"{c.name}: {len(hits)} {hits[:4]}", flush=True)
    print(f"{len(cubins)} cubins scanned, {flagged} with R1 read as data")


if __name__ == "__main__":
    main()
