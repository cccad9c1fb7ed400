"""Catalogs, a token tree given as its items, and their formats: the items and canonical bytes (``catalog``), the
NDJSON upload read (``parse``), item lines as arrays (``lines``) and the Parquet upload (``parquet``)."""
