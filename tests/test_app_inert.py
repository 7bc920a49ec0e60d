"""Outside text in the app is inert: a model's own name (a GGUF's general.name) or an engine's message
with terminal control codes shows them escaped, and a runaway string is clipped, in the header and
in the status line."""
from __future__ import annotations

import dataclasses

import pytest

from test_app import make_session

pytestmark = pytest.mark.anyio

HOSTILE = "\x1b]0;owned\x07\x1b[2J"


async def test_a_hostile_model_name_is_escaped_and_clipped_in_the_header(small_model, tmp_path, make_app, settle):
    model = dataclasses.replace(small_model, name=HOSTILE + "n" * 5_000_000)
    app = make_app(make_session(model), tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        header = app.main.query_one("#header")
        text = header.render().plain
        assert "\x1b" not in text and "\x07" not in text and "\\x1b]0;owned\\x07" in text
        assert len(text) < 2000 and "more characters)" in text
        status = app.main.status
        status.set_text("engine said: " + HOSTILE + "x" * 10**6, "error")
        assert "\x1b" not in status.text and len(status.text) < 1100 and "\\x1b[2J" in status.text
