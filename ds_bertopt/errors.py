"""The one error type users see for bad input.

Every check on user input (config, corpus, CLI flags, topology) raises :class:`BertOptError`
with a single line that names the offending key, file or value. Entry points catch it, print
the line once (rank 0) and exit with status 2, so nothing else is half-done. Faults of the
machine that end a run in a known state (a full disk during a checkpoint) are said the same way.
"""


class BertOptError(ValueError):
    """Bad user input: a config key, a value out of range, a corpus that cannot be read."""


class ConfigError(BertOptError):
    """A problem in the DeepSpeed JSON or its ``"bertopt"`` section."""


class DataError(BertOptError):
    """A corpus or labelled file that cannot be used."""


class JobError(BertOptError):
    """A verdict every rank reached together (the start-up rendezvous, the data check across nodes, the output
    directory's lock, a failed checkpoint write): every rank raises the same line, so it is printed once."""


def check(condition: bool, message: str, error: type = ConfigError) -> None:
    """Raise ``error(message)`` unless ``condition`` holds."""
    if not condition:
        raise error(message)
