"""``python -m speech_assets.runtime.orphan_guard -- COMMAND...``: run COMMAND so that it is
killed when the process that started this one dies (``PR_SET_PDEATHSIG`` survives ``execve``).

Linux only has that signal: elsewhere (macOS) COMMAND runs as is, and the training workers'
launcher watchdog (:mod:`speech_assets.runtime.processes`) is what ends them with their launcher."""

from __future__ import annotations

import os
import sys

from speech_assets.runtime.processes import die_with_parent


def main(argv: list[str]) -> None:
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        sys.exit("usage: python -m speech_assets.runtime.orphan_guard -- COMMAND [ARGS...]")
    die_with_parent()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
