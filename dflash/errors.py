class DflashError(Exception):
    """A problem with the user's input or environment.

    The message must name the problem and the fix; the CLI prints it and exits with status 2.
    """


def describe_differences(old: dict, new: dict, old_label: str, new_label: str) -> str:
    """`key: <old_label> X, <new_label> Y; ...` for every key whose value differs, sorted; '' when none does."""
    keys = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
    return "; ".join(f"{key}: {old_label} {old.get(key)!r}, {new_label} {new.get(key)!r}" for key in keys)
