"""files.create_whole: a file is whole at its name or not there, and nothing is replaced."""
import os
import stat

import pytest

from kestrel_tui.errors import UsageError
from kestrel_tui.files import PartialFileError, create_whole, is_partial_name


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_appears_only_when_the_block_ends(tmp_path):
    p = tmp_path / "out.txt"
    with create_whole(p) as f:
        f.write("a\n")
        f.flush()
        assert not p.exists() and len(names(tmp_path)) == 1 and names(tmp_path)[0].startswith(".out.txt.")
    assert p.read_bytes() == b"a\n" and names(tmp_path) == ["out.txt"]


def test_mode_follows_the_umask_like_open(tmp_path):
    old = os.umask(0o022)
    try:
        with create_whole(tmp_path / "a.txt") as f:
            f.write("x")
        with open(tmp_path / "b.txt", "x") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a.txt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o644


def test_an_error_keeps_the_partial_file_under_a_name_that_says_so(tmp_path):
    p = tmp_path / "out.txt"
    with pytest.raises(PartialFileError) as e:
        with create_whole(p) as f:
            f.write("half")
            raise OSError(28, "No space left on device")
    assert e.value.partial == tmp_path / "out.txt.partial"
    assert str(e.value) == f"{p}: not written (No space left on device); the unfinished file is kept as {p}.partial"
    assert names(tmp_path) == ["out.txt.partial"] and e.value.partial.read_text() == "half"
    # a second failure never replaces the first partial file
    with pytest.raises(PartialFileError) as e2:
        with create_whole(p) as f:
            f.write("second")
            raise UsageError("bad key")
    assert e2.value.partial == tmp_path / "out.txt.partial.2"
    assert (tmp_path / "out.txt.partial").read_text() == "half"
    assert all(is_partial_name(n) for n in names(tmp_path)) and not is_partial_name(p)


def test_ctrl_c_propagates_with_the_partial_path(tmp_path):
    p = tmp_path / "out.txt"
    with pytest.raises(KeyboardInterrupt) as e:
        with create_whole(p) as f:
            f.write("half")
            raise KeyboardInterrupt
    assert e.value.partial == tmp_path / "out.txt.partial" and not p.exists()


def test_never_replaces_a_file_there_before_or_made_meanwhile(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("precious")
    with pytest.raises(UsageError, match="already exists; kestrel-tui never overwrites"):
        with create_whole(p):
            pass
    p.unlink()
    with pytest.raises(PartialFileError, match="appeared while it was being written") as e:
        with create_whole(p) as f:
            f.write("new")
            p.write_text("someone else's")
    assert p.read_text() == "someone else's" and e.value.partial.read_text() == "new"


def test_missing_folder_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"no such directory for out\.txt"):
        with create_whole(tmp_path / "nope" / "out.txt"):
            pass


def test_a_file_still_being_written_when_the_tool_ends_is_kept_as_partial(tmp_path):
    """The tool's end (a signal, the app quitting while a worker writes) leaves no hidden temporary file."""
    from kestrel_tui import procs

    p = tmp_path / "out.txt"
    cm = create_whole(p)
    f = cm.__enter__()
    f.write("half\n")
    f.flush()
    assert len(names(tmp_path)) == 1 and names(tmp_path)[0].startswith(".out.txt.")
    procs.cleanup()
    assert names(tmp_path) == ["out.txt.partial"] and (tmp_path / "out.txt.partial").read_text() == "half\n"
    f.close()
    with create_whole(tmp_path / "b.txt") as g:  # a file written whole is no longer registered
        g.write("x")
    procs.cleanup()
    assert (tmp_path / "b.txt").read_text() == "x"
