"""The PATCH of a tree's items: a catalog's items added, removed and updated, the result stored and its tables
updated (``items``), and a catalog's rows found by item (``rows``)."""
