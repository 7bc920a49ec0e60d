"""The cuda backend's runtime switches as one value: read from the environment in one place, set by
a profile's [subject.options] or --cuda-options, refused in one line when misspelt (no GPU needed)."""
from __future__ import annotations

import pytest

from kestrel_tui.backends.cuda.options import CudaOptions
from kestrel_tui.engines.base import EngineSpec
from kestrel_tui.engines.build import make_engine
from kestrel_tui.engines.profile import load_profile
from kestrel_tui.errors import UsageError

from clitools import one_line_error, run_cli as run


def test_environment_gives_the_defaults():
    assert CudaOptions.from_env({}) == CudaOptions(graph=True, pdl=True, fuse=True, pv_spread=True)
    off = CudaOptions.from_env({"KESTREL_CUDA_GRAPH": "0", "KESTREL_CUDA_PDL": "off", "KESTREL_CUDA_FUSE": "no",
                                "KESTREL_PV_SPREAD": "false"})
    assert off == CudaOptions(graph=False, pdl=False, fuse=False, pv_spread=False)
    assert off.describe() == "off: graph,pdl,fuse,pv_spread" and CudaOptions().describe() == ""


def test_set_and_parse():
    o = CudaOptions().parse("graph=off, fuse=0")
    assert (o.graph, o.pdl, o.fuse, o.pv_spread) == (False, True, False, True)
    assert CudaOptions(graph=False).set({"graph": True}).graph
    with pytest.raises(UsageError, match="cuda option 'graf': choose from graph, pdl, fuse, pv_spread"):
        CudaOptions().parse("graf=off")
    with pytest.raises(UsageError, match="say on or off"):
        CudaOptions().parse("graph=maybe")
    with pytest.raises(UsageError, match="write NAME=on|off"):
        CudaOptions().parse("graph")


def test_a_cuda_engine_takes_them_as_options(small_model):
    eng = make_engine(EngineSpec("cuda", options={"graph": "off", "pv_spread": "off"}), small_model)
    assert eng.cuda_options == CudaOptions.from_env().set({"graph": "off", "pv_spread": "off"})
    with pytest.raises(UsageError, match="engine sim: takes no options"):
        make_engine(EngineSpec("sim", options={"graph": "off"}), small_model)


def test_profile_options(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[reference]\nengine = "cpu"\n[subject]\nengine = "cuda"\n[subject.options]\ngraph = "off"\n')
    assert dict(load_profile(p).subject.options) == {"graph": "off"}


def test_cli_refuses_a_bad_spelling(capsys):
    code, _, err = run(capsys, "run", "--subject", "cuda", "--cuda-options", "graph=sometimes", "--tokens", "1")
    assert code == 2 and "cuda option graph=sometimes: say on or off" in one_line_error(err)


@pytest.mark.parametrize("cmd", ["run", "iso"])
def test_cli_refuses_them_without_a_cuda_side(capsys, cmd):
    code, _, err = run(capsys, cmd, "--subject", "sim", "--cuda-options", "graph=off", "--prompt-ids", "1,2",
                       "--tokens", "1")
    assert code == 2 and "--cuda-options graph=off:" in one_line_error(err) and "cuda" in err


def test_profile_refuses_a_bad_option_before_the_model(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[reference]\nengine = "cpu"\n[subject]\nengine = "cuda"\n[subject.options]\ngraf = "off"\n')
    with pytest.raises(UsageError, match=r"p.toml:6: subject.options.graf: 'graf' is not a cuda option; choose"):
        load_profile(p)
