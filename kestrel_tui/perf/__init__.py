"""Speed and memory measurements; nothing in the decode path imports it.

cuda.py: the cuda backend's decode speed, batch-verify, graph == direct, per-kernel device time,
copy bandwidth and the bytes a step must read (`kestrel-tui bench --subject cuda`,
scripts/gpu_acceptance.py).
"""
