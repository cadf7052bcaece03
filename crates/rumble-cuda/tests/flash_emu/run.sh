#!/usr/bin/env bash
# Builds the flash-attention kernels for the CPU emulator (emu.h) with g++ and runs them
# against exact double attention on the issue-6 matrix: head sizes 1..256 (vectorised and
# element-wise loads), sequences that are and are not multiples of the tiles, GQA 1 and 7,
# causal and not, bf16 / f16 (tensor-core kernels, every tiling configuration FCFG) and f32
# (FMA kernels), in both operand layouts ([B, H, T, D] and the sequence-major [B, T, H, D]:
# `bthd` cases). No GPU needed.
#   tests/flash_emu/run.sh [quick|full]   (BUILD=dir keeps the binaries; default: a temp dir, removed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${BUILD:-}" ]; then
  build=$BUILD
  mkdir -p "$build"
else
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
fi
fail=0
bin() { # name defines...
  local name=$1
  shift
  [ -x "$build/$name" ] || g++ -std=c++20 -O1 -pthread "$@" -o "$build/$name" "$here/emu_main.cpp"
  echo "$build/$name"
}
run() { # binary B HQ HKV T S D CAUSAL SEED [SCALE_MUL [LAYOUT]]
  local b=$1
  shift
  "$b" "$@" || fail=1
}
# The tensor-core kernels' cases for one tiling configuration (FCFG, see kernels/flash_attn.cu):
# `all` the whole matrix, else a few shapes (head sizes 16, 64 and 128, a negative scale).
mma_cases() { # cfg all|some
  local c=$1 b
  b=$(bin bf16_64_c$c -DFT=bf16 -DFDP=64 -DFCFG=$c)
  run "$b" 1 7 1 130 130 64 1 4
  run "$b" 1 2 2 45 19 64 0 5 -1
  run "$b" 1 2 1 130 130 64 1 15 8  # peaked rows: the forward's running maximum must move late
  b=$(bin bf16_128_c$c -DFT=bf16 -DFDP=128 -DFCFG=$c)
  run "$b" 1 2 2 200 200 128 1 9
  b=$(bin bf16_16_c$c -DFT=bf16 -DFDP=16 -DFCFG=$c)
  run "$b" 1 7 1 200 200 1 1 1
  [ "$2" = all ] || return 0
  run "$b" 1 2 2 37 100 1 0 2
  run "$b" 2 2 1 65 65 16 1 3 -0.5
  b=$(bin bf16_64_c$c -DFT=bf16 -DFDP=64 -DFCFG=$c)
  run "$b" 1 2 1 64 64 60 1 6
  b=$(bin bf16_112_c$c -DFT=bf16 -DFDP=112 -DFCFG=$c)
  run "$b" 1 2 2 130 130 100 1 7
  run "$b" 1 7 1 70 70 100 0 8
  b=$(bin bf16_128_c$c -DFT=bf16 -DFDP=128 -DFCFG=$c)
  run "$b" 2 2 1 64 64 128 0 10
  run "$b" 1 1 1 300 300 128 1 22
  [ "$mode" = full ] || return 0
  b=$(bin bf16_144_c$c -DFT=bf16 -DFDP=144 -DFCFG=$c)
  run "$b" 1 2 1 70 70 136 1 11
  b=$(bin bf16_256_c$c -DFT=bf16 -DFDP=256 -DFCFG=$c)
  run "$b" 1 2 2 70 70 256 1 12
  run "$b" 1 1 1 33 50 250 0 13
  b=$(bin f16_64_c$c -DFT=f16 -DFDP=64 -DFLASH_F16=1 -DFCFG=$c)
  run "$b" 1 7 1 100 100 64 1 14
}
# The sequence-major layout [B, T, H, D] (strided rows) for one tiling configuration: GQA 7,
# head sizes 1, 64, 100 (element-wise loads) and 128, sequences that are not multiples of the
# tiles, causal and not.
mma_bthd() { # cfg all|some
  local c=$1 b
  b=$(bin bf16_64_c$c -DFT=bf16 -DFDP=64 -DFCFG=$c)
  run "$b" 2 7 1 77 77 64 1 32 1 bthd
  [ "$2" = all ] || return 0
  run "$b" 1 7 7 45 19 64 0 33 -1 bthd
  b=$(bin bf16_16_c$c -DFT=bf16 -DFDP=16 -DFCFG=$c)
  run "$b" 1 7 1 77 77 1 1 31 1 bthd
  b=$(bin bf16_112_c$c -DFT=bf16 -DFDP=112 -DFCFG=$c)
  run "$b" 1 7 1 70 70 100 1 34 1 bthd
  b=$(bin bf16_128_c$c -DFT=bf16 -DFDP=128 -DFCFG=$c)
  run "$b" 1 7 1 100 100 128 1 35 1 bthd
}
mode=${1:-full}
# quick: the default configuration `pair` (FCFG 4; DEFAULT_CFG in src/flash.rs) and `fa2` (FCFG 5,
# its own dK/dV kernel) on the quick matrix, the others on a few shapes (CI's two cores); full:
# every configuration on the whole matrix.
for c in 0 1 2 3 4 5 6 7; do
  if [ "$mode" = quick ] && [ $c != 4 ] && [ $c != 5 ]; then mma_cases $c some; else mma_cases $c all; fi
