"""The config package's one error: a bad config file, key or value, named in one line (`key: why (got value)`)."""

from __future__ import annotations

from megamemo.util.errors import MegamemoError


class ConfigError(MegamemoError, ValueError):
    """A bad config file, key or value; the message names it."""
