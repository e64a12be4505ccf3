"""The one exception type of the data package."""


class DataError(ValueError):
    """A data configuration or file problem; the message names the culprit and the fix."""
