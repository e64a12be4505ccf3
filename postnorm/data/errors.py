"""The exception types of the data package."""

from postnorm.errors import UserError


class DataError(UserError, ValueError):
    """A data configuration or file problem; the message names the culprit and the fix."""


class ShortSplitError(DataError):
    """A split gives fewer batches than were asked of it."""
