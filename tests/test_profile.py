"""TOML profiles: structure, types, and every error located to its file and line."""
from pathlib import Path

import pytest

from kestrel_tui.engines.base import EngineSpec, Toggle
from kestrel_tui.engines.profile import ProfileError, _scan, load_profile, located
from kestrel_tui.errors import UsageError
from kestrel_tui.trace.compare import Tolerance

PROFILES = Path(__file__).resolve().parent.parent / "profiles"

HF = """\
[reference]
engine = "cpu"
[subject]
engine = "hf"
model = "m"
"""


def write(tmp_path, text, name="p.toml", model_dir=True):
    if model_dir:
        (tmp_path / "m").mkdir(exist_ok=True)
    f = tmp_path / name
    f.write_text(text, encoding="utf-8")
    return f


def error(tmp_path, text, **kw) -> ProfileError:
    f = write(tmp_path, text)
    with pytest.raises(ProfileError) as ei:
        load_profile(f, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and isinstance(ei.value, UsageError)
    assert msg.startswith(f"{f}:" if ei.value.line is None else f"{f}:{ei.value.line}: ")
    return ei.value


def at(tmp_path, text, line, key, *words, **kw):
    e = error(tmp_path, text, **kw)
    assert e.line == line, str(e)
    assert e.key == key, str(e)
    for w in words:
        assert w in str(e), str(e)
    return e


# ------------------------------------------------------------ examples


def test_every_shipped_profile_is_covered():
    assert sorted(p.stem for p in PROFILES.glob("*.toml")) == sorted(EXAMPLES)


EXAMPLES = ["cpu-vs-cuda", "cpu-vs-hf", "cpu-vs-hf-cuda", "cpu-vs-hf-tp2", "cpu-vs-llamacpp", "hf-ep2-moe",
            "hf-eager-vs-sdpa", "hf-tp1-vs-tp2", "llamacpp-cpu-vs-cuda", "seed-process", "trainer-vs-rollout-f32",
            "trainer-vs-rollout-bf16", "chunked-prefill", "prefix-reuse"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_load(name, tmp_path):
    p = load_profile(PROFILES / f"{name}.toml", model_override=str(tmp_path))
    assert p.model == str(tmp_path.resolve())
    assert p.reference.model == p.subject.model == p.model


def test_example_cpu_vs_cuda_needs_no_model():
    p = load_profile(PROFILES / "cpu-vs-cuda.toml")
    assert (p.reference.engine, p.subject.engine, p.model, p.subject.toggles) == ("cpu", "cuda", None, None)
    assert p.reference.model is None and p.subject.options == {}


def test_example_cpu_vs_hf(tmp_path):
    p = load_profile(PROFILES / "cpu-vs-hf.toml", model_override=str(tmp_path))
    assert (p.weights, p.kv, p.tolerance) == ("f32", "f32", Tolerance(nmse=1e-7))
    attn, dtype, prefill = p.subject.toggles
    assert attn == Toggle("attn", ("eager", "sdpa"), "eager", ("attn",), attn.help, "attn_implementation")
    assert attn.default == "eager" and attn.binary
    assert dtype.values == ("float32", "bfloat16", "float16") and not dtype.binary and dtype.key == "dtype"
    assert (prefill.default, prefill.exact) == ("batched", "token")


def test_example_cpu_vs_hf_without_model_is_the_embedded_default():
    # the hf engine exports the embedded model itself (engines/hf.py), as the README's first command runs it
    p = load_profile(PROFILES / "cpu-vs-hf.toml")
    assert p.model is None and p.subject.model is None


def test_example_seed_process(tmp_path):
    p = load_profile(PROFILES / "seed-process.toml", model_override=str(tmp_path))
    assert p.tokens == 4
    assert p.reference.options["dump_env"] == "VLLM_L2_DUMP"
    assert "--cuda" in p.subject.options["command"] and "--cuda" not in p.reference.options["command"]
    assert p.subject.options["env"] == {"VLLM_CUDA_DECODE": "1", "VLLM_CUDA_INFER": "1", "VLLM_CUDA_FORCE_CPU": "1"}
    keys = {t.key: (t.default, t.exact) for t in p.subject.toggles}
    assert keys == {"VLLM_CUDA_L2EXACT": ("0", "1"), "VLLM_CUDA_ATTN_BITEXACT": ("0", "1")}


# ------------------------------------------------------------ the happy path


FULL = """\
# a comment
description = "full"
model = "m"
weights = "f32"
kv = "q8"
tokens = 3
prompt_ids = [5, 6,
  7]
tolerance = "nmse=1e-7,ulp=4"
deep = true

[reference]
engine = "cpu"

[subject]
engine = "hf"
options = { dtype = "float32", device = "cpu" }

[[toggle]]
name = "attn"
key = "attn_implementation"
fast = "sdpa"
exact = "eager"

[[toggle]]
name = "dtype2"
key = "tf32"
values = ["off", "on"]
default = "on"
"""


def test_full_profile(tmp_path):
    p = load_profile(write(tmp_path, FULL))
    m = str((tmp_path / "m").resolve())
    assert (p.model, p.weights, p.kv, p.tokens, p.prompt_ids, p.prompt, p.deep) == (m, "f32", "q8", 3, [5, 6, 7],
                                                                                     None, True)
    assert p.reference == EngineSpec("cpu", m, {}, None)
    assert p.subject.options == {"dtype": "float32", "device": "cpu"}
    attn, tf32 = p.subject.toggles
    assert (attn.values, attn.exact, attn.default) == (("sdpa", "eager"), "eager", "sdpa")
    assert (tf32.values, tf32.exact, tf32.default) == (("on", "off"), None, "on")  # default moves to the front


def test_relative_model_resolves_against_profile_folder(tmp_path, monkeypatch):
    sub = tmp_path / "profiles"
    sub.mkdir()
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (sub / "own.gguf").write_bytes(b"")
    f = write(sub, 'model = "../models/tiny"\n[reference]\nengine = "cpu"\nmodel = "own.gguf"\n'
              '[subject]\nengine = "sim"\n', model_dir=False)
    monkeypatch.chdir(tmp_path / "models")  # not the profile's folder
    p = load_profile(f)
    assert p.model == p.subject.model == str((tmp_path / "models" / "tiny").resolve())
    assert p.reference.model == str((sub / "own.gguf").resolve())


def test_model_override_replaces_top_level_only(tmp_path, monkeypatch):
    (tmp_path / "other").mkdir()
    (tmp_path / "own").mkdir()
    f = write(tmp_path, 'model = "m"\n[reference]\nengine = "cpu"\nmodel = "own"\n[subject]\nengine = "sim"\n')
    monkeypatch.chdir(tmp_path)
    p = load_profile(f, model_override="other")  # relative to the working directory, as --model is
    assert p.model == p.subject.model == str((tmp_path / "other").resolve())
    assert p.reference.model == str((tmp_path / "own").resolve())


def test_model_override_rescues_a_missing_model(tmp_path):
    f = write(tmp_path, 'model = "gone"\n[reference]\nengine = "cpu"\n[subject]\nengine = "sim"\n')
    assert load_profile(f, model_override=str(tmp_path)).model == str(tmp_path.resolve())


def test_missing_override_is_an_error(tmp_path):
    with pytest.raises(ProfileError) as ei:
        load_profile(write(tmp_path, HF), model_override=str(tmp_path / "nope"))
    assert str(ei.value).startswith(f"--model {tmp_path / 'nope'}: does not exist;")


def test_prompt_text_and_absent_settings(tmp_path):
    p = load_profile(write(tmp_path, 'prompt = "Hello"\n' + HF))
    assert (p.prompt, p.prompt_ids, p.tokens, p.weights, p.kv, p.tolerance, p.model) == ("Hello", None, None, None,
                                                                                          None, None, None)
    assert p.subject.model == str((tmp_path / "m").resolve())


def test_loading_writes_nothing(tmp_path):
    f = write(tmp_path, FULL)
    before = sorted(x.name for x in tmp_path.rglob("*"))
    load_profile(f)
    assert sorted(x.name for x in tmp_path.rglob("*")) == before


# ------------------------------------------------------------ file errors


def test_file_not_found(tmp_path):
    with pytest.raises(ProfileError) as ei:
        load_profile(tmp_path / "nope.toml")
    assert str(ei.value).startswith(f"{tmp_path / 'nope.toml'}: not found;") and ei.value.line is None


def test_directory(tmp_path):
    with pytest.raises(ProfileError, match="is a directory"):
        load_profile(tmp_path)


def test_not_utf8(tmp_path):
    f = tmp_path / "p.toml"
    f.write_bytes(b'[reference]\nengine = "cpu"\n# caf\xe9\n')
    with pytest.raises(ProfileError) as ei:
        load_profile(f)
    assert str(ei.value) == f"{f}:3: not UTF-8 text (byte 0xe9); save the file as UTF-8"


def test_bom_is_fine(tmp_path):
    f = tmp_path / "p.toml"
    f.write_bytes(b"\xef\xbb\xbf" + HF.encode())
    (tmp_path / "m").mkdir()
    assert load_profile(f).subject.engine == "hf"


@pytest.mark.parametrize("text,line", [
    ('tokens = 16\nkv = "f32\n[reference]\n', 2),       # unclosed string
    ('tokens = 16\n\n[reference\nengine = "cpu"\n', 3),  # unclosed header
    ('tokens = 16\ntokens = 17\n', 2),                   # duplicate key
    ('x = [1,\n2,\n\n', 2),                               # unclosed array: its last line
])
def test_toml_syntax_error(tmp_path, text, line):
    e = at(tmp_path, text, line, "TOML syntax")
    assert f":{line}: TOML syntax: " in str(e) and "(at line" not in str(e)


# ------------------------------------------------------------ structure and types


def test_unknown_top_level_key_suggests(tmp_path):
    at(tmp_path, 'tokens = 4\ntoken = 4\n' + HF, 2, "token", "unknown key", "did you mean 'tokens'?")


def test_unknown_key_far_from_all_lists_them(tmp_path):
    at(tmp_path, HF + '\n[zzz]\nq = 1\n', 7, "zzz", "known keys: description, model")


def test_unknown_side_key_suggests(tmp_path):
    at(tmp_path, '[reference]\nengine = "cpu"\nengin = "x"\n[subject]\nengine = "sim"\n', 3, "reference.engin",
       "did you mean 'engine'?")


def test_reference_toggles_are_refused(tmp_path):
    at(tmp_path, HF + '[[reference.toggle]]\nname = "a"\n', 6, "reference.toggle", "[reference.options]")


def test_unknown_toggle_key_suggests(tmp_path):
    at(tmp_path, HF + '[[toggle]]\nname = "a"\nkey = "k"\nfast = "x"\nexact = "y"\n\n[[toggle]]\nname = "b"\n'
       'key = "j"\nvalus = ["1", "2"]\n', 15, "toggle[2].valus", "did you mean 'values'?")


def test_wrong_types(tmp_path):
    at(tmp_path, 'tokens = "16"\n' + HF, 1, "tokens", "is a string, want a whole number")
    at(tmp_path, 'tokens = true\n' + HF, 1, "tokens", "is a boolean")
    at(tmp_path, '\nmodel = 3\n' + HF, 2, "model", "is a whole number, want a string")
    at(tmp_path, 'deep = 1\n' + HF, 1, "deep", "want true or false")
    at(tmp_path, HF + 'options = "x"\n', 6, "subject.options", "want a table")
    at(tmp_path, 'subject = 1\n[reference]\nengine = "cpu"\n', 1, "subject", "want a table")
    at(tmp_path, 'prompt_ids = "1,2"\n' + HF, 1, "prompt_ids", "want an array")
    at(tmp_path, 'prompt_ids = [1,\n -2]\n' + HF, 1, "prompt_ids", "-2 is not a token id")
    at(tmp_path, 'prompt_ids = []\n' + HF, 1, "prompt_ids", "an empty array")


def test_bad_choices(tmp_path):
    at(tmp_path, 'kv = "q4"\n' + HF, 1, "kv", "'q4' is not one of q8, f32")
    at(tmp_path, '\n\nweights = "q8"\n' + HF, 3, "weights", "q4_0, f32")


def test_prompt_and_prompt_ids(tmp_path):
    at(tmp_path, 'prompt_ids = [1]\nprompt = "hi"\n' + HF, 2, "prompt", "keep one")


def test_tokens_below_one(tmp_path):
    at(tmp_path, '\ntokens = 0\n' + HF, 2, "tokens", "0 is below 1")


def test_bad_tolerance(tmp_path):
    e = at(tmp_path, 'tolerance = "nmse<=1e-7"\n' + HF, 1, "tolerance", "unknown criterion", "nmse=1e-7")
    assert "--tol" not in str(e)
    at(tmp_path, '\ntolerance = "ulp=x"\n' + HF, 2, "tolerance", "not a whole number")


def test_missing_side(tmp_path):
    e = error(tmp_path, '[reference]\nengine = "cpu"\n')
    assert e.line is None and e.key == "subject" and "add a [subject] table" in str(e)


def test_missing_engine(tmp_path):
    at(tmp_path, '[reference]\nengine = "cpu"\n\n[subject]\nmodel = "m"\n', 4, "subject", "no engine")


def test_unknown_engine_lists_engines(tmp_path):
    at(tmp_path, '[reference]\nengine = "cpu"\n[subject]\nengine = "cdua"\n', 4, "subject.engine",
       "unknown engine 'cdua'", "did you mean 'cuda'?", "cpu, sim, cuda, hf, hf-dist, process")


def test_builtin_engines_take_no_options_or_toggles(tmp_path):
    at(tmp_path, '[reference]\nengine = "cpu"\n[reference.options]\nx = 1\n[subject]\nengine = "sim"\n', 3,
       "reference.options", "takes no options")
    at(tmp_path, '[reference]\nengine = "cpu"\n[subject]\nengine = "cuda"\n[[toggle]]\nname = "a"\n', 5,
       "toggle[1]", "has its own toggles")


def test_missing_model_path(tmp_path):
    e = at(tmp_path, '[reference]\nengine = "cpu"\n[subject]\nengine = "hf"\nmodel = "nope/dir"\n', 5,
           "subject.model", "does not exist")
    assert str(tmp_path / "nope" / "dir") in str(e)
    at(tmp_path, '\nmodel = "gone.gguf"\n' + HF, 2, "model", str(tmp_path / "gone.gguf"))


# ------------------------------------------------------------ toggles


T = HF + '[subject.options]\ndevice = "cpu"\n'  # toggles start at line 8


def test_toggle_missing_name_and_key(tmp_path):
    at(tmp_path, T + '[[toggle]]\nkey = "k"\nfast = "a"\nexact = "b"\n', 8, "toggle[1]", "no name")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nfast = "a"\nexact = "b"\n', 8, "toggle[1]", "no key")


def test_toggle_values_with_fast(tmp_path):
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nvalues = ["a", "b"]\nfast = "a"\nexact = "b"\n', 12,
       "toggle[1].fast", "not both")


def test_toggle_needs_values_or_fast_exact(tmp_path):
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\n', 8, "toggle[1]", "no exact")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\n', 8, "toggle[1]", "no values")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\nexact = "a"\n', 12, "toggle[1].exact",
       "equals fast")


