# Install FlashQLA (flash-qla 0.1.3, TileLang 0.1.15) on a GPU machine that cannot reach a package index, from
# wheels brought in two transfers (about 49 MB, then 33 MB: more than one 64 MiB transfer holds), and point
# CUDA_HOME at the machine's CUDA (TileLang compiles FlashQLA's kernels with nvcc at their first call: ~45 s forward,
# ~60 s backward, then cached). Source it (its exports are for the calling shell), from the checkout's root:
#
#   bash benchmarks/install_flashqla.sh download    here, where pip reaches PyPI: the wheels into .whl-flashqla/1, /2
#   . benchmarks/install_flashqla.sh 1              GPU machine, first call (carrying .whl-flashqla/1): TileLang
#   . benchmarks/install_flashqla.sh 2              same machine, still warm (carrying .whl-flashqla/2): the rest,
#                                                   then checks that flash_qla imports
#   . benchmarks/install_flashqla.sh env            a later call on the same machine: the exports only
#
# The packages go to $FLASHQLA_SITE (default /tmp/flashqla-site), which PYTHONPATH gets in front; with no --deps,
# nothing else is touched (TileLang's other needs -- numpy, ml-dtypes, cloudpickle, psutil, tqdm, typing-extensions --
# are on the GPU image). .whl-flashqla/ is git-ignored.

FLASHQLA_WHEELS="${FLASHQLA_WHEELS:-.whl-flashqla}"
FLASHQLA_SITE="${FLASHQLA_SITE:-/tmp/flashqla-site}"

flashqla_cuda_home() {
    # the machine's CUDA: $CUDA_HOME if it has nvcc, else /usr/local/cuda, else the newest /usr/local/cuda-*, else
    # the one nvcc on PATH belongs to
    local d
    for d in "${CUDA_HOME:-}" /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -V -r); do
        if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then echo "$d"; return 0; fi
    done
    if command -v nvcc >/dev/null 2>&1; then dirname "$(dirname "$(command -v nvcc)")"; return 0; fi
    return 1
}

flashqla_env() {
    local cuda
    if ! cuda="$(flashqla_cuda_home)"; then
        echo "install_flashqla: no CUDA with nvcc found (CUDA_HOME, /usr/local/cuda*, PATH)" >&2
        return 1
    fi
    export CUDA_HOME="$cuda"
    export PATH="$CUDA_HOME/bin:$PATH"
    case ":${PYTHONPATH:-}:" in
        *":$FLASHQLA_SITE:"*) ;;
        *) export PYTHONPATH="$FLASHQLA_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    echo "install_flashqla: CUDA_HOME=$CUDA_HOME, PYTHONPATH starts with $FLASHQLA_SITE"
}

flashqla_install() {  # $1: the wheel folder's part, 1 or 2
    local dir="$FLASHQLA_WHEELS/$1"
    if ! ls "$dir"/*.whl >/dev/null 2>&1; then
        echo "install_flashqla: no wheels in $dir (carry it in this call; fetch them with: bash benchmarks/install_flashqla.sh download)" >&2
        return 1
    fi
    ls -l "$dir"/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$FLASHQLA_SITE" \
        "$dir"/*.whl || return 1
    flashqla_env || return 1
    if [ "$1" = 2 ]; then
        python3 -c "import tilelang, flash_qla; print('install_flashqla: flash_qla', getattr(flash_qla, '__version__', \
'?'), 'tilelang', tilelang.__version__, 'import OK')" || return 1
    fi
}

flashqla_download() {
    local platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64"
    platforms="$platforms --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    local common="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms"
    mkdir -p "$FLASHQLA_WHEELS/1" "$FLASHQLA_WHEELS/2"
    # shellcheck disable=SC2086
    python3 -m pip download $common -d "$FLASHQLA_WHEELS/1" tilelang==0.1.15 || return 1
    # shellcheck disable=SC2086
    python3 -m pip download $common -d "$FLASHQLA_WHEELS/2" flash-qla==0.1.3 apache-tvm-ffi==0.1.12 \
        z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 || return 1
    du -sh "$FLASHQLA_WHEELS/1" "$FLASHQLA_WHEELS/2"
}

case "${1:-env}" in
    1 | 2) flashqla_install "$1" ;;
    env) flashqla_env ;;
    download) flashqla_download ;;
    *) echo "usage: . benchmarks/install_flashqla.sh 1|2|env, or: bash benchmarks/install_flashqla.sh download" >&2
       false ;;
esac
