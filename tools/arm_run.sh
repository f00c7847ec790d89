#!/usr/bin/env bash
# ddpx on Arm (aarch64) for real, on an x86-64 machine, under qemu-user: torch 2.13's aarch64
# wheel and Debian's arm64 Python 3.11, the whole extension ddpx._C cross-compiled and linked
# against that torch, and tests of the suite run by that Python:
#  1. downloads the wheel and what torch imports (pip, for manylinux aarch64), and Debian's arm64
#     Python and the libraries it and torch need (apt-get download with a private apt state;
#     the machine's dpkg is not touched), unpacked into a sysroot;
#  2. builds stand-ins for the CUDA libraries the wheel links to (PyPI's aarch64 torch is a
#     CUDA build; tools/arm_cuda_standins.py says why and what they do);
#  3. compiles every C++ source of ddpx._C for aarch64 with ddpx/_buildspec.py's flags and the
#     ones torch.utils.cpp_extension adds, links _C.cpython-311-aarch64-linux-gnu.so against the
#     wheel's libraries, and lays out the package with it;
#  4. under qemu-aarch64 (a Neoverse N1): imports ddpx and prints what its engine says of
#     itself, then runs pytest on ARM_TESTS (below): the fused hook against DDP's default
#     all-reduce, the backend's collectives against gloo and exact references, dead peers, and
#     arena tensors between ranks that cannot reach each other's memory (qemu's case).
#
#     bash tools/arm_run.sh [--keep DIR] [PYTEST ARGS...]
#
# PYTEST ARGS replace ARM_TESTS. Everything goes in a temporary folder, removed at exit; with
# --keep DIR it goes in DIR and stays, and a later run with the same DIR reuses the downloads,
# the sysroot and the objects of unchanged sources. Needs Debian's g++-aarch64-linux-gnu and
# qemu-user, apt-get, and pip able to reach PyPI (430 MB of wheels) and apt Debian's arm64
# packages (16 MB). binfmt_misc need not know aarch64: the interpreter is started through a
# wrapper, which is also what its sys.executable and multiprocessing's spawn name.
set -euo pipefail
cd "$(dirname "$0")/.."

ARM_TORCH=2.13.0
CPU=neoverse-n1
DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev libc6
  libstdc++6 libgcc-s1 libgomp1 zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1
  libsqlite3-0 libncursesw6 libtinfo6 libreadline8)
PY_DEPS=(numpy typing_extensions sympy filelock networkx jinja2 fsspec pytest)
ARM_TESTS=(
  "tests/test_hook.py::test_hook_matches_default_allreduce_on_2_ranks"
  "tests/test_backend.py::test_every_collective_matches_gloo_and_the_references"
  "tests/test_faults.py::test_a_rank_killed_mid_training_fails_the_job_everywhere"
  "tests/test_faults.py::test_a_rank_killed_while_its_peer_waits_in_recv_fails_the_recv"
  "tests/test_arena.py::test_ranks_that_cannot_reach_each_others_memory_reduce_arena_tensors_right"
  -k "not 4-"  # 2 ranks: the battery's and the killed rank's 4-rank variants are left out
)