def test_toggle_fewer_than_two_values(tmp_path):
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\n\nvalues = ["a"]\n', 12, "toggle[1].values", "has 1 value")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nvalues = ["a", "a"]\n', 11, "toggle[1].values", "twice")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nvalues = [0, 1]\n', 11, "toggle[1].values", 'quote numbers')


def test_toggle_exact_not_among_values(tmp_path):
    e = at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nvalues = ["a", "b", "c"]\nexact = "d"\n', 12,
           "toggle[1].exact", "'d' is not among values")
    assert "['a', 'b', 'c']" in str(e)


def test_toggle_list_with_exact_is_binary(tmp_path):
    p = load_profile(write(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nvalues = ["a", "b", "c"]\nexact = "c"\n'))
    (t,) = p.subject.toggles
    assert (t.values, t.exact, t.default, t.binary) == (("a", "b", "c"), "c", "a", True)


def test_toggle_bad_default_and_name(tmp_path):
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\nexact = "b"\ndefault = "c"\n', 13,
       "toggle[1].default", "not among")
    at(tmp_path, T + '[[toggle]]\nname = "a,b"\nkey = "k"\nfast = "a"\nexact = "b"\n', 9, "toggle[1].name",
       "characters")


def test_duplicate_toggle_names_and_keys(tmp_path):
    one = '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\nexact = "b"\n'
    at(tmp_path, T + one + one, 14, "toggle[2].name", "already the name of toggle[1]")
    at(tmp_path, T + one + one.replace('"n"', '"m"'), 15, "toggle[2].key", "already set by toggle[1]")


def test_option_also_set_by_toggle(tmp_path):
    at(tmp_path, T + 'dtype = "float32"\n[[toggle]]\nname = "d"\nkey = "dtype"\nvalues = ["float32", "float16"]\n', 8,
       "subject.options.dtype", "also set by toggle 'd'")
    text = ('[reference]\nengine = "cpu"\n[subject]\nengine = "process"\n[subject.options]\ncommand = "x"\n'
            '[subject.options.env]\nA = "1"\nB = "0"\n[[toggle]]\nname = "b"\nkey = "B"\nfast = "0"\nexact = "1"\n')
    at(tmp_path, text, 9, "subject.options.env.B", "also set by toggle 'b'")


def test_toggle_owns_and_help(tmp_path):
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\nexact = "b"\nowns = "attn"\n', 13,
       "toggle[1].owns", "array of probe field names")
    at(tmp_path, T + '[[toggle]]\nname = "n"\nkey = "k"\nfast = "a"\nexact = "b"\nhelp = 1\n', 13,
       "toggle[1].help", "want a string")


