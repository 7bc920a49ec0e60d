"""The prompt-length message: never a negative --tokens to suggest, and a profile's setting named
by its FILE:LINE (the user fixes the line, not a flag they never typed)."""
from __future__ import annotations

import re

from clitools import one_line_error, run_cli as run

CONTEXT = 4096  # the embedded model's max_position_embeddings


def test_a_prompt_that_fills_the_context_asks_for_a_shorter_prompt(capsys):
    ids = ",".join(["1"] * CONTEXT)
    code, _, err = run(capsys, "dump", "--prompt-ids", ids, "--tokens", "1", "--out", "never.txt")
    line = one_line_error(err)
    assert code == 2 and not re.search(r"-\d", line.split("error:", 1)[1]), line
    assert f"{CONTEXT} tokens fill the model's context of {CONTEXT}" in line
    assert f"shorten it to {CONTEXT - 1} tokens or less" in line


def test_too_many_tokens_from_a_profile_names_its_line(tmp_path, capsys):
    prof = tmp_path / "p.toml"
    prof.write_text('description = "x"\nprompt_ids = [1, 2, 3]\ntokens = 5000\n'
                    '[reference]\nengine = "cpu"\n[subject]\nengine = "sim"\n')
    code, _, err = run(capsys, "run", "--profile", str(prof))
    line = one_line_error(err)
    assert code == 2 and f"{prof}:3: tokens 5000:" in line and f"set tokens = {CONTEXT - 3} or less" in line
    code, _, err = run(capsys, "run", "--profile", str(prof), "--tokens", "4094")  # the flag wins, and is named
    line = one_line_error(err)
    assert code == 2 and "error: --tokens 4094:" in line and "p.toml" not in line


def test_an_error_line_quoting_outside_text_is_inert(capsys):
    """A path (or any outside text) an error quotes cannot set the window title or clear the screen."""
    code, _, err = run(capsys, "dump", "--model", "/nope/\x1b]0;owned\x07\x1b[2J", "--out", "never.txt")
    line = one_line_error(err)
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b]0;owned\\x07" in line
