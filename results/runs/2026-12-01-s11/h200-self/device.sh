# llama.cpp CPU vs llama.cpp CUDA through kestrel-tui, on the lent H200 (one call: build, probe, findings).
# Carries .whl (../shared/gpu/README.md) and .llama/lcp-sdist.tar.gz (llama-cpp-python 0.3.36 sdist without
# vendor/llama.cpp/{models,docs,benches,tests} and .git). Run from the repository root on the device.
set -u
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/sd $OUT/runs && tar -xzf .llama/lcp-sdist.tar.gz -C /tmp/sd
el "build start"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -1
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site2 /tmp/sd/llama_cpp_python-0.3.36 > $OUT/build.log 2>&1 \
  || { tail -30 $OUT/build.log; exit 1; }
el "build done"
export PYTHONPATH=/tmp/site2:/tmp/site:$PWD
python3 -c "import llama_cpp; print('gpu offload', llama_cpp.llama_supports_gpu_offload(), llama_cpp.__version__)"
# the last session's crash: kestrel's loader imported before llama_cpp; now the engine's child imports llama_cpp first
python3 -X faulthandler - > $OUT/probe.log 2>&1 <<'PY'
import llama_cpp
from kestrel_tui.model.hf import load_model
from kestrel_tui.model.gguf import write_gguf
write_gguf(load_model(None, "f32", n_layers=2), "/tmp/p.gguf")
mp = llama_cpp.llama_model_default_params(); mp.n_gpu_layers = 99; mp.use_extra_bufts = False
llama_cpp.llama_backend_init()
print("llama_cpp first, then kestrel: load ok", bool(llama_cpp.llama_model_load_from_file(b"/tmp/p.gguf", mp)))
PY
echo "probe rc $?"; grep -v "^llama_model_loader\|^print_info\|^load" $OUT/probe.log | tail -3
F="python3 -X faulthandler scripts/findings.py"
S=("" "exact=ubatch" "exact=flash_attn" "exact=ubatch+flash_attn" "exact=ubatch+flash_attn+op_offload"
   "toggle=gpu_layers:1" "toggle=gpu_layers:1,exact=ubatch+flash_attn+op_offload" "toggle=gpu_layers:0"
   "toggle=cublas:f32" "toggle=cublas:f16" "exact=ubatch+flash_attn+op_offload,toggle=cublas:f32")
P=profiles/llamacpp-cpu-vs-cuda.toml
el "f32"; timeout 90 $F --profile $P --json $OUT/runs/self-cuda-f32.json "${S[@]}" 2>$OUT/f32.err; echo rc $?; tail -3 $OUT/f32.err
el "q4_0"; timeout 90 $F --profile $P --weights q4_0 --json $OUT/runs/self-cuda-q4.json "${S[@]}" 2>$OUT/q4.err; echo rc $?; tail -3 $OUT/q4.err
L=results/runs/2026-12-01-s11/profiles/llamacpp-cpu-vs-cuda-long.toml
el "long prompt"; timeout 60 $F --profile $L --weights q4_0 --json $OUT/runs/self-cuda-long.json "" "exact=op_offload" "exact=ubatch" "toggle=gpu_layers:all" "toggle=gpu_layers:all,exact=ubatch+flash_attn" 2>$OUT/long.err; echo rc $?; tail -3 $OUT/long.err
el "a3b dims, 2 layers"
python3 -c "
from kestrel_tui.model.device_synthetic import device_synthetic_model
from kestrel_tui.model.config import qwen3_30b_a3b_config
from kestrel_tui.model.gguf import write_gguf
write_gguf(device_synthetic_model(qwen3_30b_a3b_config(2), seed=0, threads=16), '/tmp/a3b-2l.gguf')" || echo gguf failed
el "a3b written"
timeout 150 $F --profile $P --model /tmp/a3b-2l.gguf --weights q4_0 --json $OUT/runs/self-cuda-a3b.json "" "exact=ubatch+flash_attn+op_offload" "exact=ubatch+flash_attn" "toggle=cublas:f32" 2>$OUT/a3b.err; echo rc $?; tail -3 $OUT/a3b.err
el "end"
