"""The tree file format: its loaded form and rules (``data``), the loader (``load``), the checks that assemble a tree
as it is read (``builder``) and the vectorized scan of a file (``scan``)."""
