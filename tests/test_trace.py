"""trace/: key schema, FNV-1a 64, dump files, comparison and element stats."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kestrel_tui.trace import (
    ALL_FIELDS, DEEP_FIELDS, FIELDS, NAN_ULP, DumpError, DumpWriter, Key, Status,
    compare, diff_stats, emb_key, fnv1a64, hex16, key_name, logits_key, order_key,
    parse_key, read_dump, token_keys, ulp_bin_labels, ulp_distance, ulp_histogram,
    write_dump,
)


def f32(*bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)


# ---- keys ----------------------------------------------------------------

def test_530_keys_per_token_in_dataflow_order():
    keys = token_keys(32, 48)
    assert len(keys) == 530 == len(set(keys))
    assert keys[0] == "t32_emb" and keys[-1] == "t32_logits"
    assert keys[1:12] == [f"t32_l0_{f}" for f in FIELDS]
    assert keys[12] == "t32_l1_nrm" and keys[-2] == "t32_l47_x"
    assert sorted(keys, key=order_key) == keys
    assert sorted(reversed(keys), key=order_key) == keys


def test_deep_keys_interleave_consistently():
    keys = token_keys(0, 2, deep=True)
    assert len(keys) == 2 + 2 * (len(FIELDS) + len(DEEP_FIELDS))
    assert sorted(keys, key=order_key) == keys
    layer0 = [parse_key(k).field for k in keys[1:1 + len(ALL_FIELDS)]]
    assert layer0 == list(ALL_FIELDS)
    # the default order is a subsequence of the deep one
    assert [f for f in ALL_FIELDS if f in FIELDS] == list(FIELDS)
    pos = ALL_FIELDS.index
    assert pos("knorm") < pos("kpre") < pos("k")
    assert all(pos("ores") < pos(f) < pos("x") for f in ("pnrm", "router", "topk", "moe"))


def test_names_and_parse_round_trip():
    assert key_name(32, 0, "ks") == "t32_l0_ks"
    assert emb_key(3) == "t3_emb" and logits_key(3) == "t3_logits"
    assert parse_key("t32_l0_ks") == Key(32, 0, "ks")
    assert parse_key("t7_emb") == Key(7, None, "emb")
    assert parse_key("t7_logits") == Key(7, None, "logits")
    assert parse_key("t1_l2_attn_out") == Key(1, 2, "attn_out")  # foreign field
    for k in token_keys(5, 3, deep=True):
        assert parse_key(k).name == k


@pytest.mark.parametrize("bad", ["", "t", "emb", "t1", "t1_", "tx_emb", "t-1_emb", "t01_emb",
                                 "t1_l_x", "t1_l2_", "t1_l2", "t1_lx_nrm", "t1_l02_nrm",
                                 "t1_l2_x y", "t1_l2_9x", "T1_emb", "t1_emb\n", "t1_foo"])
def test_parse_key_rejects_malformed(bad):
    with pytest.raises(ValueError, match="malformed"):
        parse_key(bad)


def test_order_key_numeric_positions_and_foreign_keys():
    names = ["zz_unknown", "t10_emb", "t2_logits", "t2_l10_nrm", "t2_l9_x", "t2_l9_zeta",
             "t2_l9_alpha", "t2_l9_moe", "t2_emb", "aa_unknown", "t2_l9_kpre", "t2_l9_knorm"]
    assert sorted(names, key=order_key) == [
        "t2_emb", "t2_l9_knorm", "t2_l9_kpre", "t2_l9_moe", "t2_l9_x",
        "t2_l9_alpha", "t2_l9_zeta", "t2_l10_nrm", "t2_logits", "t10_emb",
        "aa_unknown", "zz_unknown"]
    assert order_key("t4_l0_nrm")[0] == 4


# ---- fnv -----------------------------------------------------------------

def ref_fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.mark.parametrize("data,expect", [(b"", "cbf29ce484222325"),
                                         (b"a", "af63dc4c8601ec8c"),
                                         (b"foobar", "85944171f73967e8")])
def test_fnv_known_vectors(data, expect):
    assert hex16(fnv1a64(data)) == expect
    assert hex16(fnv1a64(np.frombuffer(data, np.uint8))) == expect
    assert hex16(fnv1a64(bytearray(data))) == expect


def test_hex16_format():
    assert hex16(0) == "0" * 16 and hex16(0xABC) == "0000000000000abc"
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError):
            hex16(bad)


@given(st.binary(max_size=20000))
def test_fnv_matches_reference_on_bytes(data):
    assert fnv1a64(data) == ref_fnv1a64(data)


_SHAPES = st.one_of(hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=5000),
                   hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=60))


@settings(max_examples=80, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float32, np.int8]), _SHAPES), st.booleans())
def test_fnv_matches_reference_on_arrays(a, transpose):
    # 1-D float32 sizes cross the zero-copy threshold (8 KiB): both paths run;
    # the transpose of a 2-D array is a non-contiguous view.
    if transpose:
        a = a.T
    raw = np.ascontiguousarray(a).tobytes()
    assert fnv1a64(a) == ref_fnv1a64(raw)


def test_fnv_views_hash_as_contiguous_little_endian():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    expect = ref_fnv1a64(np.ascontiguousarray(a.T).tobytes())
    assert fnv1a64(a.T) == expect
    assert fnv1a64(a.astype(">f4")) == fnv1a64(a)
    big = np.arange(5000, dtype=np.float32)[::2]  # non-contiguous, above threshold
    assert fnv1a64(big) == ref_fnv1a64(np.ascontiguousarray(big).tobytes())
    with pytest.raises(TypeError):
        fnv1a64("text")
    with pytest.raises(TypeError, match="object arrays"):
        fnv1a64(np.array([1, "a"], dtype=object))


# ---- dump files ------------------------------------------------------------

def test_dump_round_trip_exact_bytes(tmp_path):
    items = [(k, fnv1a64(k.encode())) for k in token_keys(0, 2)] + [("t0_l0_foreign", 0)]
    p = tmp_path / "ref.txt"
    write_dump(p, items)
    text = p.read_bytes()
    assert text == b"".join(f"{k} {h:016x}\n".encode() for k, h in items)
    d = read_dump(p)
    assert list(d.items()) == items


def test_writer_publishes_only_a_whole_file(tmp_path):
    p = tmp_path / "d.txt"
    with DumpWriter(p) as w:
        w.write("t0_emb", 0xAF63DC4C8601EC8C)
        w.flush()
        assert not p.exists()  # still under a hidden temporary name
        (tmp,) = tmp_path.iterdir()
        assert tmp.name.startswith(".d.txt.") and tmp.read_text() == "t0_emb af63dc4c8601ec8c\n"
        w.write("t0_logits", 1)
    assert read_dump(p) == {"t0_emb": 0xAF63DC4C8601EC8C, "t0_logits": 1}
    assert [f.name for f in tmp_path.iterdir()] == ["d.txt"]


def test_writer_never_overwrites(tmp_path):
    p = tmp_path / "old.txt"
    p.write_bytes(b"t0_emb 0000000000000001\n")
    with pytest.raises(DumpError, match="exists.*choose another name"):
        DumpWriter(p)
    with pytest.raises(DumpError, match="exists"):
        write_dump(p, [("t0_emb", 2)])
    assert p.read_bytes() == b"t0_emb 0000000000000001\n"


def test_writer_refuses_unreadable_output(tmp_path):
    with DumpWriter(tmp_path / "w.txt") as w:
        w.write("t0_emb", 1)
        with pytest.raises(DumpError, match="duplicate"):
            w.write("t0_emb", 2)
        with pytest.raises(DumpError, match="bad characters"):
            w.write("t0 emb", 2)
        with pytest.raises(DumpError, match="64-bit"):
            w.write("t1_emb", 1 << 64)
    assert read_dump(tmp_path / "w.txt") == {"t0_emb": 1}


def test_reader_tolerates_uppercase_crlf_and_trailing_blanks(tmp_path):
    p = tmp_path / "win.txt"
    p.write_bytes(b"t0_emb AF63DC4C8601EC8C\r\nt0_logits 0000000000000001\r\n\r\n\n  \n")
    assert read_dump(p) == {"t0_emb": 0xAF63DC4C8601EC8C, "t0_logits": 1}
    p2 = tmp_path / "nofinal.txt"
    p2.write_bytes(b"t0_emb 0000000000000002")  # no final newline
    assert read_dump(p2) == {"t0_emb": 2}


GOOD = "t0_emb 0000000000000001\n"


@pytest.mark.parametrize("bad_line,why", [
    ("t0_l0_nrm", "no space"),
    ("t0_l0_nrm 0000000000000001 extra", "3 fields"),
    ("t0_l0_nrm  0000000000000001", "more than one space"),
    ("t0_l0_nrm\t0000000000000001", "tab at column 10"),
    ("t0_l0_nrm 0000000000000001 ", "trailing space after the hash"),
    ("t0_l0_nrm 0000000000000001\t", "tab at column 27"),
    ("t0_l0_nrm 00000000\r00000001", "carriage return at column 19"),
    ("t1000000000000_emb 0000000000000001", "position index 1000000000000"),
    ("t0_l2147483648_x 0000000000000001", "layer index 2147483648"),
    ("t" + "9" * 30 + "_emb 0000000000000001", "(30 digits)"),
    ("t0_l0_nrm 000000000000001", "15 hex digits"),
    ("t0_l0_nrm 00000000000000001", "17 hex digits"),
    ("t0_l0_nrm 000000000000000g", "not hexadecimal"),
    ("t0_l0_nrm 0x00000000000001", "not hexadecimal"),
    (" 0000000000000001", "starts with a space"),
    ("t0_l0_\x01nrm 0000000000000001", "control character 0x01 at column 7"),
    ("", "blank line"),
])
def test_reader_malformed_lines_name_file_and_line(tmp_path, bad_line, why):
    p = tmp_path / "bad.txt"
    p.write_text(GOOD + "t0_l0_kraw 0000000000000002\n" + bad_line + "\n" + GOOD.replace("emb", "logits"),
                 newline="")
    with pytest.raises(DumpError) as e:
        read_dump(p)
    msg = str(e.value)
    assert f"{p}:3:" in msg and why in msg and "\n" not in msg


def test_reader_non_ascii(tmp_path):
    p = tmp_path / "u.txt"
    p.write_bytes(GOOD.encode() + "t0_l0_é 0000000000000001\n".encode())
    with pytest.raises(DumpError, match=r"u\.txt:2: non-ASCII byte 0xc3 at column 7"):
        read_dump(p)


def test_reader_names_a_byte_order_mark(tmp_path):
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    with pytest.raises(DumpError, match=r"bom\.txt:1: .*byte-order mark \(BOM\); save it without one"):
        read_dump(p)


def test_reader_refuses_a_partial_dump_and_a_large_position_is_kept(tmp_path):
    p = tmp_path / "run.txt.partial"
    p.write_text(GOOD)
    with pytest.raises(DumpError, match=r"partial dump .*interrupted"):
        read_dump(p)
    big = tmp_path / "big.txt"
    big.write_text("t2147483647_emb 0000000000000001\n")  # the largest index still accepted
    assert read_dump(big) == {"t2147483647_emb": 1}


def test_reader_duplicate_names_both_lines(tmp_path):
    p = tmp_path / "dup.txt"
    p.write_text(GOOD + "t0_l0_nrm 0000000000000002\n" + "t0_emb 0000000000000003\n")
    with pytest.raises(DumpError, match=r"dup\.txt:3: duplicate key 't0_emb' \(first at line 1\)"):
        read_dump(p)


@pytest.mark.parametrize("content", [b"", b"\n", b"\r\n\n"])
def test_reader_empty_file(tmp_path, content):
    p = tmp_path / "empty.txt"
    p.write_bytes(content)
    with pytest.raises(DumpError, match=r"empty\.txt: empty dump file"):
        read_dump(p)


def test_reader_missing_and_unreadable(tmp_path):
    with pytest.raises(DumpError, match=r"nope\.txt: cannot read"):
        read_dump(tmp_path / "nope.txt")
    with pytest.raises(DumpError, match="cannot read"):
        read_dump(tmp_path)  # a directory


# ---- compare ---------------------------------------------------------------

def test_first_diff_is_smallest_dataflow_key_not_file_order():
    ordered = token_keys(0, 3) + token_keys(1, 3)
    shuffled = [ordered[i] for i in np.random.default_rng(1).permutation(len(ordered))]
    ref = {k: i for i, k in enumerate(shuffled)}  # engines may append in any order
    sub = dict(reversed(list(ref.items())))
    for k in ("t1_l0_attn", "t0_l2_x", "t0_l1_ks", "t0_logits"):
        sub[k] += 1000
    c = compare(ref, sub)
    assert c.first_diff == c.first_mismatch == "t0_l1_ks"
    assert list(c.status) == ordered  # dataflow order, whatever the input order
    assert c.counts[Status.DIFF] == 4 and c.counts[Status.OK] == len(ref) - 4
    assert not c.identical


def test_missing_keys_both_ways():
    ref = {"t0_emb": 1, "t0_l0_nrm": 2, "t0_l0_x": 3}
    sub = {"t0_emb": 1, "t0_l0_x": 4, "t0_l0_kraw": 5}
    c = compare(ref, sub)
    assert c.status == {"t0_emb": Status.OK, "t0_l0_nrm": Status.MISSING_SUB,
                        "t0_l0_kraw": Status.MISSING_REF, "t0_l0_x": Status.DIFF}
    assert c.first_mismatch == "t0_l0_nrm" and c.first_diff == "t0_l0_x"
    c2 = compare(sub, ref)
    assert c2.status["t0_l0_nrm"] is Status.MISSING_REF
    assert c2.status["t0_l0_kraw"] is Status.MISSING_SUB


def test_identical_and_pending():
    ref = {k: 7 for k in token_keys(0, 1) + token_keys(1, 1)}
    sub = {k: 7 for k in token_keys(0, 1)}
    assert compare(ref, dict(ref)).identical
    c = compare(ref, dict(ref)).counts
    assert c[Status.OK] == len(ref) and sum(c.values()) == len(ref)
    done = compare(ref, sub)
    assert not done.identical and done.first_mismatch == "t1_emb"
    live = compare(ref, sub, sub_done=False)
    assert live.identical and live.first_mismatch is None
    assert live.counts[Status.PENDING] == len(token_keys(1, 1))


# ---- element stats -----------------------------------------------------------

def test_diff_stats_float32_special_values():
    a = f32(0x00000000, 0x3F800000, 0x00000001, 0x7F7FFFFF, 0x7F800000, 0x40000000)
    b = f32(0x80000000, 0x3F800001, 0x80000001, 0x7F800000, 0x7F800000, 0x40000000)
    #       +0 vs -0,   1 vs next,  ±min denormal, max vs inf, inf=inf, equal
    s = diff_stats(a, b)
    assert s.n == 6 and s.n_diff == 4 and s.n_nan == 0
    assert ulp_distance(a, b).tolist() == [0, 1, 2, 1, 0, 0]
    assert s.max_ulp == 2
    assert s.max_abs_err == math.inf
    assert s.first_index == 0
    assert np.float32(s.first_a).view(np.uint32) == 0 and np.float32(s.first_b).view(np.uint32) == 0x80000000


def test_diff_stats_ulp_across_zero_and_binades():
    a = f32(0x3F800000, 0x00800000, 0xBF800000, 0x7F800000)   # 1.0, min normal, -1.0, +inf
    b = f32(0x3F7FFFFF, 0x007FFFFF, 0x3F800000, 0xFF800000)   # prev, max denormal, +1.0, -inf
    assert ulp_distance(a, b).tolist() == [1, 1, 2 * 0x3F800000, 2 * 0x7F800000]
    s = diff_stats(a, b)
    assert s.max_ulp == 2 * 0x7F800000 and s.n_diff == 4
    s2 = diff_stats(a[:3], b[:3])
    assert s2.max_abs_err == 2.0
    assert s2.first_a == 1.0 and s2.first_b == float(np.float32(1.0) - np.float32(2.0 ** -24))


def test_diff_stats_first_index_is_flat_c_order():
    a = np.zeros((3, 4), np.float32)
    b = a.copy()
    b[2, 1] = 3.0
    b[1, 3] = -0.5
    s = diff_stats(a, b)
    assert s.first_index == 7 and s.first_a == 0.0 and s.first_b == -0.5
    assert s.n_diff == 2 and s.max_abs_err == 3.0


def test_diff_stats_nan():
    qnan, other_nan = 0x7FC00000, 0x7FC00001
    a = f32(qnan, qnan, 0x3F800000)
    b = f32(qnan, other_nan, qnan)
    s = diff_stats(a, b)
    assert s.n_diff == 2 and s.n_nan == 2 and s.max_ulp == NAN_ULP
    assert s.max_abs_err == 0.0  # NaN pairs are excluded from abs error
    assert ulp_distance(a, b).tolist() == [0, NAN_ULP, NAN_ULP]


def test_diff_stats_identical_and_int8():
    x = np.arange(-5, 5, dtype=np.float32)
    s = diff_stats(x, x.copy())
    assert s.identical and s.max_ulp == 0 and s.first_index is None
    a = np.array([-128, 0, 127, 5], np.int8)
    b = np.array([127, 0, -128, 6], np.int8)
    s = diff_stats(a, b)
    assert s.n_diff == 3 and s.max_ulp == 255 and s.max_abs_err == 255.0
    assert (s.first_index, s.first_a, s.first_b) == (0, -128, 127)


def test_diff_stats_float64_extremes_do_not_overflow():
    a = np.array([np.inf, 0.0], np.float64)
    b = np.array([-np.inf, -0.0], np.float64)
    s = diff_stats(a, b)
    assert s.max_ulp == 2 * 0x7FF0000000000000 and s.n_diff == 2


def test_diff_stats_shape_dtype_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        diff_stats(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="dtype mismatch"):
        diff_stats(np.zeros(3, np.float32), np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="unsupported dtype"):
        diff_stats(np.zeros(3, bool), np.zeros(3, bool))


def test_ulp_histogram_buckets():
    base = np.full(9, 1.0, np.float32)
    steps = np.array([0, 1, 2, 3, 4, 5, 16, 1 << 20, (1 << 20) + 1], np.uint32)
    other = (base.view(np.uint32) + steps).view(np.float32)
    counts = ulp_histogram(base, other)
    labels = ulp_bin_labels()
    assert len(counts) == len(labels) == 23 and sum(counts) == 9
    got = {labels[i]: c for i, c in enumerate(counts) if c}
    assert got == {"0": 1, "1": 1, "2": 1, "3-4": 2, "5-8": 1, "9-16": 1,
                   "524289-1048576": 1, ">1048576": 1}
    assert labels[:6] == ["0", "1", "2", "3-4", "5-8", "9-16"]
    assert ulp_histogram(base, other, bins=[0, 4]) == [1, 4, 4]
    with pytest.raises(ValueError):
        ulp_histogram(base, other, bins=[4, 4])


def test_a_dump_with_a_line_of_megabytes_fails_at_that_line_in_bounded_memory(tmp_path):
    """`diff` on a file holding a 52 MB tag: one line naming the line, read chunk by chunk (not
    held whole, not printed whole)."""
    import subprocess
    import sys

    big = tmp_path / "big.txt"
    tag = "t0_" + "a" * 52_000_000
    big.write_text(f"t0_emb {0:016x}\n{tag} {1:016x}\n")
    code = ("import sys\n"
            "from kestrel_tui.trace.dump import DumpError, read_dump\n"
            "try:\n    read_dump(sys.argv[1])\nexcept DumpError as e:\n    print(e)\n"
            # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec
            "print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, timeout=60)
    msg, rss_kb = out.stdout.splitlines()
    assert msg.startswith(f"{big}:2: a line longer than 4096 bytes") and len(msg) < 300
    assert int(rss_kb) < 200_000, f"peak RSS {rss_kb} KB"


def test_a_tag_longer_than_the_limit_is_refused_clipped(tmp_path):
    p = tmp_path / "long.txt"
    p.write_text(f"t0_{'b' * 300} {1:016x}\n")
    with pytest.raises(DumpError) as e:
        read_dump(p)
    assert "a tag of 303 characters" in str(e.value) and len(str(e.value)) - len(str(p)) < 160
    from kestrel_tui.errors import UsageError

    with pytest.raises(UsageError, match="a tag of 303 characters"):
        write_dump(tmp_path / "w.txt", [(f"t0_{'b' * 300}", 1)])  # what the reader refuses, the writer does


def test_a_dump_that_is_a_fifo_is_refused_at_once(tmp_path):
    """The process engine's reader of a growing dump and `diff` alike: a FIFO (or a device) in the
    dump's place is one DumpError, not a wait for a writer that never comes."""
    import os

    from kestrel_tui.trace.dump import DumpTail

    fifo = tmp_path / "dump.txt"
    os.mkfifo(fifo)
    with pytest.raises(DumpError, match="it is a FIFO, not a regular file"):
        DumpTail(str(fifo)).poll()
    with pytest.raises(DumpError, match="it is a FIFO"):
        read_dump(fifo)
