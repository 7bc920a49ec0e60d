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


# ---- what the file system refuses is one line, at the path check and at creation

def test_a_name_the_file_system_refuses_is_one_line(tmp_path):
    """300 characters: the file system's own "File name too long"; 250: its temporary name (14 longer)
    would be. Either way one line, before anything is written, naming the most the name may have."""
    from kestrel_tui.files import NAME_EXTRA, check_new_path

    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    for n in (name_max + 45, name_max - 5, name_max - NAME_EXTRA + 1):
        with pytest.raises(UsageError) as e:
            with create_whole(tmp_path / ("x" * n)):
                pass
        msg = str(e.value)
        assert "\n" not in msg and f"a name of {n} bytes" in msg and f"to {name_max - NAME_EXTRA} bytes or less" in msg
    assert check_new_path(tmp_path / ("x" * (name_max - NAME_EXTRA))) and names(tmp_path) == []
    with create_whole(tmp_path / ("x" * (name_max - NAME_EXTRA))) as f:  # the longest allowed is written
        f.write("x")
    assert names(tmp_path) == ["x" * (name_max - NAME_EXTRA)]


def test_a_path_longer_than_the_system_takes_is_one_line(tmp_path):
    """The app's export writes into a folder under the export folder: a path past PATH_MAX is refused by
    the same check (exports.write_screenshot goes through create_whole)."""
    from kestrel_tui.app.export import write_screenshot

    deep = tmp_path.joinpath(*["d" * 200] * 25)  # 5000+ characters: longer than any PATH_MAX of Linux
    with pytest.raises(UsageError) as e:
        write_screenshot(deep, "<svg/>")
    assert "\n" not in str(e.value) and "File name too long; shorten the path" in str(e.value)


def test_a_file_where_a_folder_should_be_and_a_link_loop_are_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match=r"afile/out\.txt: Not a directory; a part of the path is a file"):
        with create_whole(tmp_path / "afile" / "out.txt"):
            pass
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UsageError, match="symbolic link loop"):
        with create_whole(tmp_path / "a" / "out.txt"):
            pass
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="already exists"):  # a dangling link is something there too
        with create_whole(tmp_path / "dangling"):
            pass


def test_no_permission_is_one_line(tmp_path, monkeypatch):
    """EACCES (the tests may run as root, whom permissions do not stop: the file system's answer is
    made here)."""
    locked = tmp_path / "locked"
    real_stat, real_lstat = os.stat, os.lstat

    def refuse(real):
        def stat_(path, *a, **kw):
            if str(path).startswith(str(locked)):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *a, **kw)
        return stat_
    monkeypatch.setattr(os, "stat", refuse(real_stat))
    monkeypatch.setattr(os, "lstat", refuse(real_lstat))
    with pytest.raises(UsageError, match=r"locked/out\.txt: Permission denied; choose a folder you may write in"):
        with create_whole(locked / "out.txt"):
            pass


@pytest.mark.parametrize("argv", [["dump", "--tokens", "1", "--out"], ["export", "--out"], ["repro", "--tokens", "1"]])
def test_the_commands_refuse_a_long_name_in_one_line(capsys, tmp_path, argv):
    from clitools import one_line_error, run_cli

    name = "y" * 300 + (".gguf" if argv[0] == "export" else "")
    code, _, err = run_cli(capsys, *argv, tmp_path / name, "--no-cache" if argv[0] != "export" else "--weights=f32")
    assert code == 2 and "a name of" in one_line_error(err) and names(tmp_path) == []
