"""Writes C sources that stand in for the CUDA libraries torch's aarch64 wheel links to and does
not carry, for tools/arm_run.sh.

PyPI's aarch64 torch is a CUDA build: libtorch_cuda.so and its neighbours need libcudart,
cuBLAS, cuDNN, NCCL... (NVIDIA's wheels, gigabytes, some of them missing from the registries
this machine reaches). A CPU-only run never calls them, but the dynamic linker must find every
library and every symbol before torch imports. For each library that is needed and found
nowhere, this writes one C file (and a version script where torch binds to the library's
version node) defining each symbol torch's libraries take from it: functions that print their
name and abort, so a CUDA call under qemu is a loud failure, never a silent wrong result
(the registration calls nvcc's code makes as a library loads do nothing, and the count of
devices is 0, cudaErrorNoDevice, as on a machine without a GPU).

    python3 tools/arm_cuda_standins.py TORCH_LIB_DIR SYSROOT OUT_DIR

prints the libraries' names, one a line; OUT_DIR/NAME.c (and NAME.map) is each one's source.
"""

import os
import re
import subprocess
import sys

READELF = "aarch64-linux-gnu-readelf"
# What a machine without a GPU answers, where torch asks whether there is one
# (torch.cuda.is_available(), which torchrun and others call): no device, no error pending.
NO_DEVICE = {
    "cudaGetDeviceCount": "int cudaGetDeviceCount(int* count) { *count = 0; return 100; }",
    "cudaGetLastError": "int cudaGetLastError(void) { return 0; }",
    "cudaPeekAtLastError": "int cudaPeekAtLastError(void) { return 0; }",
    "cudaGetErrorString": 'const char* cudaGetErrorString(int e) { (void)e; return "no CUDA '
                          'device (a stand-in of tools/arm_cuda_standins.py)"; }',
}
# readelf --dyn-syms -W: Num: Value Size Type Bind Vis Ndx Name[@version (n)]
SYMBOL = re.compile(r"^\s*\d+:\s+\S+\s+(\d+)\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s+(\S+)")


def readelf(*args: str) -> str:
    return subprocess.run([READELF, "-W", *args], capture_output=True, text=True,
                          check=True).stdout


def is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def symbols(path: str):
    """(name, version or None, type, bind, size, defined) for each dynamic symbol of ``path``."""
    for line in readelf("--dyn-syms", path).splitlines():
        m = SYMBOL.match(line)
        if not m:
            continue
        size, kind, bind, ndx, name = m.groups()
        name, _, version = name.partition("@")
        yield name, version.lstrip("@").split(" ")[0] or None, kind, bind, int(size), ndx != "UND"


def needed(path: str) -> list[str]:
    return re.findall(r"\(NEEDED\).*\[(.+?)\]", readelf("-d", path))


def version_files(path: str) -> dict[str, str]:
    """{version name: the library torch needs it from}, from ``path``'s version needs."""
    out, current = {}, None
    for line in readelf("-V", path).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            out[m.group(1)] = current
    return out


def main(torch_lib: str, sysroot: str, out_dir: str) -> None:
    torch_libs = [os.path.join(torch_lib, n) for n in sorted(os.listdir(torch_lib))
                  if ".so" in n and is_elf(os.path.join(torch_lib, n))]
    present = set(os.listdir(torch_lib))
    providers = list(torch_libs)
    for folder in ("lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu"):
        for name in os.listdir(os.path.join(sysroot, folder)):
            path = os.path.join(sysroot, folder, name)
            present.add(name)
            if ".so" in name and os.path.isfile(path) and is_elf(path):
                providers.append(path)
    providers.append(os.path.join(sysroot, "usr/bin/python3.11"))  # libtorch_python's Py*

    defined = set()
    for path in providers:
        defined.update(name for name, _, _, _, _, is_defined in symbols(path) if is_defined)

    missing = sorted({lib for path in torch_libs for lib in needed(path)} - present)
    wanted = {lib: {} for lib in missing}  # lib -> {symbol: (type, size)}
    versions = {lib: {} for lib in missing}  # lib -> {version node: [its symbols]}
    for path in torch_libs:
        files = version_files(path)
        # Nothing says which library an unversioned symbol comes from: each stand-in this
        # library needs and binds to without a version gets them all.
        plain = [lib for lib in needed(path) if lib in wanted and lib not in files.values()]
        for name, version, kind, bind, size, is_defined in symbols(path):
            if is_defined or not name or bind == "WEAK" or name in defined:
                continue
            if version:
                lib = files.get(version)
                if lib in wanted:
                    wanted[lib][name] = (kind, size)
                    versions[lib].setdefault(version, set()).add(name)
            else:
                for lib in plain:
                    wanted[lib][name] = (kind, size)

    os.makedirs(out_dir, exist_ok=True)
    for lib in missing:
        lines = ["#include <stdio.h>", "#include <stdlib.h>", "",
                 "static void stand_in(const char* name) {",
                 f'  fprintf(stderr, "{lib} is a stand-in (tools/arm_cuda_standins.py): %s '
                 'was called, and this CPU-only run has no CUDA\\n", name);',
                 "  abort();", "}", ""]
        for name, (kind, size) in sorted(wanted[lib].items()):
            if name in NO_DEVICE:
                lines.append(NO_DEVICE[name])
            elif kind == "OBJECT":
                lines.append(f"char {name}[{max(size, 8)}];")
            elif name.startswith("__cuda"):
                # What nvcc's code calls as a library loads and unloads, to register its
                # kernels: nothing to register here.
                lines.append(f"void* {name}(void) {{ return 0; }}")
            else:
                lines.append(f'void {name}(void) {{ stand_in("{name}"); }}')
        with open(os.path.join(out_dir, lib + ".c"), "w") as f:
            f.write("\n".join(lines) + "\n")
        if versions[lib]:
            # Each version node torch binds to, with its symbols; the rest are unversioned.
            with open(os.path.join(out_dir, lib + ".map"), "w") as f:
                for version, names in sorted(versions[lib].items()):
                    listed = " ".join(f"{name};" for name in sorted(names))
                    f.write(f"{version} {{ global: {listed} }};\n")
        print(lib)


if __name__ == "__main__":
    main(*sys.argv[1:])
