"""``--chat-template``: the server's chat template, given as a file or inline, used instead
of the model's (vLLM's flag). A template sent in a request still needs
--trust-request-chat-template (see ``serving_base``)."""

from __future__ import annotations

import os

# What only a Jinja template contains: text without it was meant as a path.
JINJA_MARKERS = ("{{", "{%")


def load_chat_template(value: str | None) -> str | None:
    """The template text of a file path or an inline template; None stays None. A value that
    is neither is an error: a mistyped path must not pass for a one-line template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(marker in value for marker in JINJA_MARKERS):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
