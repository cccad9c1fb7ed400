"""The config manager in-process for the integration and fault tests: the real manager with a real (embedded)
Redis and the real tokenizer, no Ray. One constructor and one runner shared by the test modules (the
``start_manager`` fixture of ``tests/conftest.py`` is the context-manager form of the same)."""

from __future__ import annotations

import asyncio

from config import ServerSettings
from deployments.manager import ConfigManager

__all__ = ["make_manager", "run_closing"]


def make_manager(tokenizer, data_dir, *, client=None, seed: bool = False, **kw) -> ConfigManager:
    """A manager on ``data_dir`` (its Redis as the settings say, by default the embedded one; or ``client``), example scenarios seeded only with ``seed``;
    short replica timeouts and reconcile interval for tests. ``settings={...}``: more ``ServerSettings`` fields;
    other keywords go to ``ConfigManager``."""
    settings = ServerSettings(data_dir=str(data_dir), seed_examples=seed, **kw.pop("settings", {}))
    kw = {"replica_timeout_s": 1.0, "broadcast_timeout_s": 5.0, "reconcile_interval_s": 0.5, **kw}
    return ConfigManager(settings, tokenizer=tokenizer, redis_client=client, **kw)


def run_closing(manager: ConfigManager, fn):
    """``await fn()`` in a fresh event loop, then close the manager; returns what ``fn`` returned."""
    async def main():
        try:
            return await fn()
        finally:
            await manager.close()

    return asyncio.run(main())
