"""The export's one error type (kept apart so every export module can raise
it without importing the exporter)."""


class ExportError(Exception):
    """A problem the user can fix; the message says what it is."""
