"""The compiled tables of a catalog: built from its items (``compile``: ``trie`` whole, ``chunks`` in bounded memory),
its items read back (``items``), updated by a delta (``delta``), and overlay versions (``overlay`` of ``stacked``
arrays)."""
