"""The exception types of the data package."""


class DataError(ValueError):
    """A data configuration or file problem; the message names the culprit and the fix."""


class ShortSplitError(DataError):
    """A split gives fewer batches than were asked of it."""
