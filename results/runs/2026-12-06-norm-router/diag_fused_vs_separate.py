import sys
import numpy as np
from kestrel_tui.backends.cuda import make_cuda_backend
from kestrel_tui.backends.cuda.options import CudaOptions
from kestrel_tui.backends.toggles import parse_exact
from kestrel_tui.model.config import default_config, qwen3_30b_a3b_config
from kestrel_tui.model.weights import synthetic_model

cfg = default_config().with_layers(2) if sys.argv[1] == "default" else qwen3_30b_a3b_config(2)
m = synthetic_model(cfg)
for ex in ("none", "all"):
    outs = []
    for fuse in (True, False):
        b = make_cuda_backend(m, exact=parse_exact(ex), graph=False, options=CudaOptions(fuse=fuse))
        b.reset(16)
        b.step(np.array([5, 9, 11], np.int32), 0)
        o = b.step(np.array([7], np.int32), 3)
        outs.append(o.raw[0])
        print(ex, "fuse", fuse, "ok", flush=True)
    diff = [k for k in outs[0] if outs[0][k].tobytes() != outs[1][k].tobytes()]
    print(ex, "keys", len(outs[0]), "differ", len(diff), diff[:5], flush=True)
