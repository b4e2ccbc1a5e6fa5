"""`python -m taperfold ...`: the same command line as the `taperfold` script, for running from a source tree
(PYTHONPATH=. on a machine where the package is not installed)."""

from taperfold.cli import main

if __name__ == "__main__":
    main()
