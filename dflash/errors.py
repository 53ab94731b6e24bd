class DflashError(Exception):
    """A problem with the user's input or environment.

    The message must name the problem and the fix; the CLI prints it and exits with status 2.
    """
