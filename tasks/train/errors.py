"""What a training launch raises, in a module that imports nothing heavy: the CLI catches it without importing torch
(a command that never trains should not pay torch's import)."""


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero (a worker crashed or was killed); retrying resumes from the latest checkpoint."""
