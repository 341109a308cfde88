# A checkout's root on sys.path must not turn this folder, or its siblings, into top-level packages.
from sftflow.tasks.core.imports import install as _install

_install()
