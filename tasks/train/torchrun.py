"""`python -m sftflow.tasks.train.torchrun ARGS`: torchrun (`torch.distributed.run`) that dies with the launcher.

The launcher starts torchrun in a session of its own; this entry point first asks the kernel to kill it when the
launcher dies (`sftflow.tasks.train.lifetime`), then runs torchrun's own `main` with the same arguments.
"""

from __future__ import annotations

import os
import sys

from sftflow.tasks.train.lifetime import LAUNCHER_PID_VAR, TORCHRUN_PID_VAR, die_with_parent


def main() -> None:
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    die_with_parent(int(launcher) if launcher else None)
    os.environ[TORCHRUN_PID_VAR] = str(os.getpid())  # the workers' parent, for their own check
    from torch.distributed.run import main as torchrun_main

    sys.argv = ["torchrun", *sys.argv[1:]]
    torchrun_main()


if __name__ == "__main__":
    main()
