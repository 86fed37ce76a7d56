#!/usr/bin/env bash
# Installs Open MPI (mpirun, the headers and libraries the `mpi` crate builds against) and
# libclang (its bindings are generated at build time) from Debian's packages, where they are
# missing. Needed only for the runtime's `mpi` feature:
#   cargo test -p maxc-runtime --features mpi --test mpi
# Idempotent.
set -euo pipefail
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
# libclang itself (the C library bindgen loads), not libclang-cpp (the C++ one), which images
# with LLVM preinstalled carry alone.
have_libclang() {
  for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* \
           /usr/lib/*/libclang.so* /usr/lib/*/libclang-[0-9]*.so*; do
    [ -e "$f" ] && return 0
  done
  return 1
}
have_libclang || need+=(libclang-dev)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing ${need[*]} (Debian packages)" >&2
$sudo apt-get update -q >&2 || true
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}" >&2
