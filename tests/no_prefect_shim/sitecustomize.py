"""Test-only: with this folder on PYTHONPATH, `import prefect` fails in every process started from it, as on a bare GPU
image that has torch and transformers but no Prefect. The commands that must run there (`sftflow plan` on a dataset
index, `sftflow train`, the training worker) are tested under it."""

import sys


class _NoPrefect:
    def find_spec(self, name, path=None, target=None):
        if name == "prefect" or name.startswith("prefect."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests/no_prefect_shim)", name=name)
        return None


sys.meta_path.insert(0, _NoPrefect())
