"""The command line's options come from one table (cli.ARGS, cli.COMMANDS): one declaration and one
default each, the default being the constant the rest of the tool uses; --tol says in every command
what it defaults to there, which is what the command then judges by; the cuda options travel down
under one name to one builder."""
import argparse

import pytest

from kestrel_tui import cli, commands
from kestrel_tui.backends.cuda.options import CudaOptions
from kestrel_tui.engines.base import EngineSpec
from kestrel_tui.engines.build import make_engine
from kestrel_tui.engines.decoders import CPU_IMPLS
from kestrel_tui.engines.profile import CHOICES
from kestrel_tui.errors import UsageError
from kestrel_tui.session.graft import DEFAULT_LIMIT
from kestrel_tui.session.inputs import engines_from_options, run_config
from kestrel_tui.session.iso import DEFAULT_WIDTH
from kestrel_tui.session.repro import DEFAULT_MAX_MB
from kestrel_tui.session.session import FORCINGS, MODES, PREFILLS

from clitools import one_line_error, run_cli as run


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _action(sub: argparse.ArgumentParser, flag: str):
    return next((a for a in sub._actions if flag in a.option_strings), None)


def test_every_command_takes_its_defaults_and_choices_from_the_tool_s_constants():
    want = {"--mode": (MODES[0], MODES), "--prefill": (PREFILLS[0], PREFILLS),
            "--forcing": (FORCINGS[0], FORCINGS), "--limit": (DEFAULT_LIMIT, None),
            "--max-mb": (DEFAULT_MAX_MB, None), "--m": (DEFAULT_WIDTH, None), "--weights": (None, CHOICES["weights"]),
            "--kv": (None, CHOICES["kv"]), "--cpu-impl": (None, CPU_IMPLS)}
    seen = set()
    for name, sub in _subparsers().items():
        for flag, (default, choices) in want.items():
            action = _action(sub, flag)
            if action is None:
                continue
            seen.add(flag)
            assert (action.default, action.choices and tuple(action.choices)) == (default, choices), (name, flag)
            if default is not None:
                assert str(default if not isinstance(default, float) else f"{default:g}") in action.help, (name, flag)
    assert seen == set(want)


def test_tol_is_one_option_whose_help_names_the_default_each_command_judges_by():
    subs = _subparsers()
    assert {name for name, sub in subs.items() if _action(sub, "--tol")} == set(commands.TOLERANCE_DEFAULT)
    for name, default in commands.TOLERANCE_DEFAULT.items():
        help_ = _action(subs[name], "--tol").help
        fallback = "else the bits (ok/DIFF)" if default is None else f"else {default.spec()}"
        assert f"default: the profile's tolerance, {fallback}" in help_ and "PATTERN:CRITERIA" in help_, name
        args = argparse.Namespace(cmd=name, tol=None)
        assert commands._tolerance(args, None if name == "diff" else run_config()) == default


@pytest.mark.parametrize("argv, tolerance", [(["sweep", "--what", "toggle:norm"], "nmse=1e-07"),
                                             (["sweep", "--what", "toggle:norm", "--tol", "ulp=0"], "ulp=0")])
def test_sweep_judges_by_the_default_its_help_names(capsys, argv, tolerance):
    code, out, _ = run(capsys, *argv, "--tokens", "1", "--json", "--no-cache")
    import json

    assert code in (0, 1) and json.loads(out)["tolerance"] == tolerance


def test_the_cuda_options_reach_the_engine_under_one_name(tmp_path, small_model):
    """A profile's cuda subject brings its own switches; --cuda-options goes over them, by one builder."""
    prof = tmp_path / "p.toml"
    prof.write_text('[reference]\nengine = "cpu"\n[subject]\nengine = "cuda"\n[subject.options]\npdl = "off"\n')
    config = run_config(profile=str(prof), cuda_options="graph=off")
    assert config.cuda_options == "graph=off"
    _, sub = engines_from_options(config, small_model, sides=("subject",))  # no device work: nothing runs
    assert sub.cuda_options == CudaOptions.of({"pdl": "off"}, "graph=off")
    assert not sub.cuda_options.graph and not sub.cuda_options.pdl and sub.cuda_options.fuse
    assert make_engine(EngineSpec("cuda"), small_model, cuda_options="fuse=off").cuda_options == \
        CudaOptions.from_env().set({"fuse": "off"})
    assert make_engine(EngineSpec("sim"), small_model, cuda_options="fuse=off").cuda_options is None


def test_a_misspelt_cuda_switch_is_one_line_before_any_model(capsys):
    code, _, err = run(capsys, "run", "--cuda-options", "grpah=off", "--model", "/nonexistent")
    assert code == 2 and "cuda option 'grpah': choose from graph, pdl, fuse, pv_spread" in one_line_error(err)


def test_cpu_impl_is_checked_where_it_is_read(small_model):
    config = run_config(cpu_impl="fortran")  # the command line's choices stop it; the library checks once
    with pytest.raises(UsageError, match=r"^--cpu-impl fortran: choose from auto, compiled, numpy$"):
        engines_from_options(config, small_model, sides=("reference",))
