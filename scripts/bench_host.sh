#!/usr/bin/env bash
# The many-core host measurement of issue 34 in one command (under 8 minutes on 16 cores):
# scripts/bench_training.py, one row per entry point (allreduce, kvstore, module, gossip, gossip
# overlap) beside MXNet's dist_sync and the no-communication ceiling, CPU ms per step by thread,
# on mobilenet0.25 and resnet18_v1 in two layouts:
#   2 workers x (cores / 2) threads, 1 server (2w1s, --threads auto): every core computes;
#   8 workers x 1 thread, 2 servers (8w2s): cores to spare; resnet18_v1 also with
#   BPS_GOSSIP_HOST_REDUCE=off (the servers sum, not the host's lowest rank).
# It prints each table as it goes, then one Markdown table of all; OUTDIR gets bench_host.log,
# summary.md, one JSON per run, and logs.tar.gz (the processes' logs) when a run failed.
#
# On a host with no network (the device machine: carry .whl, timeout_s 600), as the lead runs it:
#   bash scripts/bench_host.sh $OUT
# It makes a virtual environment of its own in /tmp from the wheels in .whl/ (Python 3.12:
# MXNet 1.9.1, numpy 1.26.4, pyzmq, msgpack, requests and its needs, setuptools for MXNet's
# distutils import) and this checkout. Nothing of the interpreter's own site-packages is seen:
# an image's scipy built for numpy 2 would be imported by MXNet (ndarray/sparse.py tries
# scipy) and fail against numpy 1.26.
#
# Once, where PyPI answers, fill .whl/ (about 3 minutes: MXNet's and numpy's big members are
# recompressed with LZMA, 49 + 18 MB -> 29 + 11 MB, so that the checkout and the wheels travel
# in 64 MiB): bash scripts/bench_host.sh --prepare
# A short end-to-end check on a small machine (one run, 2 workers, few steps):
#   BENCH_QUICK=1 bash scripts/bench_host.sh /tmp/bench_host_check
#
# Environment: PYTHON (default python3: its pip installs the wheels, its base interpreter makes
# the environment), BENCH_WHEELS (default .whl), BENCH_STEPS (8), BENCH_PASSES (5),
# BENCH_WARMUP (3), BENCH_BUDGET (seconds for all runs, default 420: a run that would end
# later is cut short and says so), BENCH_QUICK=1, BENCH_VENV (default /tmp/bps_bench_venv).
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${BENCH_WHEELS:-$ROOT/.whl}
VENV=${BENCH_VENV:-/tmp/bps_bench_venv}
MIB64=$((64 * 1024 * 1024))
# The wheels --prepare fetches (Python 3.12, x86-64), one version each.
PINS="mxnet==1.9.1 numpy==1.26.4 pyzmq==27.3.0 msgpack==1.2.4 setuptools==75.8.0 requests==2.34.2
urllib3==2.8.0 idna==3.20 charset-normalizer==3.5.3 certifi==2026.10.19.post1"

die() { echo "bench_host.sh: $*" >&2; exit 1; }

repack_lzma() {  # the wheel's members over 1 MiB recompressed with LZMA (contents, RECORD unchanged)
    "$PYTHON" - "$1" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src:
    if any(info.compress_type == zipfile.ZIP_LZMA for info in src.infolist()):
        sys.exit(print(f"{os.path.basename(path)}: repacked already"))
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w") as dst:
    for info in src.infolist():
        method = zipfile.ZIP_LZMA if info.file_size > (1 << 20) else zipfile.ZIP_DEFLATED
        member = zipfile.ZipInfo(info.filename, info.date_time)
        member.external_attr = info.external_attr
        dst.writestr(member, src.read(info), compress_type=method)
before = os.path.getsize(path)
os.replace(path + ".tmp", path)
print(f"{os.path.basename(path)}: {before / 2**20:.1f} MiB -> {os.path.getsize(path) / 2**20:.1f} MiB")
EOF
}

