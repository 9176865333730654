"""``python -m widellm``: the ``widellm`` command line."""

from widellm.entrypoints.cli import main

if __name__ == "__main__":
    main()
