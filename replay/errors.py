"""An error whose one-line message is the whole story for the user."""

from __future__ import annotations


class OptionError(ValueError):
    """A value the user gave (an option, or what it names on this host) cannot be used.

    The message names the option and the value in one line, so it is shown exactly as it is,
    with no exception type in front: on the master as `replay: <message>` (exit 2), on a
    worker in its READY error and so in its rows' `worker failed: <message>` label.
    """