# ------------------------------------------------------------ locating


def test_scan_tables_arrays_inline_and_strings():
    text = '''\
# head
a = 1
b = """
[not.a.table]
c = 2
"""
arr = [
  "x]", # ]
  { k = "v" },
]
d.e = 'lit'
"q k".z = 1

[ s . "opt" ]
x = { y = 1, z = [1,
  2] }
w = 3

[[t]]
n = "one"
[t.sub]
m = 1

[[t]]
n = "two"
'''
    lines = _scan(text)
    assert lines[("a",)] == 2 and lines[("b",)] == 3 and ("c",) not in lines and ("not",) not in lines
    assert lines[("arr",)] == 7 and ("k",) not in lines
    assert lines[("d",)] == lines[("d", "e")] == 11
    assert lines[("q k", "z")] == 12
    assert lines[("s",)] == lines[("s", "opt")] == 14 and lines[("s", "opt", "x")] == 15
    assert lines[("s", "opt", "w")] == 17
    assert lines[("t",)] == lines[("t", 0)] == 19 and lines[("t", 0, "n")] == 20
    assert lines[("t", 0, "sub")] == 21 and lines[("t", 0, "sub", "m")] == 22
    assert lines[("t", 1)] == 24 and lines[("t", 1, "n")] == 25


def test_inline_side_table_locates_to_its_line(tmp_path):
    text = 'model = "m"\nreference = { engine = "cpu" }\nsubject = { engine = "hf", options = { dtype = "x" } }\n'
    p = load_profile(write(tmp_path, text))
    assert p.where("subject", "dtype") == f"{tmp_path / 'p.toml'}:3"
    at(tmp_path, 'reference = { engine = "cpu" }\n\nsubject = { engine = "nope" }\n', 3, "subject.engine")


