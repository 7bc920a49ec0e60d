"""gpu_attn_bench.py with -lineinfo, so ncu's source page maps SASS to attention.cu lines.
    python3 pv_lineinfo.py TREE [bench args...]"""
import os, runpy, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
from kestrel_tui.backends.cuda import runtime
runtime.NVCC_OPTIONS.append("-lineinfo")
script = os.path.join(tree, "scripts/gpu/gpu_attn_bench.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
