# source_hash: a short hash of the C++ sources, protos and CMake files of the tree (run from its
# root). bundle.sh records it with the binaries; run.sh refuses binaries built from other sources.
source_hash() {
  find CMakeLists.txt proto common daemon client tests bench -type f \
    \( -name '*.cc' -o -name '*.h' -o -name '*.c' -o -name '*.proto' -o -name 'CMakeLists.txt' \) \
    -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
