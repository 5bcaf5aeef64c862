"""``python -m boxd``: the CLI (also how clients start the embedded daemon)."""

from boxd.cli import main

if __name__ == "__main__":
    main()
