"""The config manager (one Serve replica): Redis <-> compiled tables <-> model replicas.

``facade.py`` ConfigManager, the deployment the ingress and the replicas call; its parts: ``compiler.py``
(validate and compile), ``served.py`` (what is served), ``registry.py`` (replica long poll and acks),
``reconciler.py`` (load at start, follow Redis).
"""

from .facade import ConfigManager

__all__ = ["ConfigManager"]
