import sys, numpy as np
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/work/main/scripts')
from kestrel_tui.backends import ops_exact
from kestrel_tui.backends import decoder
from kestrel_tui.backends.base import NumpyBackend
from kestrel_tui.model.device_synthetic import device_synthetic_model
import gpu_acceptance as ga
seen = []
orig = ops_exact.route
def rec(logits, top_k, norm, expf=None):
    seen.append(np.array(logits, np.float32)); return orig(logits, top_k, norm, expf)
import dataclasses
cfg = ga.qwen3_30b_a3b_config(2)
m = device_synthetic_model(cfg, seed=0, threads=2)
b = NumpyBackend(m)
# patch every ops table that holds ops_exact.route
for name in dir(decoder):
    o = getattr(decoder, name)
    if dataclasses.is_dataclass(o) and not isinstance(o, type) and getattr(o, "route", None) is orig:
        object.__setattr__(o, "route", rec)
b.reset(64)
for t in range(16):
    b.step(np.array([(1 + 7919 * t) % cfg.vocab]), t, raw=False)
print(len(seen), "router calls")
for r in seen[::6]:
    r = r[0]; e = np.exp(r.astype(np.float64) - r.max()); p = np.sort(e / e.sum())[::-1]
    print("logit std %.3g range %.3g" % (r.std(), r.max() - r.min()), "top9 p", np.array2string(p[:9], precision=3), "n(p<1e-30)", int((p < 1e-30).sum()))