def test_where_and_located(tmp_path):
    f = write(tmp_path, T + 'dtype = "float99"\n[[toggle]]\nname = "attn"\nkey = "attn_implementation"\n'
              'fast = "sdpa"\nexact = "eager"\n')
    p = load_profile(f)
    assert p.where("subject") == f"{f}:3"
    assert p.where("subject", "dtype") == f"{f}:8"
    assert p.where("subject", "nothing") == f"{f}:6"                 # the options table
    assert p.where("subject", "attn_implementation") == f"{f}:11"    # a toggle's key
    assert p.where("reference") == f"{f}:1"
    assert p.where_toggle("attn") == f"{f}:11"
    e = located(p, "subject", UsageError("hf dtype 'float99': want float32, bfloat16 or float16"))
    assert str(e) == f"{f}:8: subject.options.dtype: hf dtype 'float99': want float32, bfloat16 or float16"
    assert e.line == 8 and isinstance(e, UsageError)
    e = located(p, "subject", UsageError("attn_implementation 'x' unknown"))
    assert str(e).startswith(f"{f}:11: toggle attn: ")
    e = located(p, "subject", UsageError("cannot load the model"))
    assert str(e) == f"{f}:3: subject: cannot load the model"
    e = located(p, "subject", UsageError("device: 'tpu'"), option_hint="device")
    assert e.line == 7


