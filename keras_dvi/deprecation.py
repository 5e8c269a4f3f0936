"""Deprecated names and functions: one warning, worded the same everywhere.

Old names keep working (and `.keras` files saved with them keep loading); using them warns
with a `DeprecationWarning` that names the replacement. CHANGELOG.md lists them.
"""

import functools
import warnings


def warn(old, instead):
    """Warns that `keras_dvi.<old>` is deprecated; `instead` says what to use (a sentence)."""
    warnings.warn(f"keras_dvi.{old} is deprecated: {instead}", DeprecationWarning, stacklevel=3)


def renamed(function, old):
    """`function` under its former name `old` (e.g. `"predictive.sample_class_probabilities"`):
    the same function, warning on each call."""
    new = f"{function.__module__.removeprefix('keras_dvi.')}.{function.__name__}"

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        warn(old, f"use keras_dvi.{new}, the same function under its new name.")
        return function(*args, **kwargs)

    wrapper.__name__ = old.rsplit(".", 1)[-1]
    wrapper.__doc__ = f"Deprecated name of `keras_dvi.{new}`."
    return wrapper
