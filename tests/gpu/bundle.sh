#!/usr/bin/env bash
# Builds the GPU binaries here (Debian 12, the CUDA toolkit and NCCL under /usr/local/cuda) and
# bundles them, with the Debian libraries they need, into build-gpu-bundle/ for a GPU machine
# that has CUDA and NCCL but not Debian's gRPC, protobuf, Abseil or spdlog. libgradsync_c.so
# (the C ABI the Python package loads) goes with them; the package's Python files are the
# tree's own (run.sh points PYTHONPATH at client/python):
#   tests/gpu/bundle.sh   then (device tool, one call of at most 8 minutes) tests/gpu/run.sh,
#   carrying build-gpu-bundle
# The C library, libstdc++, libcudart and libnccl are the GPU machine's own.
set -euo pipefail
export LC_ALL=C  # the source hash, and ldd's output, must not depend on the locale
cd "$(dirname "$(readlink -f "$0")")/../.."
build=build-gpu
out=build-gpu-bundle
# libgradsync_c.so is loaded by torch's Python, which run.sh gives no LD_LIBRARY_PATH: it finds
# the bundle's libraries (and they theirs) by its DT_RPATH, which, unlike RUNPATH, also serves
# the libraries it pulls in.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADSYNC_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DPython3_EXECUTABLE=/usr/bin/python3 \
  -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--disable-new-dtags '-DCMAKE_BUILD_RPATH=$ORIGIN/../lib' >/dev/null
cmake --build "$build" -j"$(nproc)" --target gradsyncd gradsyncctl gradsync_gpu_tests gpu_worker gpu_bench \
  gradsync_c
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
bins=("$build/daemon/gradsyncd" "$build/client/gradsyncctl" "$build/tests/gradsync_gpu_tests"
      "$build/tests/gpu_worker" "$build/bench/gpu_bench" "$build/client/libgradsync_c.so")
cp "${bins[@]}" "$out/bin/"
for b in "${bins[@]}"; do ldd "$b"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libcudart|libnccl|libpthread|libdl|librt)\.so' |
  xargs -r -I{} cp -L {} "$out/lib/"
# The sources it was built from, for run.sh to refuse a bundle older than the tree.
. tests/gpu/source_hash.sh
source_hash >"$out/SOURCE_HASH"
du -sh "$out"
