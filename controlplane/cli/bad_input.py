class BadInput(Exception):
    """A problem with what the user asked for, said in one line: `sluice` prints it and exits with 2."""
