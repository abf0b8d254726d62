"""The one exception type that means "the user's input is wrong", not "the program is"."""


class UserError(Exception):
    """Bad input: reported as one line and a non-zero exit, with no traceback."""
