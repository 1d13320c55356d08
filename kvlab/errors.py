"""Errors that carry a one-line message meant for the user (CLI and UI show it as is)."""


class KvlabError(ValueError):
    """Bad input or an impossible request; the message is shown to the user unchanged."""


class Stopped(Exception):
    """Work ended on request (a Stop or Cancel); the turn it ended left every cache as before it."""
