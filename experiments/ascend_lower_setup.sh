#!/usr/bin/env bash
# Builds ENV_DIR/python: an aarch64 CPython 3.11 with tilelang-ascend 0.1.4, run on an x86-64
# Debian host under qemu-user-static, for experiments/ascend_lower.py (ASCEND_ENV=ENV_DIR).
# Idempotent: each step is skipped when its output exists.
# Usage: experiments/ascend_lower_setup.sh ENV_DIR   (or ASCEND_ENV=ENV_DIR in the environment)
# Needs root for apt-get, deb.debian.org and pypi.org reachable, and about 1.5 GB of disk.
#
# The wheel's libraries need glibc >= 2.38, and Debian ships CPython 3.11 only in bookworm
# (glibc 2.36), so the sysroot takes CPython 3.11 and its libraries from bookworm and glibc,
# libstdc++ and libgcc from trixie (glibc 2.41; newer glibc runs older binaries). Wheels are
# installed by the host's pip into ENV_DIR/site-packages with aarch64 platform tags.
set -euo pipefail
ENV_DIR="${1:-${ASCEND_ENV:?usage: $0 ENV_DIR (or set ASCEND_ENV)}}"
mkdir -p "$ENV_DIR"
ENV_DIR="$(cd "$ENV_DIR" && pwd)"
SYSROOT="$ENV_DIR/sysroot"
SITE="$ENV_DIR/site-packages"

if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static g++-aarch64-linux-gnu
fi

# apt-get download for one suite, arm64, from a private apt state (the host's apt is untouched).
fetch_debs() {  # suite, destination, packages...
  local suite="$1" dest="$2"; shift 2
  local root="$ENV_DIR/apt-$suite"
  mkdir -p "$root/lists/partial" "$root/archives/partial" "$dest"
  echo "deb [arch=arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" > "$root/sources.list"
  local opts=(-o Dir::Etc::SourceList="$root/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o Dir::State::Lists="$root/lists" -o Dir::Cache::Archives="$root/archives"
              -o Dir::State::Status=/dev/null -o APT::Architecture=arm64 -o APT::Architectures=arm64)
  [ -n "$(ls "$root/lists" | grep -v partial || true)" ] || apt-get "${opts[@]}" update -qq
  (cd "$dest" && apt-get "${opts[@]}" download "$@")
}

if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
  fetch_debs bookworm "$ENV_DIR/debs-bookworm" \
    python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libexpat1 zlib1g libffi8 \
    media-types libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 \
    libcrypt1 libdb5.3 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 \
    libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 libzstd1 \
    libpython3.11-dev python3.11-dev
  fetch_debs trixie "$ENV_DIR/debs-trixie" libc6 libstdc++6 libgcc-s1
  # merged /usr as trixie lays it out: bookworm's /lib files land in /usr/lib
  mkdir -p "$SYSROOT/usr/lib" "$SYSROOT/usr/bin"
  ln -sfn usr/lib "$SYSROOT/lib"; ln -sfn usr/bin "$SYSROOT/bin"
  for deb in "$ENV_DIR"/debs-bookworm/*.deb "$ENV_DIR"/debs-trixie/*.deb; do
    dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$SYSROOT"
  done
fi

if [ ! -d "$SITE/tilelang" ]; then
  rm -rf "$ENV_DIR/wheels"; mkdir -p "$ENV_DIR/wheels"
  tags=(--platform manylinux_2_38_aarch64 --platform manylinux_2_28_aarch64
        --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64
        --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:)
  # the wheel's torch 2.1 is built against NumPy 1.x
  pip download -q "${tags[@]}" -d "$ENV_DIR/wheels" tilelang-ascend==0.1.4 "numpy<2"
  rm -f "$ENV_DIR"/wheels/numpy-2.*
  # torch_npu needs CANN to import; lowering needs neither, so it stays out.
  find "$ENV_DIR/wheels" -name '*.whl' ! -name 'torch_npu-*' -print0 \
    | xargs -0 pip install -q --no-deps "${tags[@]}" --target "$SITE"
fi

# tilelang compiles its Cython launcher with the machine's g++ on first import; under
# emulation there is none, so build it here with the host's cross compiler into the cache
# tilelang checks (the sha256 of the .pyx in md5.txt beside cython_wrapper.so).
CYDIR="$SITE/tilelang/jit/adapter/cython"
CYCACHE="$CYDIR/.cycache/py311"
if [ ! -f "$CYCACHE/cython_wrapper.so" ]; then
  [ -d "$ENV_DIR/host-tools/Cython" ] || pip install -q --target "$ENV_DIR/host-tools" cython
  mkdir -p "$CYCACHE"
  PYTHONPATH="$ENV_DIR/host-tools" python3 -m cython "$CYDIR/cython_wrapper.pyx" --cplus -o "$CYCACHE/cython_wrapper.cpp"
  aarch64-linux-gnu-g++ -shared -pthread -fPIC -fwrapv -O2 -fno-strict-aliasing \
    -I"$SYSROOT/usr/include/python3.11" -I"$SYSROOT/usr/include" \
    "$CYCACHE/cython_wrapper.cpp" -o "$CYCACHE/cython_wrapper.so"
  sha256sum "$CYDIR/cython_wrapper.pyx" | cut -d' ' -f1 > "$CYCACHE/md5.txt"
fi

# pure-Python packages deepinfer's study and test helpers import, for running
# tests/backends/test_ascend950_lower.py in this interpreter (PYTHONPATH=$ENV_DIR/test-deps:.)
if [ ! -d "$ENV_DIR/test-deps/hydra" ]; then
  pip install -q --no-deps --target "$ENV_DIR/test-deps" hydra-core omegaconf antlr4-python3-runtime==4.9.3 einops
fi

cat > "$ENV_DIR/python" <<PY
#!/usr/bin/env bash
# aarch64 CPython 3.11 with tilelang-ascend, run under qemu-user-static.
export PYTHONHOME="$SYSROOT/usr" PYTHONPATH="$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 QEMU_LD_PREFIX="$SYSROOT"
exec qemu-aarch64-static -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" "\$@"
PY
chmod +x "$ENV_DIR/python"
echo "ready: $ENV_DIR/python"
