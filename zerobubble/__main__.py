"""`python -m zerobubble ...` is the `zerobubble` console script."""

from zerobubble.entrypoints.cli import main

main()
