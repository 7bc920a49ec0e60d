"""The engine table (engines/registry.py) against everything that names engines: make_engine, the
profile loader, the command line's choices and --subject checks, and the engine lists of README.md
and docs/profiles.md. A new engine is one table entry; these fail where it is not yet named."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kestrel_tui import commands
from kestrel_tui.cli import build_parser
from kestrel_tui.engines import child, llamacpp
from kestrel_tui.engines.base import EngineSpec
from kestrel_tui.engines.build import BACKENDS, make_engine
from kestrel_tui.engines.builtin import BuiltinEngine
from kestrel_tui.engines.profile import ProfileError, load_profile
from kestrel_tui.engines.registry import BUILTIN, ENGINE_TABLE, ENGINES, names
from kestrel_tui.errors import UsageError
from kestrel_tui.session.inputs import RunConfig

from clitools import one_line_error, run_cli as run

ROOT = Path(__file__).resolve().parents[1]
FLAG_SUBJECTS = names(flag_subject=True)


def test_the_table_in_its_order():
    # every message and doc lists the engines in this order
    assert ENGINES == ("cpu", "sim", "cuda", "hf", "hf-dist", "process", "llama.cpp", "vllm-dump",
                       "sglang-dump")
    assert BUILTIN == BACKENDS  # the built-ins are exactly the backends that decoders.make_backend builds
    # the refusal of options says "its toggles are the op families": true of built-ins only
    assert set(names(options=False)) <= set(BUILTIN)
    assert set(names(bench=True)) <= set(BUILTIN)
    with pytest.raises(TypeError, match="unknown engine fact"):
        names(builtn=True)


def test_make_engine_builds_through_the_table(small_model):
    for name in BUILTIN:
        if name != "cuda":  # a cuda engine is built without a device too, but needs PyCUDA's import
            assert isinstance(make_engine(name, small_model), BuiltinEngine)
    with pytest.raises(UsageError, match=r"^unknown engine 'cdua'; choose from cpu, sim, cuda, hf, hf-dist, process,"
                                         r" llama\.cpp, vllm-dump, sglang-dump$"):
        make_engine("cdua", small_model)
    for name in names(options=False):
        with pytest.raises(UsageError, match=rf"^engine {name}: takes no options but schedule \(got x\); its"):
            make_engine(EngineSpec(name, options={"x": "1"}), small_model)
    for name in set(ENGINES) - set(names(schedules=True)):  # a recorded run or a program keeps its own passes
        with pytest.raises(UsageError, match=rf"^engine {name}: runs its own passes, so it takes no schedule"):
            make_engine(EngineSpec(name, options={"schedule": "forward"}), small_model)


def test_an_out_of_process_engine_is_built_behind_a_child(monkeypatch, small_model):
    class Inner:
        name, toggles, caps, fields, path = "llama.cpp", (), None, (), "/m.gguf"

        class ours:
            cfg = small_model.cfg

    jobs = []
    monkeypatch.setattr(llamacpp, "make_llamacpp_engine", lambda *a, **k: Inner())
    monkeypatch.setattr(child, "in_child", jobs.append)
    for name in names(out_of_process=True):
        eng = make_engine(EngineSpec(name), small_model)
        assert isinstance(eng, child.OutOfProcess) and jobs[-1].spec.model == "/m.gguf"
    assert not isinstance(make_engine("sim", small_model), child.OutOfProcess)


def _profile(tmp_path, subject: str, extra: str = "") -> Path:
    p = tmp_path / f"{subject}.toml"
    p.write_text(f'[reference]\nengine = "cpu"\n\n[subject]\nengine = "{subject}"\n{extra}')
    return p


def test_the_profile_loader_reads_the_table(tmp_path):
    for name in ENGINES:
        p = _profile(tmp_path, name, "\n[subject.options]\nx = \"1\"\n")
        if ENGINE_TABLE[name].options:
            if name != "cuda":  # cuda's option names are checked at load (its own test)
                assert load_profile(p).subject.options == {"x": "1"}
        else:
            with pytest.raises(ProfileError, match=rf"subject.options: engine {name} takes no options but schedule;"
                                                   rf" remove them"):
                load_profile(p)
        p = _profile(tmp_path, name, "\n[subject.options]\nschedule = \"chunked:16\"\n")
        if ENGINE_TABLE[name].schedules:
            assert load_profile(p).subject.options["schedule"] == "chunked:16"
        else:
            with pytest.raises(ProfileError, match=rf"subject.options.schedule: engine {name} runs its own passes"):
                load_profile(p)

    toggle = '\n[[toggle]]\nname = "t"\nkey = "k"\nfast = "a"\nexact = "b"\n'
    others = names(builtin=False)
    for name in ENGINES:
        p = _profile(tmp_path, name, toggle)
        if name in BUILTIN:
            with pytest.raises(ProfileError) as e:
                load_profile(p)
            assert str(e.value).endswith(f"toggle[1]: engine {name} has its own toggles (the op families);"
                                         f" remove the [[toggle]] tables, or use an"
                                         f" {', '.join(others[:-1])} or {others[-1]} subject")
        else:  # every other engine takes a profile's toggles: the refusal above names each one
            assert [t.name for t in load_profile(p).subject.toggles] == ["t"]

    p = _profile(tmp_path, "cdua")
    with pytest.raises(ProfileError, match=rf"choose from {re.escape(', '.join(ENGINES))}$"):
        load_profile(p)


def _choices(sub: str, flag: str):
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in subparsers.choices[sub]._actions if flag in a.option_strings).choices


def test_the_command_line_choices_come_from_the_table():
    assert tuple(_choices("tui", "--subject")) == ("auto", *FLAG_SUBJECTS)
    assert tuple(_choices("bench", "--subject")) == names(bench=True)


@pytest.mark.parametrize("name", ENGINES)
def test_the_subject_checks_agree_with_the_table(monkeypatch, name):
    """run and bisect take --subject NAME for the table's flag subjects; the app takes those and auto."""
    from kestrel_tui.app import main as app_main

    assert commands._check_subject.__defaults__ == (FLAG_SUBJECTS,)
    monkeypatch.setattr(app_main, "run_app", lambda config: 0)
    for check, allowed in ((commands._check_subject, FLAG_SUBJECTS), (commands.cmd_tui, ("auto", *FLAG_SUBJECTS))):
        args = argparse.Namespace(subject=name)
        if name in allowed:
            check(args, RunConfig())
        else:
            with pytest.raises(UsageError, match=rf"^--subject '{re.escape(name)}': choose"
                                                 rf" {re.escape(', '.join(allowed))} \(cpu is the reference;"):
                check(args, RunConfig())