# ------------------------------------------------------------ what the process engine is handed

PROC = """\
[reference]
engine = "cpu"

[subject]
engine = "process"
options = {{ command = {command}, dump_env = "D"{extra} }}
{toggles}"""


def _proc(command='["true"]', extra="", toggles=""):
    return PROC.format(command=command, extra=extra, toggles=toggles)


def test_a_misspelt_owns_field_is_refused_for_every_engine(tmp_path):
    tog = '[[toggle]]\nname = "a"\nkey = "A"\nfast = "0"\nexact = "1"\nowns = ["attn", "atn"]\n'
    e = at(tmp_path, _proc(toggles=tog), 12, "toggle[1].owns", "'atn' is not a probe field", "did you mean 'attn'?")
    hf = HF + tog.replace('key = "A"', 'key = "attn_implementation"')
    at(tmp_path, hf, 11, "toggle[1].owns", "'atn' is not a probe field")
    # a process's own declared fields are fields it can make
    ok = _proc(extra=', fields = ["attn", "mine"]', toggles=tog.replace('"atn"', '"mine"'))
    assert load_profile(write(tmp_path, ok)).subject.toggles[0].owns == ("attn", "mine")
    assert e.line is not None


@pytest.mark.parametrize("command,extra,line,key", [
    ('["tool", "a\\u0000b"]', "", 6, "subject.options.command"),
    ('"tool"', ', env = { X = "1\\u0000" }', 6, "subject.options.env.X"),
    ('"tool"', "", 10, "toggle[1].values"),
])
def test_a_nul_byte_for_a_command_is_refused_at_its_line(tmp_path, command, extra, line, key):
    tog = '[[toggle]]\nname = "a"\nkey = "A"\nvalues = ["0", "1\\u0000"]\n' if line == 10 else ""
    at(tmp_path, _proc(command, extra, tog), line, key, "NUL byte")


def test_a_relative_cwd_is_relative_to_the_profiles_folder(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    f = write(tmp_path, _proc(extra=', cwd = "work"'))
    monkeypatch.chdir("/")
    assert load_profile(f).subject.options["cwd"] == str(tmp_path / "work")
    at(tmp_path, _proc(extra=', cwd = "nowhere"'), 6, "subject.options.cwd", f"{tmp_path / 'nowhere'} is not a folder")
