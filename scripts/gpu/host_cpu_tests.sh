#!/usr/bin/env bash
# The CPU-facing tests on a GPU machine's host CPU (an Intel Xeon with AVX-512 and AMX,
# where llama.cpp's CPU paths differ from a 2-core AVX2 VM's): the signal and orphan tests,
# the engine-failure tests, and the llama.cpp engine's tests with llama-cpp-python built there.
#
#   bash scripts/gpu/host_cpu_tests.sh LOGS    # from the tree's root, with .whl/ and .llama/ in it
#
# .whl: the project's dependencies as wheels for the machine's Python, with gguf, diskcache, jinja2
# and markupsafe.
# .llama/lcp-sdist.tar.gz: llama-cpp-python 0.3.36's sdist without .git, examples/ and, in
# vendor/llama.cpp, models/ docs/ benches/ tests/ examples/ tools/ui tools/server and the
# ggml backends other than cpu/cuda (~6 MB, small enough to copy with the tree).
# Logs go to the folder LOGS; the last lines printed are the summary.
set -u
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu/host_cpu_tests.sh LOGS (a folder for the logs)" >&2; exit 2; }
LOGS=$1
mkdir -p "$LOGS" || exit 2
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
SITE=$(mktemp -d)  # the wheels the GPU machine lacks, installed for this run only
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD
grep -o -m1 'model name.*' /proc/cpuinfo; grep -o 'amx_[a-z0-9]*\|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
python3 setup.py -q build_ext --inplace > "$LOGS/cref.log" 2>&1 && echo "compiled reference built"
if [ ! -f /tmp/lcp/llama_cpp/__init__.py ]; then
  mkdir -p /tmp/sd && tar -xzf .llama/lcp-sdist.tar.gz -C /tmp/sd
  el "building llama-cpp-python (CPU only)"
  CMAKE_ARGS="-DGGML_CUDA=off" CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation \
    --no-deps --no-index --target /tmp/lcp /tmp/sd/llama_cpp_python-0.3.36 > "$LOGS/build.log" 2>&1 \
    || { tail -20 "$LOGS/build.log"; exit 1; }
fi
export PYTHONPATH=/tmp/lcp:$PYTHONPATH
el "tests"
for t in test_signals test_engine_failures test_engine_llamacpp; do
  # setsid: a test that signals its own group by mistake cannot take the shell running this script with it
  timeout 170 setsid python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs "tests/$t.py" \
    > "$LOGS/$t.log" 2>&1 < /dev/null
  echo "$t: exit $? · $(tail -1 "$LOGS/$t.log")"
done
el "end"
