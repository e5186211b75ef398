# source_hash: a short hash of the C++/CUDA sources, protos and CMake files of the tree (run from
# its root). bundle.sh records it with the binaries; run.sh refuses binaries built from other
# sources. LC_ALL=C: the file order, hence the hash, must not depend on the machine's locale.
source_hash() {
  LC_ALL=C find CMakeLists.txt proto common daemon client tests bench -type f \
    \( -name '*.cc' -o -name '*.h' -o -name '*.c' -o -name '*.cu' -o -name '*.proto' \
       -o -name 'CMakeLists.txt' \) -print0 | LC_ALL=C sort -z | LC_ALL=C xargs -0 sha256sum |
    LC_ALL=C sha256sum | cut -c1-16
}
