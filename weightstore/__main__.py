"""``python -m weightstore``: the ``ws`` command, for environments without the console script.

The package's first lines made Ctrl-C end the process quietly while it imported (as the console
script's entry does); :func:`_weightstore_cli.main` goes on so while the command imports, and
hands Ctrl-C back to the command once it runs."""

from _weightstore_cli import main

if __name__ == "__main__":
    main()
