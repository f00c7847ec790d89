#!/usr/bin/env bash
# Arm (aarch64) checks on an x86-64 machine, without an Arm one:
#  1. every C++ source of ddpx._C's CPU build compiles to an aarch64 object, against the headers of
#     torch 2.11's aarch64 wheel; 2.11 is older than the torch built against on x86, so the
#     pre-2.13 branches of csrc/common/torch_compat.h compile too. Nothing is linked against torch.
#  2. tests/kernels_check.cpp, linked with the element kernels for aarch64, passes under
#     qemu-aarch64: the portable kernels bit for bit against its scalar reference.
#  3. the same program passes natively, which checks the AVX2 kernels too where the CPU has them.
#
#     bash tools/arm_check.sh
#
# Needs Debian's g++-aarch64-linux-gnu and qemu-user, and pip able to fetch torch's aarch64 wheel
# (420 MB; only its headers are unpacked). Everything goes in a temporary folder, removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

ARM_TORCH=2.11.0
CXX_ARM=aarch64-linux-gnu-g++
missing=()
command -v "$CXX_ARM" >/dev/null || missing+=("$CXX_ARM (apt-get install g++-aarch64-linux-gnu)")
command -v qemu-aarch64 >/dev/null || missing+=("qemu-aarch64 (apt-get install qemu-user)")
command -v g++ >/dev/null || missing+=("g++ (apt-get install g++)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'arm_check: missing %s\n' "${missing[@]}" >&2
  exit 1
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ddpx-arm.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM  # so that the EXIT trap runs then too
seconds() { echo $((SECONDS - $1)) s; }

# The sources and flags of the real build (ddpx/_buildspec.py), with the standard and defines
# torch 2.11's cpp_extension adds.
spec=$(python3 ddpx/_buildspec.py "$ARM_TORCH")
read -r -a sources <<<"$(sed -n 1p <<<"$spec")"
read -r -a flags <<<"$(sed -n 2p <<<"$spec")"
flags+=(-std=c++17 -fPIC -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)

# 1. The objects.
start=$SECONDS
echo "arm_check: downloading torch $ARM_TORCH's aarch64 wheel for its headers"
if ! python3 -m pip download -q --no-deps --platform manylinux_2_28_aarch64 \
  --only-binary=:all: --python-version 3.11 "torch==$ARM_TORCH" -d "$tmp/wheel" \
  >"$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  echo "arm_check: pip could not fetch torch==$ARM_TORCH for manylinux_2_28_aarch64; it needs" \
    "the network or a package index that has it" >&2
  exit 1
fi
python3 -c 'import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("torch/include/")])' \
  "$tmp"/wheel/torch-*.whl "$tmp"
rm -r "$tmp/wheel"
torch_inc=$tmp/torch/include

# torch/extension.h includes Python.h. The running Python's headers serve: CPython's x86-64 and
# aarch64 Linux builds differ in pyconfig.h only in what CPython's own sources use (x87/x64
# assembly, wchar_t's signedness, the support tier). Debian's own Python chooses its pyconfig.h by
# architecture, so the aarch64 compiler is pointed at the host's.
py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
multiarch=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH") or "")')
host_pyconfig=$(dirname "$py_inc")/$multiarch/$(basename "$py_inc")/pyconfig.h
mkdir "$tmp/py"
if [ -n "$multiarch" ] && [ -f "$host_pyconfig" ]; then
  mkdir -p "$tmp/py/aarch64-linux-gnu/$(basename "$py_inc")"
  ln -s "$host_pyconfig" "$tmp/py/aarch64-linux-gnu/$(basename "$py_inc")/pyconfig.h"
fi
echo "arm_check: unpacked torch's headers ($(seconds "$start")); compiling ${#sources[@]} sources" \
  "for aarch64 with $CXX_ARM ${flags[*]}"

start=$SECONDS
mkdir "$tmp/obj"
# One source of csrc/ to an aarch64 object; its messages go to a log, shown if it fails.
compile_arm() {
  # shellcheck disable=SC2086  # FLAGS: the flags above, as words
  "$CXX_ARM" $FLAGS -I"$torch_inc" -I"$torch_inc/torch/csrc/api/include" -I"$py_inc" \
    -I"$tmp/py" -c "csrc/$1" -o "$tmp/obj/${1//\//_}.o" >"$tmp/obj/${1//\//_}.log" 2>&1 ||
    { cat "$tmp/obj/${1//\//_}.log"; return 1; }
}
export -f compile_arm
export CXX_ARM tmp torch_inc py_inc FLAGS="${flags[*]}"
# shellcheck disable=SC2016  # $1 is compile_arm's argument, expanded by the inner bash
if ! printf '%s\n' "${sources[@]}" | xargs -P "$(nproc)" -I{} bash -c 'compile_arm "$1"' _ {}; then
  echo "arm_check: FAILED: a source of ddpx._C does not compile for aarch64 (above)" >&2
  exit 1
fi
ours=$(cat "$tmp"/obj/*.log | grep -c '^csrc/.*warning:' || true)
all=$(cat "$tmp"/obj/*.log | grep -c 'warning:' || true)
grep -h '^csrc/.*warning:' "$tmp"/obj/*.log || true
echo "arm_check: ${#sources[@]} aarch64 objects in $(seconds "$start");" \
  "$all warnings, $ours of them in csrc/"

# kernels_avx2.cpp's x86 guard leaves only the function that says there are no AVX2 kernels.
symbols=$(aarch64-linux-gnu-nm --defined-only -C "$tmp/obj/kernels_kernels_avx2.cpp.o")
defined=$(grep -c ' T ' <<<"$symbols" || true)
if [ "$defined" != 1 ]; then
  echo "arm_check: FAILED: kernels_avx2.cpp defines $defined functions for aarch64, not 1" >&2
  exit 1
fi
rm -r "$tmp/torch"

# 2. and 3. The kernels' test program, for aarch64 under qemu and for this machine.
kernel_sources=(tests/kernels_check.cpp csrc/kernels/kernels.cpp csrc/kernels/kernels_avx2.cpp
                csrc/kernels/quantize.cpp)
start=$SECONDS
"$CXX_ARM" -std=c++17 -O3 -Wall -ffp-contract=off -static -Icsrc/kernels "${kernel_sources[@]}" \
  -o "$tmp/kernels_check_arm"
echo "arm_check: built kernels_check for aarch64 ($(seconds "$start")); under qemu-aarch64:"
start=$SECONDS
qemu-aarch64 "$tmp/kernels_check_arm" || { echo "arm_check: FAILED on aarch64" >&2; exit 1; }
echo "arm_check: ran it under qemu-aarch64 in $(seconds "$start")"

start=$SECONDS
g++ -std=c++17 -O3 -Wall -ffp-contract=off -Icsrc/kernels "${kernel_sources[@]}" -o "$tmp/kernels_check"
"$tmp/kernels_check" || { echo "arm_check: FAILED on $(uname -m)" >&2; exit 1; }
echo "arm_check: built and ran it on $(uname -m) in $(seconds "$start")"
echo "arm_check: passed"