@pytest.mark.parametrize("name", [n for n in ENGINES if n not in names(builtin=True, flag_subject=True)])
def test_iso_takes_the_built_in_flag_subjects(capsys, name):
    code, _, err = run(capsys, "iso", "--subject", name)
    inside = names(builtin=True, flag_subject=True)
    assert code == 2 and one_line_error(err).endswith(f"choose {', '.join(inside[:-1])} or {inside[-1]}")


# ---------------------------------------------------------------- the docs' lists


def _strip(text: str) -> str:
    """`text` without its parenthesized asides (nested ones too)."""
    while True:
        bare = re.sub(r"\([^()]*\)", "", text)
        if bare == text:
            return text
        text = bare


def _engine_words(text: str) -> list[str]:
    """The engines a list in `text` names, in order: backticked names outside parentheses."""
    return re.findall(r"`([^`\s]+)`", _strip(text))


def test_readme_other_engines_names_the_table():
    section = (ROOT / "README.md").read_text().split("\n## Other engines", 1)[1]
    paragraph = section.split("\n\n", 2)[1]
    listed = _strip(paragraph.split("*engines*:", 1)[1]).split(". ", 1)[0]  # the sentence that lists them
    assert sorted(_engine_words(listed)) == sorted(ENGINES), paragraph


def test_docs_profiles_lists_name_the_table():
    doc = (ROOT / "docs" / "profiles.md").read_text()
    checked = set()

    comments = re.findall(r"# (cpu(?: \| [\w.-]+)+)\n", doc)
    assert comments == [" | ".join(ENGINES)], comments
    messages = re.findall(r"(?:choose from|one of) (cpu(?:, [\w.-]+)+)", doc)
    assert messages and set(messages) == {", ".join(ENGINES)}, messages

    row = next(line for line in doc.splitlines() if line.startswith("| `engine` |"))
    cell = row.split(" | ")[1]
    assert _engine_words(cell) == list(ENGINES), row
    built_in = cell.split("(built in)")[0]
    assert _engine_words(built_in) == list(BUILTIN), row

    no_options = next(p for p in doc.split("\n\n") if "take no options" in p)
    assert _engine_words(no_options.split("take no options")[0]) == list(names(options=False)), no_options

    # every line naming four engines or more is one of the lists checked above
    for line in doc.splitlines():
        if sum(bool(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", line)) for n in ENGINES) >= 4:
            checked.add(line)
    for line in checked:
        assert (line.startswith("| `engine` |") or " | ".join(ENGINES) in line
                or ", ".join(ENGINES) in line), f"an engine list the table does not check: {line}"
