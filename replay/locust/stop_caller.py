"""Locust's `Runner.stop` names its caller in a debug line, `inspect.getframeinfo(inspect.stack()[1][0])`:
`inspect.stack()` reads the source file of every frame on the stack and, for a frame whose file is
not on disk (`python -c`, a frozen module), `inspect.getmodule` resolves the path of every loaded
module; a replay pays that once per run, on its stop path, for a line that is logged only at
debug level. `install()` gives `locust.runners` its own `inspect`: the standard module, except
that `stack` and `getframeinfo` take each frame's file name and line number from the frame itself
and read no source (`code_context` None, as `inspect` gives with `context=0`). So the debug line
says the same, and `Runner.stop` does the same work otherwise. Only `locust.runners` sees it; the
standard module is left as it is.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType, ModuleType


class _FramesWithoutSource(ModuleType):
    """`inspect` for one module, whose stack and frame records carry no source lines."""

    def __init__(self) -> None:
        super().__init__("inspect", inspect.__doc__)

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        """`inspect.stack(context=0)`, the file of each frame as its code names it."""
        records = []
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            records.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                             frame.f_code.co_name, None, None))
            frame = frame.f_back
        return records

    @staticmethod
    def getframeinfo(frame: FrameType, context: int = 1) -> inspect.Traceback:
        """`inspect.getframeinfo(frame, context=0)` for a frame, the file as its code names it."""
        return inspect.Traceback(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None)


def install() -> None:
    """`locust.runners.inspect` becomes the source-free one (idempotent)."""
    import locust.runners

    if not isinstance(locust.runners.inspect, _FramesWithoutSource):
        locust.runners.inspect = _FramesWithoutSource()
