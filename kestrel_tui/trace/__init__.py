"""Trace: probe key schema, FNV-1a 64 hashing, L2 dump files, comparison."""
from .compare import (NAN_ULP, ULP_BINS, Comparison, DiffStats, Status, compare,
                      diff_stats, ulp_bin_labels, ulp_distance, ulp_histogram)
from .dump import DumpError, DumpWriter, read_dump, write_dump
from .fnv import OFFSET_BASIS, PRIME, fnv1a64, hex16
from .keys import (ALL_FIELDS, DEEP_FIELDS, FIELDS, Key, emb_key, key_name, layer_fields,
                   logits_key, order_key, parse_key, token_keys)

__all__ = [
    "ALL_FIELDS", "DEEP_FIELDS", "FIELDS", "Key", "emb_key", "key_name", "layer_fields",
    "logits_key", "order_key", "parse_key", "token_keys",
    "OFFSET_BASIS", "PRIME", "fnv1a64", "hex16",
    "DumpError", "DumpWriter", "read_dump", "write_dump",
    "NAN_ULP", "ULP_BINS", "Comparison", "DiffStats", "Status", "compare",
    "diff_stats", "ulp_bin_labels", "ulp_distance", "ulp_histogram",
]
