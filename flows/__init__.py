# A checkout's root on sys.path must not turn this folder, or its siblings, into top-level packages.
import os

from sftflow.tasks.core.imports import install as _install

_install()

# Evaluation (and every other stage that computes on the CPU) runs in the process that runs the flow: the CLI's, or
# the subprocess Prefect starts for a deployment's flow run, which imports this package before torch. Its OpenMP
# threads, like the training worker's, should sleep rather than spin while they wait for each other, or a busy
# machine slows them many times more than their share of the CPU (a served run's eval took 5x the CLI's without it).
# OpenMP reads this when torch is first imported; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
