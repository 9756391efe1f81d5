#!/usr/bin/env bash
# Usage: tools/ci/nocc_path.sh DIR
# Fills DIR with links to every command on the current PATH except the compilers (C, C++, CUDA,
# the preprocessor) and prints DIR: `PATH="$venv/bin:$(tools/ci/nocc_path.sh DIR)"` is then a PATH
# with no compiler on it. The directories that hold gcc/g++/clang (/usr/bin on Debian) also hold
# bash, tar and the rest, so dropping them from PATH would drop everything; a link farm keeps the
# rest. Exits non-zero if cc, gcc, g++, c++, clang, clang++, cpp or nvcc is still found through it.
set -euo pipefail
dir=${1:?usage: nocc_path.sh DIR}
rm -rf "$dir"
mkdir -p "$dir"
is_compiler() {
  case "$1" in
    cc | c++ | cpp | c89* | c99* | gcc* | g++* | *-gcc* | *-g++* | *-cc | *-c++ | *-cpp* | clang* | *-clang* | \
      nvcc* | icc | icpc | icx | icpx | tcc | zig) return 0 ;;
  esac
  return 1
}
IFS=: read -r -a path_dirs <<<"$PATH"
for d in "${path_dirs[@]}"; do
  [ -d "$d" ] || continue
  for f in "$d"/*; do
    name=${f##*/}
    [ -x "$f" ] && [ ! -d "$f" ] || continue
    is_compiler "$name" && continue
    [ -e "$dir/$name" ] || ln -s "$f" "$dir/$name"   # first on PATH wins, as for the shell
  done
done
for c in cc gcc g++ c++ clang clang++ cpp nvcc; do
  if PATH="$dir" command -v "$c" >/dev/null 2>&1; then
    echo "nocc_path.sh: $c is still on the sanitized PATH ($(PATH="$dir" command -v "$c"))" >&2
    exit 1
  fi
done
echo "$dir"
