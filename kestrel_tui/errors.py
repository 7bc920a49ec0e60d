"""The one exception type for bad user input: its message is a single line that
names the problem and the fix; the CLI prints it and exits 2, the app shows it."""


class UsageError(Exception):
    pass
