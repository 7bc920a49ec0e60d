"""Per-key tolerances: a default and PATTERN:CRITERIA rules (a field, or a glob over key names), the
first match judging a key; --json names the rule that judged each key."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_tui.errors import UsageError
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.trace.compare import CLOSE, FAR, Status, Tolerance, parse_tolerance
from kestrel_tui.trace.keys import parse_key

from clitools import one_line_error, run_cli as run


def test_rules_parse_and_print_back():
    t = parse_tolerance("nmse=1e-7 logits:nmse=1e-5 emb:ulp=0 t*_l3_*:rel=1e-3,ulp=8")
    assert t.rules == (("logits", Tolerance(nmse=1e-5)), ("emb", Tolerance(nmse=None, ulp=0)),
                       ("t*_l3_*", Tolerance(nmse=None, ulp=8, rel=1e-3)))
    assert parse_tolerance(t.spec()) == t
    assert parse_tolerance("logits:ulp=0").nmse == Tolerance().nmse  # no default group: the default's
    assert parse_tolerance("nmse=1e-7") == Tolerance() and not Tolerance().rules


def test_the_first_matching_rule_judges_a_key():
    t = parse_tolerance("rel=1 t*_l3_attn:ulp=1 attn:ulp=2 t1?_*:nmse=0.5")
    assert t.for_key("t5_l3_attn") == (Tolerance(nmse=None, ulp=1), "t*_l3_attn")
    assert t.for_key("t5_l2_attn") == (Tolerance(nmse=None, ulp=2), "attn")
    assert t.for_key("t12_l2_attn") == (Tolerance(nmse=None, ulp=2), "attn")  # the field rule came first
    assert t.for_key("t12_logits") == (Tolerance(nmse=0.5), "t1?_*")
    assert t.for_key("t5_logits") == (Tolerance(nmse=None, rel=1.0), "default")


@pytest.mark.parametrize("spec, says", [
    ("logit:ulp=0", "'logit' is no field (did you mean logits?)"),
    ("nmse=1e-7 ulp=4", "two default criteria"),
    (":ulp=1", "names no keys"),
    ("emb:", "empty tolerance"),
    ("emb:ulp=1 emb:ulp=2", "emb given twice"),
    ("emb:ulp=-1", "is below 0"),
])
def test_bad_rules_are_one_line(spec, says):
    with pytest.raises(UsageError, match="^--tol ") as e:
        parse_tolerance(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def fast_run(request):
    """A sim all-fast run on 4 layers: DIFF keys of many fields, with raw values on both sides."""
    model = request.getfixturevalue("small_model")
    return Session(model, default_prompt(model.cfg.vocab), 3, subject="sim").run(RunSettings(exact=frozenset()))


def test_a_rule_changes_the_verdict_of_its_keys_only(fast_run):
    base = fast_run.tolerance(Tolerance())
    assert base.first_far is not None
    field = parse_key(base.first_far).field
    loose = fast_run.tolerance(parse_tolerance(f"nmse=1e-7 {field}:nmse=1e9"))
    diff = [k for k, st in fast_run.comparison.status.items() if st is Status.DIFF]
    for key in diff:  # each verdict recomputed here from the key's metrics and its own criteria
        m = fast_run.metrics(key)
        mine = parse_key(key).field == field
        assert loose.rule[key] == (field if mine else "default")
        want = CLOSE if (m.nmse <= 1e9 if mine else m.nmse <= 1e-7) and not m.nonfinite else FAR
        assert loose.verdict[key] == want, key
        if not mine:
            assert loose.verdict[key] == base.verdict[key]
    assert any(parse_key(k).field == field and base.verdict[k] == FAR and loose.verdict[k] == CLOSE for k in diff)
    assert loose.first_far != base.first_far


def test_exact_rule_makes_every_diff_of_its_field_far(fast_run):
    summary = fast_run.tolerance(parse_tolerance("nmse=1 nrm:ulp=0"))
    nrm = [k for k, v in summary.verdict.items() if parse_key(k).field == "nrm"]
    assert nrm and all(summary.verdict[k] == FAR for k in nrm)
    assert summary.first_far == min(nrm, key=list(summary.verdict).index)


def test_run_json_names_the_rule_of_each_key(capsys, tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text('tolerance = "nmse=1e-7 nrm:nmse=1 logits:rel=10"\ntokens = 2\nprompt_ids = [1, 2]\n'
                    '[reference]\nengine = "cpu"\n[subject]\nengine = "sim"\n')
    code, out, err = run(capsys, "run", "--profile", prof, "--exact", "none", "--json", "--no-cache")
    report = json.loads(out)
    assert report["tolerance"] == "nmse=1e-07 nrm:nmse=1 logits:rel=10"
    rules = {k: v["rule"] for k, v in report["key_metrics"].items() if v is not None}
    assert rules and set(rules.values()) <= {"default", "nrm", "logits"}
    for key, rule in rules.items():
        f = parse_key(key).field
        assert rule == (f if f in ("nrm", "logits") else "default"), key
    assert code in (0, 1) and "Traceback" not in err


def test_a_misspelt_rule_in_a_profile_is_one_line_at_its_line(capsys, tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text('tokens = 2\ntolerance = "nmse=1e-7 logit:rel=1"\n[reference]\nengine = "cpu"\n'
                    '[subject]\nengine = "sim"\n')
    code, _, err = run(capsys, "run", "--profile", prof)
    line = one_line_error(err)
    assert code == 2 and f"{prof}:2: tolerance:" in line and "did you mean logits?" in line


# ---- a spec means what it says: fuzzed

@pytest.mark.parametrize("spec, says", [
    ("t*_l*_*:nmse=1e-7:ulp=4", "'t*_l*_*:nmse=1e-7:ulp=4' has 2 ':'; a rule is PATTERN:CRITERIA with one ':'"),
    ("a:b:ulp=1", "has 2 ':'"),
    ("ulp=١", "ulp='١' is not a whole number, written with the digits 0-9; ulp takes a whole number of ULPs >= 0"
              " (criteria: nmse=X, ulp=N or rel=X"),
    ("logits:nmse=١e-5", "nmse='١e-5' is not a number, written with the digits 0-9"),
    ("nmse=1_0", "written without '_'"),
    ("t*,x:ulp=1", "the pattern 't*,x' holds characters no key has"),
    ("tÿ*:ulp=1", "the pattern 'tÿ*' holds characters no key has"),
])
def test_a_spec_that_reads_otherwise_is_refused_with_the_grammar(spec, says):
    with pytest.raises(UsageError) as e:
        parse_tolerance(spec)
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(f"--tol {spec!r}: ")


_GLOBS = ["t*_l*_*", "t1?_*", "t*_l3_*", "[!t]*", "*"]
_PIECES = st.sampled_from(["nmse", "ulp", "rel", "default", "=", ",", ":", " ", "1e-7", "4", "0", "1.5", "-1",
                           "nan", "inf", "1e400", "١", "٤", "１", "1_0", "logits", "emb", "attn", "x", *_GLOBS])


@settings(max_examples=3000, deadline=None)
@given(spec=st.lists(_PIECES, max_size=10).map("".join))
def test_fuzzed_specs_parse_to_what_they_say_or_one_line(spec):
    """Accepted: every rule's pattern is one a key can match (printable ASCII, no ':', ',' or '='), every
    number was written in ASCII digits and is finite, and the spec prints back to the same tolerance."""
    try:
        t = parse_tolerance(spec)
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--tol {spec!r}: ")
        return
    assert "".join(spec.split()).isascii(), spec
    for pattern, rule in t.rules:
        assert pattern.isascii() and pattern.isprintable() and not set(pattern) & set(":,="), spec
    for criteria in (t, *(rule for _, rule in t.rules)):
        assert all(v is None or (v >= 0 and v != float("inf")) for v in (criteria.nmse, criteria.rel, criteria.ulp))
    assert parse_tolerance(t.spec()) == t
