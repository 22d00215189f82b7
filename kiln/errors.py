"""Errors users see. Each message names the field or file at fault and says how to fix it."""


class KilnError(Exception):
    """Base of every error kiln reports to a user (the CLI prints it without a traceback)."""
