"""``python -m weightstore``: the ``ws`` command, for environments without the console script."""

from weightstore.cli.main import main

if __name__ == "__main__":
    main()
