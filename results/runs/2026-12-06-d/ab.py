import sys, numpy as np
from kestrel_tui.backends.cuda.weights import DeviceSyntheticModel
from kestrel_tui.model.config import qwen3_30b_a3b_config
from kestrel_tui.perf.cuda import decode_bench
m = DeviceSyntheticModel(qwen3_30b_a3b_config(48), name="ab")
r = decode_bench(m, ctx=1024, steps=40, direct=False, log=lambda *a: None)
print(f"{sys.argv[1]:6} fast dev {r['fast']['graph_gpu_ms']:.3f} wall {r['fast']['graph_ms']:.3f} | exact dev {r['exact']['graph_gpu_ms']:.3f} wall {r['exact']['graph_ms']:.3f}", flush=True)