travel_bytes() {  # what a device call sends: tracked and untracked-not-ignored files, and the wheels
    (cd "$ROOT" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
}

prepare() {
    mkdir -p "$WHEELS" || die "cannot make $WHEELS"
    grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo /.whl/ >>"$ROOT/.git/info/exclude"
    local pin missing=""
    for pin in $PINS; do  # pip would fetch a repacked wheel again (its hash differs from PyPI's)
        compgen -G "$WHEELS/${pin%%==*}-${pin##*==}-*.whl" >/dev/null \
            || compgen -G "$WHEELS/$(echo "${pin%%==*}" | tr - _)-${pin##*==}-*.whl" >/dev/null \
            || missing="$missing $pin"
    done
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086 - a list of words
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            --platform manylinux_2_5_x86_64 -d "$WHEELS" $missing || die "pip download failed"
    fi
    for wheel in "$WHEELS"/mxnet-*.whl "$WHEELS"/numpy-*.whl; do
        repack_lzma "$wheel" || die "repacking $wheel failed"
    done
    local tree wheels
    tree=$(travel_bytes)
    wheels=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
    echo "travels: checkout $((tree / 1024)) KiB + wheels $((wheels / 1024)) KiB (limit $((MIB64 / 1024)) KiB)"
    [ $((tree + wheels)) -lt $MIB64 ] || die "over 64 MiB: the device call would be refused"
}

make_venv() {  # VPY: an interpreter that sees the wheels and this checkout, nothing else
    [ -n "$(ls "$WHEELS"/*.whl 2>/dev/null)" ] || die "no wheels in $WHEELS: run 'bash scripts/bench_host.sh --prepare' where PyPI answers"
    rm -rf "$VENV"
    local site
    if [ "${BENCH_NO_VENV:-0}" != 1 ] && "$PYTHON" -m venv --without-pip "$VENV"; then
        VPY=$VENV/bin/python
        site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || die "$VPY does not run"
    else  # no venv module: PYTHON itself, the wheels first on its path, its own scipy hidden
        echo "no virtual environment: $PYTHON with PYTHONPATH=$VENV/site"
        VPY=$(command -v "$PYTHON")
        site=$VENV/site
        mkdir -p "$site/scipy"
        echo 'raise ImportError("hidden by scripts/bench_host.sh: built for another numpy")' >"$site/scipy/__init__.py"
        printf 'import site\nsite.addsitedir(%s)\n' "'$site'" >"$site/sitecustomize.py"  # runs its .pth files
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$WHEELS"/*.whl || die "installing the wheels failed"
    [ "$VPY" = "$VENV/bin/python" ] || export PYTHONPATH=$site  # every process the runs start inherits it
    # What 'pip install -e .' would add: the checkout on the path, and the start-up hook that
    # lets MXNet 1.9.1 import under numpy >= 1.24 (setup.py).
    echo "$ROOT" >"$site/bps_gossip_checkout.pth"
    cp "$ROOT"/startup/bps_gossip_numpy_aliases.py "$ROOT"/startup/bps_gossip_numpy_aliases.pth "$site/"
    "$VPY" -c 'import mxnet, numpy, zmq, msgpack, bps_gossip, mxnet_plugin, sys
print(f"python {sys.version.split()[0]}, mxnet {mxnet.__version__}, numpy {numpy.__version__}, "
      f"pyzmq {zmq.__version__}, msgpack {msgpack.version}, bps_gossip {bps_gossip.__file__}")' \
        || die "the environment does not import mxnet, numpy, zmq, msgpack, bps_gossip and mxnet_plugin"
}

run() {  # run NAME ARGS...: one bench_training.py run, cut at the budget's end
    local name=$1 left
    shift
    left=$((BUDGET - SECONDS + START))
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, the budget of ${BUDGET} s is spent"
        return
    fi
    echo "== $name ($(date -u +%H:%M:%S), ${left} s of the budget left)"
    timeout -s TERM -k 30 "$left" "$VPY" "$ROOT/scripts/bench_training.py" --systems main --steps "$STEPS" \
        --passes "$PASSES" --warmup "$WARMUP" --json "$OUTDIR/$name.json" --logdir "$LOGS/$name" "$@"
    local rc=$?
    [ $rc -eq 0 ] || { FAILED="$FAILED $name(rc=$rc)"; [ $rc -eq 124 ] && echo "== $name: cut at the budget's end"; }
}

main() {
    OUTDIR=${1:-}
    [ -n "$OUTDIR" ] || die "usage: bash scripts/bench_host.sh OUTDIR | --prepare"
    mkdir -p "$OUTDIR" || die "cannot make $OUTDIR"
    exec > >(tee -a "$OUTDIR/bench_host.log") 2>&1
    export PYTHONUNBUFFERED=1
    START=$SECONDS
    echo "bench_host.sh $(date -u '+%Y-%m-%d %H:%M UTC'): $(nproc) usable cores of $(getconf _NPROCESSORS_ONLN)," \
        "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/ {print $2}') GiB," \
        "kernel $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
    make_venv
    echo "environment ready in $((SECONDS - START)) s"
    LOGS=$(mktemp -d /tmp/bench_host_logs.XXXXXX)
    FAILED=""
    STEPS=${BENCH_STEPS:-8} PASSES=${BENCH_PASSES:-5} WARMUP=${BENCH_WARMUP:-3} BUDGET=${BENCH_BUDGET:-420}
    START=$SECONDS
    if [ "${BENCH_QUICK:-0}" = 1 ]; then
        STEPS=${BENCH_STEPS:-3} PASSES=${BENCH_PASSES:-1} WARMUP=${BENCH_WARMUP:-1}
        run mobilenet_2w1s_auto --model mobilenet0.25 --configs 2w1s --threads auto
    else
        run mobilenet_2w1s_auto --model mobilenet0.25 --configs 2w1s --threads auto
        # placement: one thread fewer a worker, with and without its communication on a core of its own
        run mobilenet_2w1s_placed --model mobilenet0.25 --configs 2w1s --threads "$(( $(nproc) / 2 - 1 ))" \
            --systems "main,2 comm cores"
        run resnet18_2w1s_auto --model resnet18_v1 --configs 2w1s --threads auto
        run mobilenet_8w2s_1 --model mobilenet0.25 --configs 8w2s --threads 1
        run resnet18_8w2s_1 --model resnet18_v1 --configs 8w2s --threads 1
        # the same with the servers summing (on one host the lowest rank sums by default): last, so
        # that the budget cuts it first
        BPS_GOSSIP_HOST_REDUCE=off run resnet18_8w2s_servers --model resnet18_v1 --configs 8w2s --threads 1
    fi
    local done_json
    done_json=$(ls "$OUTDIR"/*.json 2>/dev/null)
    if [ -n "$done_json" ]; then
        # shellcheck disable=SC2086 - one file name per word
        "$VPY" "$ROOT/scripts/bench_training.py" --summarize $done_json >"$OUTDIR/summary.md"
        echo; echo "== all runs (steps $STEPS, passes $PASSES; also in $OUTDIR/summary.md)"; cat "$OUTDIR/summary.md"
    fi
    if [ -n "$FAILED" ]; then
        tar -czf "$OUTDIR/logs.tar.gz" -C "$LOGS" . 2>/dev/null
        echo "FAILED:$FAILED (the processes' logs: $OUTDIR/logs.tar.gz)"
    fi
    rm -rf "$LOGS"
    echo "bench_host.sh: runs took $((SECONDS - START)) s"
    [ -z "$FAILED" ]
}

if [ "${1:-}" = "--prepare" ]; then
    prepare
else
    main "$@"
fi
