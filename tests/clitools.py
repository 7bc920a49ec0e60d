"""The headless commands run in-process, as the CLI tests call them (imported by several test files)."""
from kestrel_tui.cli import main


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `kestrel-tui ARGV`; output printed before the call is dropped."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    """The one non-empty line of stderr, which must hold no traceback."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
