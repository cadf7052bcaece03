"""Registers, stack and spills of every flash-attention kernel, from NVRTC's ptxas (-v), offline.

usage: NVRTC_LIB_DIR=/path/to/nvidia/cu13/lib python3 crates/rumble-cuda/tests/flash_emu/resources.py [mma|fma] [DP,...] [CFG,...]

(CFG: the FCFG numbers of kernels/flash_attn.cu's tiling configurations; default all. With
FLASH_WG=1 the modules take the wgmma kernels (FWG 1, sm_90a), as src/flash.rs compiles them on
an H100 / H200 at padded head sizes 64 and 128.)

Compiles the sources as src/flash.rs does (prelude + defines + kernel file, sm_90, --fmad=true)
and prints one line per module. Needs libnvrtc (e.g. the nvidia-cuda-nvrtc wheel); no GPU.
"""
import ctypes
import os
import re
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
kernels = os.path.join(here, "..", "..", "src", "kernels")
lib = ctypes.CDLL(os.path.join(os.environ.get("NVRTC_LIB_DIR", ""), "libnvrtc.so.13"))


def compile(src, opts):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"flash.cu", 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode()


def report(fname, defines, label):
    prelude = open(os.path.join(kernels, "prelude.cuh")).read()
    body = open(os.path.join(kernels, fname)).read()
    src = prelude + "\n" + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + body
    t0 = time.time()
    arch = "sm_90a" if defines.get("FWG") else "sm_90"
    rc, log = compile(src, [f"--gpu-architecture={arch}", "--std=c++17", "--fmad=true", "--ptxas-options=-v"])
    if rc != 0:
        print(f"{label}: FAILED\n{log[:4000]}")
        return False
    fn, stack, parts = None, None, []
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack = m.groups()
        m = re.search(r"Used (\d+) registers", line)
        if m:
            parts.append(f"{fn} {m.group(1)} regs, stack {stack[0]}, spill {stack[1]}/{stack[2]}")
    print(f"{label} ({time.time() - t0:.1f}s): " + "; ".join(parts))
    return True


which = sys.argv[1] if len(sys.argv) > 1 else "mma"
ok = True
if which == "mma":
    dps = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 and sys.argv[2] else range(16, 257, 16)
    cfgs = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else range(4)
    for dp in dps:
        for c in cfgs:
            wg = int(os.environ.get("FLASH_WG", "0"))
            defs = {"FT": "bf16", "FLASH_F16": 0, "FDP": dp, "FCFG": c, "FWG": wg}
            ok &= report("flash_attn.cu", defs, f"bf16 dp{dp} cfg{c}{' wg' if wg else ''}")
else:
    dps = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else range(32, 257, 32)
    for dp in dps:
        ok &= report("flash_fma.cu", {"FDPF": dp}, f"f32 dp{dp}")
sys.exit(0 if ok else 1)
