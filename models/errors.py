"""DataError: the one exception the bundled data raises (models/data.py, models/shakespeare.py),
which the scripts hand to ``failures.run`` to print in one line."""


class DataError(Exception):
    """A dataset problem the user can fix; the message is one line that says how."""
