"""Errors that carry a one-line message meant for the user (CLI and UI show it as is), and the one reader of a
comma-separated list a user typed."""


class KvlabError(ValueError):
    """Bad input or an impossible request; the message is shown to the user unchanged."""


class Stopped(Exception):
    """Work ended on request (a Stop or Cancel); the turn it ended left every cache as before it."""


def split_items(text: str, what: str) -> tuple[str, ...]:
    """``text``'s comma-separated items, stripped, none at all for a blank text; an empty item between two others
    (``16,,32``: a number left out?) is refused."""
    parts = [part.strip() for part in str(text).split(",")]
    while parts and not parts[-1]:
        parts.pop()
    while parts and not parts[0]:
        parts.pop(0)
    if not all(parts):
        raise KvlabError(f"{what} {text!r} has an empty item between two commas")
    return tuple(parts)
