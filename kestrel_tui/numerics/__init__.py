"""The numerics contract (docs/numerics.md) in numpy."""

# Bumped whenever an exact-path result can change (an evaluation order, a rounding, a probe's
# layout): a reference cached under another version is never reused (session/refcache.py).
CONTRACT_VERSION = 2  # 2: T1 keeps a NaN input (quieted)
