"""User-facing errors: one line that says what is wrong and what to do."""


class VegasError(Exception):
    """Bad input from the user (model path, prompt, option).

    The CLIs print the message on one line and exit with code 2; a traceback
    is shown only with ``--debug``.
    """

    exit_code = 2