done
# bthd: the default (pair, separate delta kernel) and fa2 (its own dK/dV loads) on all its
# shapes, the others on one (1, wide, computes delta inside the dQ kernel); full: all on all.
for c in 0 1 2 3 4 5 6 7; do
  if [ "$mode" = quick ] && [ $c != 4 ] && [ $c != 5 ]; then mma_bthd $c some; else mma_bthd $c all; fi
done
# dK/dV with a group's query heads split over several block rows (FLASH_SPLIT, src/flash.rs
# dkdv_split): even and uneven splits of GQA 7 and 2, a split with empty block rows (5 of a
# group of 4), both layouts; fa2 (its own dK/dV kernel) and pair (d > 128 in fa2).
split_cases() { # cfg
  local c=$1 b
  b=$(bin bf16_64_c$c -DFT=bf16 -DFDP=64 -DFCFG=$c)
  FLASH_SPLIT=3 run "$b" 2 7 1 130 130 64 1 51
  FLASH_SPLIT=7 run "$b" 1 7 1 77 77 64 1 52 1 bthd
  b=$(bin bf16_128_c$c -DFT=bf16 -DFDP=128 -DFCFG=$c)
  FLASH_SPLIT=2 run "$b" 1 4 2 100 100 128 1 53 1 bthd
  FLASH_SPLIT=5 run "$b" 1 4 1 70 45 120 0 54
  b=$(bin bf16_16_c$c -DFT=bf16 -DFDP=16 -DFCFG=$c)
  FLASH_SPLIT=4 run "$b" 1 7 1 77 77 1 1 55 1 bthd
}
split_cases 4
split_cases 5
[ "$mode" = quick ] || split_cases 6
# f32: the default tiling (FLASH_FMA_CFG 1, `b`; fma_big in src/flash.rs)
b=$(bin f32_32b -DFLASH_FMA=1 -DFDPF=32 -DFLASH_FMA_CFG=1)
run "$b" 1 7 1 100 100 1 1 15
run "$b" 1 2 2 37 70 32 0 16
b=$(bin f32_64b -DFLASH_FMA=1 -DFDPF=64 -DFLASH_FMA_CFG=1)
run "$b" 1 7 1 130 130 64 1 17
b=$(bin f32_128b -DFLASH_FMA=1 -DFDPF=128 -DFLASH_FMA_CFG=1)
run "$b" 1 2 2 100 100 100 1 18
run "$b" 1 2 1 70 45 128 0 19
# f32 in the sequence-major layout [B, T, H, D]
b=$(bin f32_32b -DFLASH_FMA=1 -DFDPF=32 -DFLASH_FMA_CFG=1)
run "$b" 1 7 1 100 100 1 1 36 1 bthd
b=$(bin f32_64b -DFLASH_FMA=1 -DFDPF=64 -DFLASH_FMA_CFG=1)
run "$b" 2 7 1 77 77 64 1 37 1 bthd
run "$b" 1 7 7 45 19 64 0 38 -1 bthd
b=$(bin f32_128b -DFLASH_FMA=1 -DFDPF=128 -DFLASH_FMA_CFG=1)
run "$b" 1 7 1 100 100 100 1 39 1 bthd
run "$b" 1 7 1 70 45 128 0 40 1 bthd
if [ "$mode" != quick ]; then
  b=$(bin f32_160b -DFLASH_FMA=1 -DFDPF=160 -DFLASH_FMA_CFG=1)
  run "$b" 1 2 1 70 70 130 1 20
  b=$(bin f32_256b -DFLASH_FMA=1 -DFDPF=256 -DFLASH_FMA_CFG=1)
  run "$b" 1 2 2 65 65 256 1 21
  run "$b" 1 2 1 70 70 250 1 24
  run "$b" 1 7 1 65 65 250 1 42 1 bthd
  # the first FMA tiling (RUMBLE_FLASH_FMA_CFG=a)
  b=$(bin f32_128a -DFLASH_FMA=1 -DFDPF=128 -DFLASH_FMA_CFG=0)
  run "$b" 1 2 2 150 150 100 1 22
  run "$b" 1 7 1 70 45 128 0 23
  run "$b" 1 7 1 100 100 100 1 41 1 bthd
  b=$(bin f32_256a -DFLASH_FMA=1 -DFDPF=256 -DFLASH_FMA_CFG=0)
  run "$b" 1 2 1 70 70 250 1 25
fi
[ $fail = 0 ] && echo "flash emulation: all passed" || { echo "flash emulation: FAILURES"; exit 1; }