keep=
if [ "${1:-}" = --keep ]; then
  [ $# -ge 2 ] || { echo "arm_run: --keep needs a folder" >&2; exit 2; }
  keep=$2
  shift 2
fi
[ $# -gt 0 ] && ARM_TESTS=("$@")

missing=()
for tool in aarch64-linux-gnu-g++ aarch64-linux-gnu-gcc aarch64-linux-gnu-readelf; do
  command -v "$tool" >/dev/null || missing+=("$tool (apt-get install g++-aarch64-linux-gnu)")
done
command -v qemu-aarch64 >/dev/null || missing+=("qemu-aarch64 (apt-get install qemu-user)")
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || missing+=("$tool (a Debian or Ubuntu host)")
done
python3 -m pip --version >/dev/null 2>&1 || missing+=("pip for python3")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'arm_run: missing %s\n' "${missing[@]}" >&2
  exit 1
fi

if [ -n "$keep" ]; then
  mkdir -p "$keep"
  work=$(cd "$keep" && pwd)
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/ddpx-arm-run.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
trap 'exit 1' INT TERM  # so that the EXIT trap runs then too
seconds() { echo $((SECONDS - $1)) s; }
fail() { echo "arm_run: FAILED: $*" >&2; exit 1; }
echo "arm_run: working in $work"

# 1. Downloads, each once per work folder.
start=$SECONDS
pip_arm=(python3 -m pip -q --disable-pip-version-check)
arm_wheels=(--platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
  --platform manylinux2014_aarch64 --only-binary=:all: --python-version 3.11 --implementation cp)
if [ ! -f "$work/site/.done" ]; then
  rm -rf "$work/site" "$work/wheel"
  "${pip_arm[@]}" download --no-deps "${arm_wheels[@]}" "torch==$ARM_TORCH" -d "$work/wheel" \
    >"$work/pip.log" 2>&1 ||
    { cat "$work/pip.log" >&2; fail "pip could not fetch torch==$ARM_TORCH for aarch64"; }
  "${pip_arm[@]}" install --target "$work/site" "${arm_wheels[@]}" "${PY_DEPS[@]}" \
    >"$work/pip.log" 2>&1 ||
    { cat "$work/pip.log" >&2; fail "pip could not fetch ${PY_DEPS[*]} for aarch64"; }
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$work"/wheel/torch-*.whl "$work/site"
  rm -r "$work/wheel"
  touch "$work/site/.done"
fi
sysroot=$work/sysroot
if [ ! -f "$sysroot/.done" ]; then
  rm -rf "$sysroot" "$work/apt"
  mkdir -p "$work/apt/state/lists/partial" "$work/apt/cache/archives/partial" "$work/apt/debs"
  touch "$work/apt/state/status"
  cat >"$work/apt/apt.conf" <<EOF
Dir::State "$work/apt/state";
Dir::State::status "$work/apt/state/status";
Dir::Cache "$work/apt/cache";
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
APT::Sandbox::User "root";
EOF
  (export APT_CONFIG=$work/apt/apt.conf
    apt-get -q update >"$work/apt.log" 2>&1 &&
      cd "$work/apt/debs" && apt-get -q download "${DEBS[@]}" >>"$work/apt.log" 2>&1) ||
    { cat "$work/apt.log" >&2; fail "apt-get could not fetch Debian's arm64 ${DEBS[*]}"; }
  for deb in "$work"/apt/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
  rm -r "$work/apt"
  # qemu-user (7.2) shows an aarch64 program the host's /proc/cpuinfo and CPU sysfs, which
  # describe x86 cores; torch's CPU detection (cpuinfo, oneDNN's xbyak) then dereferences NULL.
  # qemu looks every absolute path up in the sysroot first: these describe the emulated CPU.
  ncpu=$(nproc)
  mkdir -p "$sysroot/proc"
  for ((n = 0; n < ncpu; n++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' \
      "$n" "crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
    ident=$sysroot/sys/devices/system/cpu/cpu$n/regs/identification
    mkdir -p "$ident"
    echo 0x00000000414fd0c1 >"$ident/midr_el1"  # Neoverse N1 r4p1, what qemu's model says
    echo 0x0000000000000000 >"$ident/revidr_el1"
  done >"$sysroot/proc/cpuinfo"
  touch "$sysroot/.done"
fi
torch_dir=$work/site/torch
echo "arm_run: torch $ARM_TORCH's aarch64 wheel and Debian's arm64 Python ready ($(seconds "$start"))"

# 2. Stand-ins for the CUDA libraries.
start=$SECONDS
standins=$work/cuda-standins
if [ ! -f "$standins/.done" ]; then
  rm -rf "$standins"
  libs=$(python3 tools/arm_cuda_standins.py "$torch_dir/lib" "$sysroot" "$standins/src")
  for lib in $libs; do
    map=()
    [ -f "$standins/src/$lib.map" ] && map=(-Wl,--version-script="$standins/src/$lib.map")
    aarch64-linux-gnu-gcc -shared -fPIC -O1 -Wl,-soname,"$lib" "${map[@]}" \
      "$standins/src/$lib.c" -o "$standins/$lib"
  done
  touch "$standins/.done"
fi
echo "arm_run: $(find "$standins" -maxdepth 1 -name 'lib*' | wc -l) CUDA stand-ins ($(seconds "$start"))"

# 3. ddpx._C for aarch64, as torch.utils.cpp_extension would build it for this torch.
start=$SECONDS
version=$(sed -n "s/^__version__ = '\(.*\)'$/\1/p" "$torch_dir/version.py")  # 2.13.0+cu130
spec=$(python3 ddpx/_buildspec.py "$version")
read -r -a sources <<<"$(sed -n 1p <<<"$spec")"
read -r -a flags <<<"$(sed -n 2p <<<"$spec")"
py_inc=$sysroot/usr/include/python3.11
flags+=(-std=c++20 -fPIC -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
  -D_GLIBCXX_USE_CXX11_ABI=1 -isystem "$torch_dir/include"
  -isystem "$torch_dir/include/torch/csrc/api/include" -isystem "$py_inc"
  -isystem "$sysroot/usr/include")
# Objects kept (--keep) are reused while the flags are the same and no file of csrc/ is newer.
if [ "$(cat "$work/obj/flags" 2>/dev/null)" != "${flags[*]}" ]; then
  rm -rf "$work/obj"
  mkdir -p "$work/obj"
  echo "${flags[*]}" >"$work/obj/flags"
fi
compile_arm() {
  local obj=$work/obj/${1//\//_}.o
  if [ -f "$obj" ] && [ -z "$(find csrc -newer "$obj" -print -quit)" ]; then
    return 0
  fi
  # shellcheck disable=SC2086  # FLAGS: the flags above, as words
  aarch64-linux-gnu-g++ $FLAGS -c "csrc/$1" -o "$obj" >"$obj.log" 2>&1 || { cat "$obj.log"; return 1; }
}
export -f compile_arm
export work FLAGS="${flags[*]}"
# Two at a time: the machine is shared (2 to 7 minutes for the 26 sources on 2 cores, by load).
# shellcheck disable=SC2016  # $1 is compile_arm's argument, expanded by the inner bash
printf '%s\n' "${sources[@]}" | xargs -P 2 -I{} bash -c 'compile_arm "$1"' _ {} ||
  fail "a source of ddpx._C does not compile for aarch64 (above)"
objects=()
for source in "${sources[@]}"; do objects+=("$work/obj/${source//\//_}.o"); done
pkg=$work/pkg
rm -rf "$pkg"
mkdir -p "$pkg/ddpx"
cp ddpx/*.py "$pkg/ddpx/"
so=$pkg/ddpx/_C.cpython-311-aarch64-linux-gnu.so
aarch64-linux-gnu-g++ -shared "${objects[@]}" -L"$torch_dir/lib" -lc10 -ltorch -ltorch_cpu \
  -ltorch_python -Wl,-rpath-link,"$standins" -o "$so" || fail "linking ddpx._C for aarch64"
echo "arm_run: built $(basename "$so") from ${#sources[@]} sources ($(seconds "$start"))"

# 4. Under qemu. The wrapper is the aarch64 Python for everything that starts one.
cat >"$work/python3.11" <<EOF
#!/usr/bin/env bash
exec qemu-aarch64 -cpu $CPU -L "$sysroot" -E LD_LIBRARY_PATH="$standins" \\
  "$sysroot/usr/bin/python3.11" "\$@"
EOF
printf '#!/usr/bin/env bash\nexec "%s" -m torch.distributed.run "$@"\n' "$work/python3.11" \
  >"$work/torchrun"
chmod +x "$work/python3.11" "$work/torchrun"
mkdir -p "$work/boot"
cat >"$work/boot/sitecustomize.py" <<EOF
# Made by tools/arm_run.sh: the aarch64 interpreter runs through qemu-aarch64, so whatever
# starts a Python (subprocess with sys.executable, multiprocessing's spawn, torchrun) must
# start the wrapper, not the aarch64 binary this machine cannot exec.
import multiprocessing
import sys

sys.executable = sys._base_executable = "$work/python3.11"
multiprocessing.set_executable(sys.executable)
EOF
export PYTHONPATH=$work/boot:$pkg:$work/site
export OMP_NUM_THREADS=1
cat >"$work/describe.py" <<'EOF'
# What ddpx says of itself on 2 aarch64 ranks under qemu (run by tools/arm_run.sh).
import platform
import sys

import torch
import torch.distributed as dist

import ddpx
from ddpx._ext import extension

dist.init_process_group("ddpx")
rank = dist.get_rank()
total = torch.full((1000,), float(rank + 1))
dist.all_reduce(total)
assert torch.equal(total, torch.full((1000,), 3.0)), total
# A tensor in the arena (shared memory the engine owns, which peers that reach this rank's
# memory map through pidfd_getfd): zero-copy where they do, the copy path where not (the
# backend's describe() below says which).
arena = extension().arena_empty(1 << 16, torch.float32).fill_(rank + 1)
dist.all_reduce(arena)
assert torch.equal(arena, torch.full_like(arena, 3.0)), arena
if rank == 0:
    print("arm_run: machine", platform.machine(), "python", sys.version.split()[0], "torch",
          torch.__version__)
    print("arm_run: build_info", ddpx.build_info())
    print("arm_run: backend:", ddpx.backend_of().describe())
    print("arm_run: arena:", extension().arena_usage())
dist.destroy_process_group()
EOF
start=$SECONDS
(cd "$work" && ./torchrun --standalone --nproc_per_node 2 describe.py) ||
  fail "ddpx on 2 ranks under qemu-aarch64"
echo "arm_run: ddpx imported and ran on 2 ranks under qemu-aarch64 ($(seconds "$start"))"

# The tests run from a copy of tests/ and pyproject.toml (whose pytest settings they need), so
# that the checkout's ddpx (built for this machine) is not the one imported.
rm -rf "$work/run"
mkdir -p "$work/run"
cp -r tests pyproject.toml "$work/run/"
start=$SECONDS
status=0
(cd "$work/run" && DDPX_TEST_TIME_SCALE=${DDPX_TEST_TIME_SCALE:-8} PYTHONUNBUFFERED=1 \
  ../python3.11 -m pytest -p no:cacheprovider -v -rA --durations=0 "${ARM_TESTS[@]}") ||
  status=$?
echo "arm_run: pytest under qemu-aarch64 took $(seconds "$start") and exited with $status"
leftover=$(ls /dev/shm | grep '^ddpx-' || true)
[ -z "$leftover" ] || echo "arm_run: note: /dev/shm holds $leftover (maybe another job's)"
[ "$status" = 0 ] || fail "tests under qemu-aarch64"
echo "arm_run: passed"
