"""The roof: the `zerobubble` console script and `serve`. Nothing below imports this package."""
