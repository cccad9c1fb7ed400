"""The memory an admin write may take, checked before the work: a write whose estimated peak, added to what the
config manager holds now, is over ``write_memory_mb`` is refused with a 507 naming the setting and the estimate,
before anything is parsed or stored, so a write can never run the node out of memory while the service serves; and
refused too when the estimate is more than the node has free now (:func:`node_free_bytes`: the setting bounds the
manager, the node's other processes use the rest).

The estimates are measured (``parse_catalog`` then ``catalog_tables`` under ``tracemalloc``, a 10^6-item catalog of
random 4-token ids) and rounded up:

* a body that is parsed and compiled whole (a PUT of any scenario, a catalog upload): at most
  :data:`PEAK_PER_BODY_BYTE` bytes per byte of the body (a 10^6-item catalog of 4-token ids, 25 MB: 705 MB traced
  at the peak of the parse and the tables' build, 28 per byte);
* a PATCH of a tree: :data:`PATCH_BYTES_PER_ITEM` per item of the version it patches (the new version's tables and
  item list beside the old ones: 7.8 bytes per catalog byte held after a build, about 195 per 4-token item), unless
  the manager holds the catalog's items and tables: then what that PATCH makes (``TreeContent.patch_need``: its
  result pending on the held items, or a new base written out, and one copy of the tables);
* a Parquet catalog: its compressed bytes say little of what it holds (10^7 4-token items in 48 MB; a dictionary page
  holds a string once for every row that has it), so its estimate is taken from the file's footer instead
  (:func:`parquet_need`: its rows and ids, :func:`catalog_need`; with metadata columns, which are read through the
  NDJSON text they spell, also per row, per id, per value and per byte of that text, the strings counted as they
  decode), plus the file. The footer's figures are checked first; then the string columns' decoded bytes, read as
  dictionaries (``parquet.py:parquet_strings``), within what the first check allowed.
"""

from __future__ import annotations

import os
from typing import Any

from deployments.protocol import ServiceError

__all__ = ["PATCH_BYTES_PER_ITEM", "PEAK_PER_BODY_BYTE", "SETTING", "catalog_need", "check_write_memory", "held_bytes",
           "node_free_bytes", "parquet_need", "write_limit"]

SETTING = "write_memory_mb"
#: peak bytes of a parse and compile per byte of the body (measured 28 on a 10^6-item catalog)
PEAK_PER_BODY_BYTE = 32
#: bytes of a PATCH per item of the version it patches (measured about 195 for 4-token items)
PATCH_BYTES_PER_ITEM = 256
_MIB = 2**20
#: the share of the node's memory a write never counts on (Ray's memory monitor kills workers from 95% used)
NODE_RESERVE = 0.06
#: a catalog's peak per item (its lengths, row key, line end, text brackets, the Arrow column's offsets, sort temporaries)
CATALOG_BYTES_PER_ROW = 48
#: ... per id it holds (the ids, read and kept; their text, twice while it is joined; the tables' edges). With the
#: line above: 11.9 GB for 10^8 4-token items, whose upload peaked at about 10.8 GB in the manager (2026-12-02)
CATALOG_BYTES_PER_ID = 16
#: ... per id of the compile's working set: a compile of more than ``catalog_chunks.CHUNK_IDS`` ids works on one chunk of
#: that many ids at a time (the whole compile peaked at 69-86 bytes per id above the items at 10^6-10^7 4-token items)
COMPILE_BYTES_PER_ID = 96
#: a Parquet catalog with metadata columns, read through the NDJSON text it spells (``parquet.py:parquet_catalog``),
#: above :func:`catalog_need`: per row (its objects, its line), per id (listed and parsed: about 32 past the small
#: integers), per metadata value (a list's strings one by one) and per byte of the metadata's JSON text (8.0-9.6
#: measured, ASCII or not: the strings as Arrow values, Python objects, the text and its parse). Fitted to the peak
#: resident memory of ``parquet_items`` on files of 20,000-200,000 rows (one to four fields; strings of 2 to 4,000
#: bytes, repeated or distinct, ASCII or not; lists of 10 strings): the estimate is 1.16-1.48x the peak measured
TEXT_BYTES_PER_ROW = 640
TEXT_BYTES_PER_ID = 32
METADATA_BYTES_PER_VALUE = 160
METADATA_BYTES_PER_BYTE = 10


def held_bytes() -> int:
    """The resident memory of this process now."""
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def write_limit(settings: Any) -> int:
    """``write_memory_mb`` in bytes; unset: half of the machine's memory."""
    if settings.write_memory_mb is not None:
        return int(settings.write_memory_mb) * _MIB
    import psutil

    return int(psutil.virtual_memory().total) // 2


def node_free_bytes() -> int:
    """What this node can still give a write: its available memory less :data:`NODE_RESERVE` of its total (Ray's
    memory monitor kills workers from 95% used)."""
    import psutil

    memory = psutil.virtual_memory()
    return max(0, int(memory.available) - int(NODE_RESERVE * memory.total))


def catalog_need(rows: int, ids: int) -> int:
    """The estimated peak of parsing, keeping and compiling a catalog of ``rows`` items and ``ids`` ids in all."""
    from processors.kinds.tree.tables.chunks import CHUNK_IDS

    return CATALOG_BYTES_PER_ROW * rows + CATALOG_BYTES_PER_ID * ids + COMPILE_BYTES_PER_ID * min(ids, CHUNK_IDS)


def parquet_need(shape: Any) -> int:
    """The estimated peak of reading, keeping and compiling a Parquet catalog (``shape``: its
    ``parquet.py:ParquetShape``), the file itself not counted."""
    need = catalog_need(shape.rows, shape.ids)
    if shape.values:  # metadata columns: read through the NDJSON text they spell
        need += (TEXT_BYTES_PER_ROW * shape.rows + TEXT_BYTES_PER_ID * shape.ids
                 + METADATA_BYTES_PER_VALUE * shape.values + METADATA_BYTES_PER_BYTE * shape.metadata_bytes)
    return need


def check_write_memory(settings: Any, need: int, what: str, *, name: str) -> None:
    """Refuse (507) a write of scenario ``name`` that needs about ``need`` bytes (``what`` says how it was estimated)
    when it does not fit beside what the manager holds."""
    limit = write_limit(settings)
    held = held_bytes()
    free = node_free_bytes()
    if held + need <= limit and need <= free:
        return
    detail = {"name": name, "setting": SETTING, "limit_mb": limit // _MIB, "estimate_mb": round(need / _MIB, 1),
              "held_mb": round(held / _MIB, 1)}
    if held + need <= limit:  # within the setting, but the node has not that much free: the OOM killer would act
        raise ServiceError(
            507,
            f"{what} needs about {need / _MIB:,.0f} MiB, more than the {free / _MIB:,.0f} MiB this node has free now "
            f"(available memory less {NODE_RESERVE:.0%} of it, where Ray's memory monitor starts killing); nothing "
            f"was stored ({SETTING}={limit // _MIB} MiB would allow it: free memory on the node, or split the write)",
            {**detail, "node_free_mb": round(free / _MIB, 1)})
    raise ServiceError(
        507,
        f"{what} needs about {need / _MIB:,.0f} MiB beside the {held / _MIB:,.0f} MiB the config manager holds, "
        f"over {SETTING}={limit // _MIB} MiB; nothing was stored (raise {SETTING}, or split the write)", detail)
