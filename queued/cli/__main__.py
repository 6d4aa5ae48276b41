"""`python -m queued.cli`: the `queued` command."""

from queued.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
