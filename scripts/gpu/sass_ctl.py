"""How ptxas scheduled a kernel: its SASS with each instruction's control bits decoded, no GPU needed.

Since Volta every 128-bit instruction carries its scheduling in bits 105-125 (Jia et al.,
"Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018): the cycles the warp
stalls before its next instruction, a yield hint, the scoreboard a variable-latency result (a
load, a shuffle) will release (wb) and the one guarding its source registers (rb), and the
scoreboards the instruction waits on. cuobjdump prints the bits but not their meaning; this
prints `st` (stall), `y`, `wb`, `rb` and `w` (the wait mask, scoreboards 5..0) before each
instruction, and the total of the stall counts over the lines shown.

    python3 scripts/gpu/sass_ctl.py kernels/attention.cu attn_exact_pv_q8 [--from 3a00 --to 4b60]
    python3 scripts/gpu/sass_ctl.py --sass dump.txt [KERNEL] [--from ... --to ...]   # cuobjdump -sass output

A .cu is compiled the way the backend compiles it (runtime.module_source, runtime.NVCC_OPTIONS)
for sm_90 and disassembled with cuobjdump — the CUDA toolkit's or the nvidia-cuda-cuobjdump
wheel's, which needs nvdisasm beside it (`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`).
Stall counts are ptxas's static schedule; waits on scoreboards and on the memory pipes come on
top (gpu_pv_trace.py measures those).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# cuobjdump -sass: "        /*3da0*/   FMUL R111, R12.reuse, R111 ;   /* 0x0000006f0c6f7220 */"
# followed by the instruction's high word alone: "                                 /* 0x000fe20000400000 */"
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/")
HIGH_WORD = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
NO_SCOREBOARD = 7


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    stall: int  # cycles before the warp issues its next instruction
    yield_hint: int
    write_sb: int  # scoreboard the result releases (NO_SCOREBOARD: none)
    read_sb: int  # scoreboard guarding the source registers (NO_SCOREBOARD: none)
    wait_mask: int  # scoreboards waited on before issue, bit i = scoreboard i
    reuse: int  # operand reuse-cache flags, bit i = source operand i (cuobjdump's ".reuse")

    def line(self) -> str:
        sb = lambda i: "-" if i == NO_SCOREBOARD else str(i)  # noqa: E731
        return (f"{self.address:04x} st{self.stall:2d} y{self.yield_hint} wb{sb(self.write_sb)} rb{sb(self.read_sb)}"
                f" w{self.wait_mask:06b}  {self.text}")


def control(high_word: int) -> dict[str, int]:
    """The control fields of an instruction's high 64 bits (instruction bits 105-125)."""
    c = high_word >> 41
    return {"stall": c & 0xF, "yield_hint": (c >> 4) & 1, "write_sb": (c >> 5) & 7, "read_sb": (c >> 8) & 7,
            "wait_mask": (c >> 11) & 0x3F, "reuse": (c >> 17) & 0xF}


def parse(sass: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass text -> each function's instructions, in address order."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    lines = sass.splitlines()
    for n, text in enumerate(lines):
        fn = re.match(r"^\s*Function : (\S+)", text)
        if fn:
            current = functions.setdefault(fn.group(1), [])
            continue
        m = INSTRUCTION.match(text)
        if m and current is not None:
            hi = HIGH_WORD.match(lines[n + 1]) if n + 1 < len(lines) else None
            if hi is None:
                raise ValueError(f"line {n + 2}: expected the high word of {m.group(2)!r}")
            current.append(Instruction(int(m.group(1), 16), m.group(2), **control(int(hi.group(1), 16))))
    return functions


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel puts it under nvidia/cu*/bin
        for base in nvidia.__path__:
            for candidate in sorted(Path(base).glob("cu*/bin/cuobjdump")):
                return str(candidate)
    except ImportError:
        pass
    sys.exit("sass_ctl.py: no cuobjdump on PATH; install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")


def disassemble(cu: Path, function: str) -> str:
    from kestrel_tui.backends.cuda.runtime import NVCC_OPTIONS, module_source

    tool = cuobjdump()
    nvcc = shutil.which("nvcc") or sys.exit("sass_ctl.py: no nvcc on PATH (the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, cu.name), Path(tmp, "k.cubin")
        src.write_text(module_source(cu.stem, cu.read_text()))
        built = subprocess.run([nvcc, "-arch=sm_90", "-cubin", *NVCC_OPTIONS, "-o", str(cubin), str(src)],
                               capture_output=True, text=True)
        if built.returncode:
            first = next((ln for ln in built.stderr.splitlines() if "error" in ln), built.stderr.strip())
            sys.exit(f"sass_ctl.py: nvcc failed on {cu}: {first[:200]}")
        # cuobjdump -sass runs nvdisasm, which the cuobjdump wheel does not bring
        env = dict(os.environ, PATH=os.pathsep.join([os.environ.get("PATH", ""), str(Path(tool).parent)]))
        dump = subprocess.run([tool, "-sass", "-fun", function, str(cubin)], capture_output=True, text=True, env=env)
        if dump.returncode:
            why = dump.stderr.strip().splitlines()[-1] if dump.stderr.strip() else f"exit {dump.returncode}"
            hint = " (`pip install nvidia-cuda-nvdisasm`)" if "nvdisasm" in why else ""
            sys.exit(f"sass_ctl.py: cuobjdump failed on {function}: {why}{hint}")
        return dump.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cu", nargs="?", type=Path, help="a kernels/*.cu file (or a variant of one)")
    ap.add_argument("function", nargs="?", help="the kernel's name; all functions when absent with --sass")
    ap.add_argument("--sass", type=Path, help="read cuobjdump -sass output instead of compiling")
    ap.add_argument("--from", dest="lo", type=lambda s: int(s, 16), default=0, help="first address (hex)")
    ap.add_argument("--to", dest="hi", type=lambda s: int(s, 16), default=1 << 32, help="last address (hex)")
    args = ap.parse_args()
    if args.sass is not None:  # the one positional, if any, is the kernel's name
        function = args.function or (str(args.cu) if args.cu else None)
        functions, source = parse(args.sass.read_text()), str(args.sass)
    elif args.cu is None or args.function is None:
        ap.error("give a .cu and a kernel name, or --sass FILE [KERNEL]")
    else:
        function = args.function
        functions, source = parse(disassemble(args.cu, function)), f'{args.cu} (its extern "C" name)'
    if function:
        if not functions.get(function):
            sys.exit(f"sass_ctl.py: no kernel {function} in {source}")
        functions = {function: functions[function]}
    for name, instructions in functions.items():
        shown = [i for i in instructions if args.lo <= i.address <= args.hi]
        print(f"== {name}: {len(shown)} instructions, {sum(i.stall for i in shown)} stall cycles")
        for i in shown:
            print(i.line())


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
